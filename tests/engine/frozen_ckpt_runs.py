"""Sharded checkpoints of a model with a frozen layer, resumed through changes of stage and world size,
against DDP resumed the same way (Lightning re-runs this script for the other ranks).

    python tests/engine/frozen_ckpt_runs.py LEG KINDS OUT_DIR      # KINDS: zero, ddp or zero,ddp
    python tests/engine/frozen_ckpt_runs.py old CHECKPOINT OUT_DIR

Leg k resumes leg k-1's ``last.ckpt`` and trains 10 more steps. The chain: zero1 at world size 2 (the
frozen layer kept whole in the checkpoint, as every checkpoint before frozen sharding kept it), zero3
at 1, zero3 at 2 (the frozen layer saved as sharded pieces), zero1 at 1; DDP the same. The samples are a
function of the global step (skip_runs.step_batch), so every world size sees the same global batches.
Rank 0 writes ``OUT_DIR/<strategy>_leg<k>.pt``. ``old``: zero3 at world size 2 resumes CHECKPOINT (written at
step 10 by an earlier lzero release) to step 20, and trains 20 steps uninterrupted for comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from skip_runs import Toy, data, step_batch  # noqa: E402

import lzero
from lzero import ZeroStrategy  # noqa: E402
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

CHAIN = [(2, 1), (1, 3), (2, 3), (1, 1)]  # (world size, ZeRO stage) of each leg


class FrozenToy(Toy):
    def __init__(self) -> None:
        super().__init__({})
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = step_batch(self.trainer.global_step, self.global_rank, self.trainer.world_size)
        return nn.functional.mse_loss(self.net(x + torch.tanh(self.frozen(x))), y)


def fit(name: str, strategy: Any, world_size: int, steps: int, out: Path, resume: str | None = None) -> None:
    torch.manual_seed(0)
    model = FrozenToy()
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=out / name, save_last=True, every_n_train_steps=10)])
    trainer.fit(model, data(), ckpt_path=resume)
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"{name}.pt")


def main(leg: int, kinds: str, out: Path) -> None:
    """``kinds``: "zero", "ddp" or both ("zero,ddp"), one after the other in this launch."""
    world_size, stage = CHAIN[leg]
    for kind in kinds.split(","):
        resume = str(out / f"{kind}_leg{leg - 1}" / "last.ckpt") if leg else None
        fit(f"{kind}_leg{leg}", "ddp" if kind == "ddp" else ZeroStrategy(stage=stage), world_size, 10 * (leg + 1),
            out, resume)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "old":
        out_dir = Path(sys.argv[3])
        fit("old_resumed", ZeroStrategy(stage=3), 2, 20, out_dir, resume=sys.argv[2])
        fit("uninterrupted", ZeroStrategy(stage=3), 2, 20, out_dir)
    else:
        main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
    destroy_process_group()
