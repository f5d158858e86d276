"""Per-parameter gradient norms in ``on_before_optimizer_step``: Lightning's ``grad_norm`` under DDP against
``lzero.grad_norm`` at zero1-3, world size 2 (one launched script).

    python tests/lightning/grad_norm_runs.py OUT_DIR

Rank 0 writes ``OUT_DIR/<run>.pt``: per step, the dictionaries for the 2-norm and the inf-norm, the all-reduces each
call made, and the warnings the fit raised. tests/lightning/test_grad_norm.py compares them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

import lzero
from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from trainer_runs import TiedNet, data, unseeded_init


class Logged(TiedNet):
    """TiedNet recording gradient norms the way a user logs them: Lightning's function or lzero's."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which
        self.records: list[dict[str, Any]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        calls = [0]
        all_reduce = dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return all_reduce(*args, **kwargs)

        dist.all_reduce = counted
        try:
            norm = lzero.grad_norm if self.which == "lzero" else lightning_grad_norm
            two, inf = norm(self, 2), norm(self, "inf")
        finally:
            dist.all_reduce = all_reduce
        self.records.append({"2": {k: v.item() for k, v in two.items()}, "inf": {k: v.item() for k, v in inf.items()},
                             "all_reduces": calls[0]})


def run(out: Path, name: str, strategy: str, which: str, acc: int = 1) -> None:
    unseeded_init()
    model = Logged(which)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accumulate_grad_batches=acc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data())
    if trainer.is_global_zero:
        torch.save({"records": model.records, "warnings": [str(w.message) for w in caught]}, out / f"{name}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    ddp = "ddp_find_unused_parameters_true"
    run(out_dir, "ddp", ddp, "lightning")
    run(out_dir, "ddp_acc2", ddp, "lightning", acc=2)
    for stage in ("zero1", "zero2", "zero3"):
        run(out_dir, stage, stage, "lzero")
    run(out_dir, "zero2_acc2", "zero2", "lzero", acc=2)
    run(out_dir, "zero3_lightning", "zero3", "lightning")  # the silent {} of Lightning's function, now warned
    run(out_dir, "ddp_lzero", ddp, "lzero")  # lzero's function under another strategy: Lightning's
    destroy_process_group()
