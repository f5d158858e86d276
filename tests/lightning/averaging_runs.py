"""Weight averaging (EMA, SWA) under DDP and lzero at world size 2, every run in one launched script.

    python tests/lightning/averaging_runs.py OUT_DIR

Rank 0 writes ``OUT_DIR/<run>.pt`` (the final parameters and buffers, rank 0's validation losses, what the memory
monitor logged) and every run checkpoints after each epoch into ``OUT_DIR/<run>/epoch=<e>.ckpt`` (a file under DDP,
a sharded directory under lzero). tests/lightning/test_weight_averaging.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from torch.optim.swa_utils import get_ema_multi_avg_fn
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3_offload")
EPOCHS = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Net(LightningModule):
    """Three blocks (zero3's units) between an input layer with BatchNorm (buffers) and a head."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.inp = nn.Linear(6, 12)
        self.bn = nn.BatchNorm1d(12)
        self.blocks = nn.Sequential(Block(12), Block(12), Block(12))
        self.head = nn.Linear(12, 3)
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.bn(self.inp(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        # fused=False: the offloaded host step runs the kernel DDP runs on CPU (see [Note: the host step])
        return torch.optim.AdamW(self.parameters(), lr=0.05, fused=False)


class Captured(Logger):
    """Keeps what is logged (the memory monitor's lines), in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self) -> str:
        return "captured"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        for k, v in metrics.items():
            self.metrics.setdefault(k, []).append((step, float(v)))


class ShardBytes(Callback):
    """This rank's trainable shard elements (what the average holds), read at the start of training."""

    numel = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.numel = sum(u.spec.shard_numel for u in engine.units if not u.spec.frozen)


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)),
                      batch_size=4)


def averaging(kind: str) -> Callback:
    if kind == "ema":
        return EMAWeightAveraging(decay=0.8)
    if kind == "wa":  # torch's equal-weight average (foreach lerp over the parameters and buffers)
        return WeightAveraging()
    if kind == "wa_multi":  # a multi_avg_fn, the buffers copied rather than averaged
        return WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.7), use_buffers=False)
    return StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1)


def run(out: Path, name: str, kind: str, strategy: Any, ckpt_path: Optional[str] = None, optimizer: str = "adamw",
        memory: bool = False) -> None:
    torch.manual_seed(0)
    model = Net(optimizer)
    logger = Captured() if memory else False
    shards = ShardBytes()
    callbacks = [averaging(kind), shards, ModelCheckpoint(dirpath=out / name, filename="{epoch}", save_top_k=-1)]
    if memory:
        callbacks.append(lzero.MemoryMonitor(every_n_steps=2))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, logger=logger,
                      callbacks=callbacks, num_sanity_val_steps=0, enable_progress_bar=False,
                      enable_model_summary=False, precision="32-true", log_every_n_steps=2)
    trainer.fit(model, data(32, 0), data(16, 9), ckpt_path=ckpt_path)
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "buffers": {n: b.clone() for n, b in model.named_buffers()},
                    "val_losses": model.val_losses, "global_step": trainer.global_step,
                    "memory": logger.metrics if memory else {}, "shard_numel": shards.numel}, out / f"{name}.pt")


def main(out: Path) -> None:
    for kind in ("ema", "swa"):
        for strategy in STRATEGIES:
            run(out, f"{kind}_{strategy}", kind, strategy, memory=strategy.startswith("zero3"))
        # a full (DDP-format) checkpoint file instead of a sharded directory
        run(out, f"{kind}_zero3_full", kind, lzero.ZeroStrategy(stage=3, checkpoint_format="full"))
    for kind in ("wa", "wa_multi"):
        for strategy in ("ddp", "zero3"):
            run(out, f"{kind}_{strategy}", kind, strategy)
    run(out, "ema_sgd_ddp", "ema", "ddp", optimizer="sgd")
    run(out, "ema_sgd_zero2_offload", "ema", "zero2_offload", optimizer="sgd")
    # resumed after epoch 1 (of 0..2): from a sharded zero3 checkpoint at zero3 and, re-sharded by name, at zero1;
    # from DDP's file at zero3
    for kind in ("ema", "swa"):
        middle = "epoch=1.ckpt"
        run(out, f"{kind}_resume_zero3", kind, "zero3", ckpt_path=str(out / f"{kind}_zero3" / middle))
        run(out, f"{kind}_resume_zero3_at_zero1", kind, "zero1", ckpt_path=str(out / f"{kind}_zero3" / middle))
        run(out, f"{kind}_resume_ddp_at_zero3", kind, "zero3", ckpt_path=str(out / f"{kind}_ddp" / middle))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    main(out_dir)
    destroy_process_group()
