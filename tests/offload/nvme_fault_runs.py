"""Faults under ``zero3_offload_nvme`` at world size 2 (Lightning re-runs this script for rank 1).

    python tests/offload/nvme_fault_runs.py OUT_DIR SWAP_ROOT MODE [MODE ...]

One fit per MODE, in order, in this launch. The toy model of skip_runs.py (samples a function of the global
step), stage 3 with the optimizer and the parameter shards in swap files (``max_in_cpu: 0``) under
``SWAP_DIR = SWAP_ROOT/<kill|enospc|full>`` (a resume uses the folder of the run it resumes), ``ModelCheckpoint(every_n_train_steps=4,
save_last=True)`` into ``OUT_DIR/<run>/``. A fault strikes one rank (``FAULT_RANK``) in a swap-file write of the
step after the step-4 checkpoint was committed (global step 5):

MODE ``full``: no fault, STEPS steps.
MODE ``kill``: rank 1 SIGKILLs itself inside its ``KILL_AT``-th ``os.pwritev`` of that step, half the chunk written.
MODE ``enospc``: from then on, every ``os.pwritev`` of rank 0 fails with ``ENOSPC`` (its disk is full). Rank 0, not
a child rank: when a child rank exits with an error, Lightning's launcher SIGKILLs rank 0 at its next poll (every
5 s), which may cut rank 0's teardown, and the removal of its swap folder, short (the next start then removes it).
MODE ``resume_kill`` / ``resume_enospc``: resume ``OUT_DIR/kill`` (``enospc``) ``/last.ckpt`` to STEPS with the
same strategy and the same SWAP_DIR, after which the dead run's folder must be gone.

Every rank writes ``OUT_DIR/<run>/rank<r>.pid``; the faulting rank writes ``OUT_DIR/<run>/failed_at``
(``time.time()`` at the fault). Rank 0 of a run that finishes writes ``OUT_DIR/<run>.pt``: final parameters,
losses, its swap folder, and the entries of SWAP_DIR when training started (after the start's cleanup).
tests/offload/test_nvme_faults.py checks them.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from skip_runs import Toy, data  # noqa: E402

import lzero
from lzero import ZeroStrategy  # noqa: E402
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

STEPS = 8
EVERY = 4  # checkpoint interval: the fault comes after the step-4 checkpoint, before the step-8 one
FAULT_STEP = 5
KILL_AT = 3  # the pwritev call of the fault step inside which rank 1 dies
FAULT_RANK = {"kill": 1, "enospc": 0}


class Watch(Callback):
    """Arms the fault at ``FAULT_STEP``; records losses and, at the start of training, SWAP_DIR's entries."""

    def __init__(self, fault: Optional[str], run_dir: Path, swap: Path) -> None:
        self.fault, self.run_dir, self.swap = fault, run_dir, swap
        self.losses: list[float] = []
        self.swap_at_start: list[str] = []
        self.armed = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.swap_at_start = sorted(p.name for p in self.swap.iterdir())

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.fault and trainer.global_step == FAULT_STEP and trainer.global_rank == FAULT_RANK[self.fault] \
                and not self.armed:
            self.armed = True
            _inject(self.fault, self.run_dir)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())


def _inject(fault: str, run_dir: Path) -> None:
    """Replace ``os.pwritev`` (the swap files' writes, lzero/offload/nvme.py) in this process (the faulting rank's)."""
    real, calls = os.pwritev, [0]

    def pwritev(fd: int, buffers: list, offset: int) -> int:
        calls[0] += 1
        if fault == "enospc":
            if calls[0] == 1:
                (run_dir / "failed_at").write_text(repr(time.time()))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if calls[0] == KILL_AT:
            view = memoryview(buffers[0])
            real(fd, [view[: len(view) // 2 // 4096 * 4096 or len(view)]], offset)  # a torn swap file
            (run_dir / "failed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fd, buffers, offset)

    os.pwritev = pwritev


def strategy(swap: Path) -> ZeroStrategy:
    nvme = {"device": "nvme", "nvme_path": str(swap)}
    return ZeroStrategy(stage=3, offload_optimizer=nvme, offload_param={**nvme, "max_in_cpu": 0})


def fit(out: Path, name: str, swap: Path, fault: Optional[str] = None, resume: Optional[str] = None) -> None:
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"rank{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = Toy({})
    watch = Watch(fault, run_dir, swap)
    checkpoints = ModelCheckpoint(dirpath=run_dir / "ckpt", every_n_train_steps=EVERY, save_last=True)
    zero = strategy(swap)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=zero, max_steps=STEPS, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoints, watch])
    folders: list[str] = []
    zero_setup = zero.setup

    def setup(trainer: Trainer) -> None:  # the run's own swap folder, named once the engine made it
        zero_setup(trainer)
        folders.extend(str(s.files.run_folder) for s in zero.engine.stores if hasattr(s, "files"))

    zero.setup = setup
    trainer.fit(model, data(), ckpt_path=resume)
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "losses": watch.losses, "swap_at_start": watch.swap_at_start, "own_folders": folders},
                   out / f"{name}.pt")


if __name__ == "__main__":
    out_dir, swap_root = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    for mode in sys.argv[3:]:
        source = mode.removeprefix("resume_")
        swap_dir = swap_root / source
        swap_dir.mkdir(parents=True, exist_ok=True)
        if mode.startswith("resume_"):
            fit(out_dir, mode, swap_dir, resume=str(out_dir / source / "ckpt" / "last.ckpt"))
        else:
            fit(out_dir, mode, swap_dir, fault=None if mode == "full" else mode)
    destroy_process_group()
