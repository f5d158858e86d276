"""Clearing gradients and unused parameters, DDP against lzero at world size 2 (one launched script).

    python tests/engine/grad_runs.py OUT_DIR

Rank 0 writes ``OUT_DIR/<run>.pt`` (see trainer_runs.fit); tests/engine/test_grad_clearing.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn

import lzero
from trainer_runs import TiedNet, data, fit, unseeded_init
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

DDP = "ddp_find_unused_parameters_true"
STAGES = ("zero1", "zero2", "zero3")


class ManualClear(LightningModule):
    """Manual optimization that clears gradients in one of several ways (``how``) and, every third
    batch, steps without a backward, which must not move a parameter whose gradient was set to None."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.how = how
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        if batch_idx % 3 != 2:
            loss = nn.functional.cross_entropy(self.body(x.float()), y)
            self.manual_backward(loss)
        opt.step()
        if self.how == "module":
            self.zero_grad()
        elif self.how == "module_keep":
            self.zero_grad(set_to_none=False)
        elif self.how == "param_none":
            for p in self.parameters():
                p.grad = None
        elif self.how == "submodule":
            self.body.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: Path) -> None:
    for how in ("module", "module_keep", "param_none", "submodule"):
        for strategy in ("ddp", *STAGES):
            unseeded_init()
            fit(out, f"{strategy}_manual_{how}", strategy, ManualClear(how), 2, data(), steps=9)
    for strategy in ("ddp", *STAGES):  # SWA's BatchNorm epoch steps with no backward
        unseeded_init()
        fit(out, f"{strategy}_swa", strategy, TiedNet(), 2, data(), data(16, seed=9), steps=-1, max_epochs=3,
            callbacks_extra=[StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=1)])
    unseeded_init()
    fit(out, f"{DDP}_unused", DDP, TiedNet(use_spare_every=2), 2, data())
    for stage in STAGES:
        unseeded_init()
        fit(out, f"{stage}_unused", lzero.ZeroStrategy(stage=int(stage[-1]), find_unused_parameters=True),
            TiedNet(use_spare_every=2), 2, data())


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    main(out_dir)
    destroy_process_group()
