"""Compiled blocks at world size 2 under DDP, zero2 and zero3 (Lightning re-runs this script for rank 1).

    python tests/engine/compile_runs.py OUT_DIR BACKEND

Blocks are built in ``__init__`` (the same initial weights under every strategy) and compiled in
``configure_model``: ``style="blocks"`` compiles the first block with ``torch.compile(block)`` and
the others with ``block.compile()``; ``style="container"`` compiles the ``nn.Sequential`` holding
them. Rank 0 writes ``OUT_DIR/<strategy>_<style>.pt``: the final parameters, the per-step losses,
the validation loss, what ``ModelSummary`` counted and dynamo's counters (graphs, graph breaks,
recompiles). tests/engine/test_compile.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

import lzero  # noqa: F401  (registers the strategy names)
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

STEPS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, 16)
        return h + torch.tanh(self.fc(self.norm(h)))


class CompiledNet(LightningModule):
    def __init__(self, backend: str, style: str) -> None:
        super().__init__()
        self.backend, self.style = backend, style
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def configure_model(self) -> None:
        if self.style == "container":
            self.blocks = torch.compile(self.blocks, backend=self.backend)
            return
        self.blocks[0] = torch.compile(self.blocks[0], backend=self.backend)
        for block in self.blocks[1:]:
            block.compile(backend=self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 1)
        return self.head(self.blocks(self.embed(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.summary_params = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary_params = ModelSummary(pl_module).total_parameters  # real sizes even when sharded

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def fit(out: Path, strategy: str, backend: str, style: str) -> None:
    torch._dynamo.reset()  # every run compiles its own graphs, so the counters compare
    counters.clear()
    recorder = Recorder()
    model = CompiledNet(backend, style)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, val_check_interval=STEPS,
                      num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[recorder])
    trainer.fit(model, data(8 * STEPS, seed=0), data(8, seed=1))
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "losses": recorder.losses, "val_loss": trainer.callback_metrics["val_loss"].item(),
                    "summary_params": recorder.summary_params, "global_step": trainer.global_step,
                    "dynamo": {k: dict(counters[k]) for k in ("stats", "graph_break", "recompiles")}},
                   out / f"{strategy}_{style}.pt")


if __name__ == "__main__":
    out_dir, backend = Path(sys.argv[1]), sys.argv[2]
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for strategy in ("ddp", "zero2", "zero3"):
        fit(out_dir, strategy, backend, "blocks")
    for strategy in ("ddp", "zero3"):
        fit(out_dir, strategy, backend, "container")
    destroy_process_group()
