"""One Trainer fit that fails on one rank (Lightning re-runs this script for the other rank).

    python tests/lightning/failure_runs.py STRATEGY MODE FAILING_RANK OUT_DIR

MODE ``raise``: ``training_step`` raises ``RuntimeError`` on FAILING_RANK at step 3.
MODE ``noinit``: stage 3 builds, in ``configure_model``, blocks holding a module lzero cannot initialize.
MODE ``sigint``: FAILING_RANK sends itself SIGINT at step 3 (Ctrl+C on one rank).
MODE ``ctrl_c``: rank 0 sends SIGINT to the whole process group at step 3, as Ctrl+C in a terminal does (the test
starts this script in a session of its own).
STRATEGY: a registered name; the offload presets keep their host or NVMe state under ``OUT_DIR/swap``.
MODE ``ckpt``: as ``raise``, with ``OnExceptionCheckpoint`` (and ``exception_checkpoint_timeout_s=5``).
MODE ``ckpt_all``: as ``ckpt``, but every rank raises at step 3 (FAILING_RANK -1).
Every rank writes ``OUT_DIR/rank<r>.pid`` (its process id); the failing rank writes ``OUT_DIR/failed_at``
(``time.time()`` when it fails). tests/lightning/test_failure.py checks that every rank exits promptly with the
user's error last.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero


class NoReset(nn.Module):
    """A module with a parameter of its own that nothing writes (``torch.empty``, no ``reset_parameters()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(nn.Module):
    def __init__(self, initializable: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gain = nn.Identity() if initializable else NoReset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.gain(self.fc(x)))


class Net(LightningModule):
    def __init__(self, mode: str, failing_rank: int, out: Path) -> None:
        super().__init__()
        self.mode, self.failing_rank, self.out = mode, failing_rank, out
        if mode != "noinit":
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        if self.mode == "noinit":
            (self.out / "failed_at").write_text(repr(time.time()))  # the engine fails right after, at setup
        self.blocks = nn.Sequential(*[Block(self.mode != "noinit") for _ in range(4)])
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3 and self.failing_rank in (self.global_rank, -1):
            (self.out / "failed_at").write_text(repr(time.time()))
            if self.mode == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
            elif self.mode == "ctrl_c":
                os.killpg(os.getpgid(0), signal.SIGINT)
                time.sleep(5)  # the signal arrives while this rank would go on
            else:
                raise RuntimeError(f"user error on rank {self.global_rank} at step {batch_idx}")
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)).sum(-1, keepdim=True), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    strategy, mode = sys.argv[1], sys.argv[2]
    failing_rank, out = int(sys.argv[3]), Path(sys.argv[4])
    # Ctrl+C in a terminal: a suite started in the background (`make test &`, nohup) hands its processes SIGINT
    # ignored, which would make the signal modes test nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    (out / f"rank{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=4)
    callbacks = []
    if strategy.endswith("_nvme"):  # the swap folders where the test can see them
        swap = {"device": "nvme", "nvme_path": str(out / "swap")}
        strategy = lzero.ZeroStrategy(stage=3, offload_optimizer=swap, offload_param=swap)
    if mode.startswith("ckpt"):
        callbacks.append(OnExceptionCheckpoint(str(out)))
        if strategy.startswith("zero"):
            strategy = lzero.ZeroStrategy(stage=int(strategy[-1]), exception_checkpoint_timeout_s=5)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=8, logger=False, callbacks=callbacks,
                      enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(mode, failing_rank, out), data)
