"""Tensor parallel under ZeRO (``tensor_parallel_size=2``) against one process on the same global batches, and against
Lightning's ``ModelParallelStrategy`` (FSDP2 + TP) on the same run (one launched script).

    python tests/lightning/tensor_parallel_runs.py OUT_DIR LLAMA_DIR   # with 4 ranks (tp2 x dp2) or 2 (tp2 x dp1)

Two models parallelized by the user's ``configure_model`` with torch's plan styles: a tiny transformer-like model (an
embedding, a norm, a column-wise then row-wise Linear pair, a norm, an output Linear), the norms ``SequenceParallel``
(their gradients come back ``Partial``), and a tiny Hugging Face Llama read with ``from_pretrained`` from LLAMA_DIR,
with a plan over q/k/v/o and gate/up/down. Each trained 4 AdamW steps (fused=False) with gradient clipping. Rank 0
writes ``OUT_DIR/<run>_dp<N>.pt``: each step's loss (the global batch's) and pre-clip gradient norm, the final
parameters as full tensors, and the messages of the refusals tried; ``reference[_llama]_dp<N>.pt`` is one process on
the same global batches.
tests/lightning/test_tensor_parallel.py compares them.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
import lzero
from lzero import ZeroStrategy

VOCAB, HIDDEN, FFN, SEQ = 16, 16, 32, 4
MICRO, STEPS, CLIP, LR, VALIDATION = 2, 4, 0.05, 0.02, 8


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


LLAMA_PLAN = {  # the user's plan: attention heads and MLP columns split, their outputs summed back (row-wise)
    **{f"model.layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")},
    "model.layers.*.self_attn.o_proj": "rowwise",
    **{f"model.layers.*.mlp.{name}": "colwise" for name in ("gate_proj", "up_proj")},
    "model.layers.*.mlp.down_proj": "rowwise",
}


def save_llama(folder: Path) -> None:
    """A tiny Llama (2 layers, 4 heads, 2 KV heads: one per tensor rank), written with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)


GPT = "gpt"
"""In place of a Llama folder: lzero's demo GPT (2 blocks), its MLPs parallelized by ``parallelize_gpt``."""


def build_gpt() -> nn.Module:
    from lzero.demo.model import GPT as DemoGPT, GPTConfig

    torch.manual_seed(5)
    return DemoGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=HIDDEN))


