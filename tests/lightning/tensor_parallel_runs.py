"""Tensor parallel under ZeRO (``tensor_parallel_size=2``) against one process on the same global batches, and against
Lightning's ``ModelParallelStrategy`` (FSDP2 + TP) on the same run (one launched script).

    python tests/lightning/tensor_parallel_runs.py OUT_DIR   # with 4 ranks (tp2 x dp2) or 2 (tp2 x dp1)

A tiny transformer-like model (an embedding, a norm, a column-wise then row-wise Linear pair, a norm, an output
Linear) parallelized by the user's ``configure_model`` with torch's plan styles, the norms ``SequenceParallel`` (their
gradients come back ``Partial``), trained 4 AdamW steps (fused=False) with gradient clipping. Rank 0 writes
``OUT_DIR/<run>_dp<N>.pt``: each step's loss and pre-clip gradient norm, the final parameters as full tensors, and the
messages of the refusals tried; ``reference_dp<N>.pt`` is one process on the same global batches.
tests/lightning/test_tensor_parallel.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy

VOCAB, HIDDEN, FFN, SEQ = 16, 16, 32, 4
MICRO, STEPS, CLIP, LR = 2, 4, 0.05, 0.02


class TinyBlock(nn.Module):
    """An embedding, one pre-norm MLP block with a residual, a final norm and the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, V)
        x = self.embed(tokens)
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm1(x))))
        return self.head(self.norm2(x))


def build() -> TinyBlock:
    torch.manual_seed(7)
    model = TinyBlock()
    with torch.no_grad():  # norms away from their (1, 0) start, so their gradients matter
        for norm in (model.norm1, model.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.2, 0.2)
    return model


def parallelize(model: TinyBlock, tp_mesh: Any) -> None:
    """torchtitan's plan: the embedding row-wise into sequence shards, norms ``SequenceParallel``, the pair column-wise
    then row-wise, the output column-wise gathered back to whole logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm1": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def optimizer_of(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=False, foreach=False)


class Module(LightningModule):
    def __init__(self, fsdp: bool = False) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.model = build()
        self.losses: list[float] = []
        self.norms: list[float] = []

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh["tensor_parallel"])
        if self.fsdp:  # Lightning's ModelParallelStrategy: FSDP2 over the data-parallel dimension
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        loss = loss_of(self.model, *batch)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())  # the global batch's
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.fsdp:
            self.norms.append(self.trainer.strategy.grad_norm().item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_of(self.parameters())


def trainer(strategy: Any, devices: int, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   gradient_clip_val=CLIP, **kwargs)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def run(out: Path, name: str, strategy: Any, devices: int, fsdp: bool = False) -> None:
    module = Module(fsdp)
    fit = trainer(strategy, devices)
    fit.fit(module, DataLoader(dataset(), batch_size=MICRO))
    params = full_parameters(module.model)
    if fit.is_global_zero:
        torch.save({"losses": module.losses, "norms": module.norms, "params": params,
                    "sampler": fit.strategy.distributed_sampler_kwargs}, out / f"{name}.pt")


def refusal(out: Path, name: str, call: Any) -> None:
    try:
        call()
        message = None
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        message = f"{type(err).__name__}: {err}"
    if dist.get_rank() == 0:
        torch.save({"message": message}, out / f"{name}.pt")


def refusals(out: Path, devices: int, dp: int) -> None:
    fitted = Module()
    fit = trainer(ZeroStrategy(stage=2, tensor_parallel_size=2), devices)
    fit.fit(fitted, DataLoader(dataset(), batch_size=MICRO))
    refusal(out, f"refused_save_dp{dp}", lambda: fit.save_checkpoint(out / "never.ckpt"))
    with_callback = Trainer(accelerator="cpu", devices=devices, strategy=ZeroStrategy(stage=2, tensor_parallel_size=2),
                            max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=out)
    refusal(out, f"refused_checkpointing_dp{dp}", lambda: with_callback.fit(Module(), DataLoader(dataset(),
                                                                                              batch_size=MICRO)))


def reference(out: Path, dp: int) -> None:
    """One process, the global batch of each step: what each data rank's distributed sampler hands it (Lightning's, for
    a training DataLoader: shuffled with seed 0), MICRO samples per data rank and step."""
    from torch.utils.data import DistributedSampler

    model = build()
    optimizer = optimizer_of(model.parameters())
    x, y = dataset().tensors
    orders = [list(DistributedSampler(dataset(), num_replicas=dp, rank=d, shuffle=True, seed=0)) for d in range(dp)]
    losses, norms = [], []
    for step in range(STEPS):
        rows = [order[step * MICRO + i] for order in orders for i in range(MICRO)]
        loss = loss_of(model, x[rows], y[rows])  # the mean over dp equal micro-batches: each rank's mean, averaged
        losses.append(loss.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    torch.save({"losses": losses, "norms": norms, "params": full_parameters(model)}, out / f"reference_dp{dp}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    world = int(__import__("os").environ["WORLD_SIZE"])
    dp = world // 2
    for stage in (1, 2):
        run(out_dir, f"zero{stage}_dp{dp}", ZeroStrategy(stage=stage, tensor_parallel_size=2), world)
    if dp == 2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        run(out_dir, f"model_parallel_dp{dp}", ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=2),
            world, fsdp=True)
    else:
        refusals(out_dir, world, dp)
    if dist.get_rank() == 0:
        reference(out_dir, dp)
    destroy_process_group()