def parallelize_gpt(model: nn.Module, tp_mesh: Any) -> None:
    """A user's plan for the demo GPT: each MLP column-wise then row-wise (its attention's fused q/k/v projection and
    the head tied to the embedding stay whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()})


def make_model(llama: Any) -> nn.Module:
    """The small block (None), the demo GPT (``GPT``) or the Llama read from the folder ``llama``."""
    return build() if llama is None else build_gpt() if llama == GPT else load_llama(llama)


def parallelize_any(model: nn.Module, tp_mesh: Any) -> None:
    if isinstance(model, TinyBlock):
        parallelize(model, tp_mesh)
    elif hasattr(model, "blocks"):
        parallelize_gpt(model, tp_mesh)
    else:
        parallelize_llama(model, tp_mesh)


def eps_of(llama: Any) -> float:
    """AdamW's eps: ``LLAMA_EPS`` for the Llama and the GPT (the GPT's attention key bias has a gradient of rounding
    alone, softmax being blind to it: at 1e-8 it ends 5.9e-5 relative from one process)."""
    return 1e-8 if llama is None else LLAMA_EPS


def load_llama(folder: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def parallelize_llama(model: nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {pattern: styles[style]() for pattern, style in LLAMA_PLAN.items()})


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x) if isinstance(model, TinyBlock) or hasattr(model, "blocks") else model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def optimizer_of(params: Any, eps: float = 1e-8) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=eps, fused=False, foreach=False)


LLAMA_EPS = 1e-4
"""AdamW's eps for the Llama (and the GPT): its gradients hold elements near zero (embedding rows, attention), where
Adam's division by sqrt(v) turns the last bits of a sum into a whole step; with eps=1e-8 tensor parallel alone (no
ZeRO, plain torch) ends 4e-5 relative from one process after 4 steps, as lzero does. A larger eps keeps those elements' steps in
proportion to their gradients, so the comparison sees the algorithm rather than that amplification."""


class Module(LightningModule):
    def __init__(self, fsdp: bool = False, llama: Any = None) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.llama = llama
        self.model = make_model(llama)
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.per_parameter: list[dict[str, float]] = []  # lzero.grad_norm(self, 2) at each step
        self.memory: dict = {}  # the model states of rank 0 at the last step, gradients held (what the memory logs read)

    def configure_model(self) -> None:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            return  # parallelized by an earlier run of this module (configure_model runs at every fit/validate)
        tp_mesh = self.device_mesh["tensor_parallel"]
        parallelize_any(self.model, tp_mesh)
        if self.fsdp:  # Lightning's ModelParallelStrategy: FSDP2 over the data-parallel dimension
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        loss = loss_of(self.model, *batch)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())  # the global batch's
        return loss

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("val_loss", loss_of(self.model, *batch), sync_dist=True)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.fsdp:
            self.norms.append(self.trainer.strategy.grad_norm().item())
            norms = lzero.grad_norm(self, 2)  # keys named from the LightningModule: "grad_2.0_norm/model.embed.weight"
            self.per_parameter.append({k.replace("/model.", "/"): v.item() for k, v in norms.items()})
            if self.trainer.global_step == STEPS - 1:  # the optimizer state of earlier steps, this step's gradients
                from lzero.lightning.wiring import zero_optimizer
                from lzero.memory.accounting import model_state_bytes

                strategy = self.trainer.strategy
                self.memory = model_state_bytes(strategy.engine, [zero_optimizer(o, "") for o in strategy.optimizers])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_of(self.parameters(), eps_of(self.llama))


CONFIGURATIONS = {  # each ZeRO configuration under tensor parallel, by the name its results are written under
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "zero3_hybrid": {"stage": 3, "shard_group_size": 1},  # 2 replicas of 1 shard over the 2 data ranks
}
HYBRID = ("zero3_hybrid",)  # at dp2 only


def trainer(strategy: Any, devices: int, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   gradient_clip_val=CLIP, **kwargs)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def run(out: Path, name: str, strategy: Any, devices: int, fsdp: bool = False, llama: Any = None,
        module: Any = None) -> None:
    """Fit, then (the tensor-parallel runs) ``validate`` the fitted model: no engine then, so at stages 1-2 the strategy
    only lines up the data-parallel ranks' weights. ``module``: a LightningModule of this file's kind to use instead of
    ``Module(fsdp, llama)`` (tp_plan_runs.py)."""
    module = Module(fsdp, llama) if module is None else module
    fit = trainer(strategy, devices)
    fit.fit(module, DataLoader(dataset(), batch_size=MICRO))
    with fit.strategy.gathered_parameters(module.model) if not fsdp else nullcontext():  # zero3 keeps the model sharded
        params = full_parameters(module.model)
    generated = None
    if not fsdp and llama is not None and llama != GPT:  # greedy generation on the fitted, tensor-parallel Llama
        with fit.strategy.generation(module):
            generated = module.model.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()
    if not fsdp:
        validation = Subset(dataset(), range(VALIDATION))
        val = fit.validate(module, DataLoader(validation, batch_size=MICRO), verbose=False)[0]["val_loss"]
    if fit.is_global_zero:
        torch.save({"losses": module.losses, "norms": module.norms, "params": params, "per_parameter": module.per_parameter,
                    "memory": module.memory, "generated": generated,
                    "sampler": fit.strategy.distributed_sampler_kwargs, "val_loss": None if fsdp else val},
                   out / f"{name}.pt")


PROMPT = torch.tensor([[1, 5, 7, 2]])


def generate_plainly(llama: Path, params: dict[str, torch.Tensor]) -> list:
    """The same greedy generation by one process, a plain Llama holding ``params`` (a run's whole parameters)."""
    model = load_llama(llama)
    model.load_state_dict(params)
    return model.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()


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
    with_callback = Trainer(accelerator="cpu", devices=devices,
                            strategy=ZeroStrategy(stage=2, tensor_parallel_size=2, checkpoint_format="full"),
                            max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=out)
    refusal(out, f"refused_checkpointing_dp{dp}", lambda: with_callback.fit(Module(), DataLoader(dataset(),
                                                                                              batch_size=MICRO)))
    in_background = Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_progress_bar=False,
                            strategy=ZeroStrategy(stage=2, tensor_parallel_size=2, async_save=True),
                            enable_model_summary=False, default_root_dir=out)
    refusal(out, f"refused_async_dp{dp}", lambda: in_background.fit(Module(), DataLoader(dataset(), batch_size=MICRO)))
    mixed = Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_progress_bar=False,
                    strategy=ZeroStrategy(stage=2, tensor_parallel_size=2), enable_model_summary=False,
                    enable_checkpointing=False, use_distributed_sampler=False)
    own = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(dist.get_rank()))  # per rank
    refusal(out, f"refused_mixed_inputs_dp{dp}",
            lambda: mixed.fit(Module(), DataLoader(TensorDataset(own[:, :-1], own[:, 1:]), batch_size=MICRO)))


def reference(out: Path, dp: int, llama: Any = None) -> None:
    """One process, the global batch of each step: what each data rank's distributed sampler hands it (Lightning's, for
    a training DataLoader: shuffled with seed 0), MICRO samples per data rank and step."""
    from torch.utils.data import DistributedSampler

    model = make_model(llama)
    optimizer = optimizer_of(model.parameters(), eps_of(llama))
    x, y = dataset().tensors
    orders = [list(DistributedSampler(dataset(), num_replicas=dp, rank=d, shuffle=True, seed=0)) for d in range(dp)]
    losses, norms, per_parameter = [], [], []
    for step in range(STEPS):
        rows = [order[step * MICRO + i] for order in orders for i in range(MICRO)]
        loss = loss_of(model, x[rows], y[rows])  # the mean over dp equal micro-batches: each rank's mean, averaged
        losses.append(loss.item())
        loss.backward()
        per_parameter.append({k: v.item() for k, v in lightning_grad_norm(model, 2).items()})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # every validation sample once, in batches of equal size: the mean of the batches' means
        val_loss = loss_of(model, x[:VALIDATION], y[:VALIDATION]).item()
    name = "reference" if llama is None else "reference_gpt" if llama == GPT else "reference_llama"
    torch.save({"losses": losses, "norms": norms, "params": full_parameters(model), "per_parameter": per_parameter,
                "val_loss": val_loss}, out / f"{name}_dp{dp}.pt")


if __name__ == "__main__":
    out_dir, llama_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    world = int(__import__("os").environ["WORLD_SIZE"])
    dp = world // 2
    for name, options in CONFIGURATIONS.items():
        if name in HYBRID and dp == 1:
            continue
        run(out_dir, f"{name}_dp{dp}", ZeroStrategy(**options, tensor_parallel_size=2), world)
        run(out_dir, f"llama_{name}_dp{dp}", ZeroStrategy(**options, tensor_parallel_size=2), world, llama=llama_dir)
        run(out_dir, f"gpt_{name}_dp{dp}", ZeroStrategy(**options, tensor_parallel_size=2), world, llama=GPT)
    if dp == 2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        # not the Llama: its embeddings and norms stay out of the plan, so FSDP2 puts them on the data mesh alone and
        # the linears on data x tensor, and torch's clip_grad_norm_ then stops ("All operands in aten.stack.default
        # must have the same mesh"); lzero clips that model (compared with one process above)
        run(out_dir, f"model_parallel_dp{dp}", ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=2),
            world, fsdp=True)
    else:
        refusals(out_dir, world, dp)
    if dist.get_rank() == 0:
        reference(out_dir, dp)
        reference(out_dir, dp, llama_dir)
        reference(out_dir, dp, GPT)
    destroy_process_group()
