"""fp16 loss scaling and skipped steps at world size 2 (Lightning re-runs this script for rank 1).

    python tests/lightning/skip_runs.py OUT_DIR

A tiny regression model (fp16 matmul is slow on CPU). Rank 1 injects an inf or NaN into one
parameter's gradient at chosen global steps. Every rank writes ``OUT_DIR/<run>_rank<r>.pt`` with,
per step: the loss, the loss scale after the step, whether it was skipped, the learning rate, and
whether the fp32 masters and the optimizer state changed across the step. tests/lightning/test_skip.py
checks them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero
from lzero import LossScaleConfig, ZeroPrecision, ZeroStrategy
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

INJECT = {3: "inf", 4: "nan", 9: "inf"}  # global step -> what rank 1 puts into net.0.weight's gradient
SCALING = LossScaleConfig(initial_scale_power=8, loss_scale_window=5, hysteresis=2)


class Toy(LightningModule):
    def __init__(self, inject: Optional[dict[int, str]] = None, fused: Optional[bool] = None,
                 inject_rank: int = 1) -> None:
        super().__init__()
        self.fused = fused
        self.inject_rank = inject_rank
        self.inject = dict(INJECT if inject is None else inject)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self._hook: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = step_batch(self.trainer.global_step, self.global_rank, self.trainer.world_size)
        kind = self.inject.get(self.trainer.global_step)
        if kind is not None and self.global_rank == self.inject_rank:
            value = float(kind)
            self._hook = self.net[0].weight.register_hook(lambda g: torch.full_like(g, value))
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01,
                                **({"fused": self.fused} if getattr(self, "fused", None) is not None else {}))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.97**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    """This rank's fp32 master shards and every tensor of the shard optimizers' state."""
    zopt = trainer.strategy.optimizers[0]
    out = []
    for unit in zopt.units:
        with unit.resident():  # NVMe offload: read from the swap files
            out.append(unit.master_shard.detach().clone())
            for state in zopt.shard_optimizer(unit).state.values():
                out.extend(v.clone() for v in state.values() if isinstance(v, torch.Tensor))
    return out


class Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._before: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._before = snapshot(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        after = snapshot(trainer)
        plugin = trainer.precision_plugin
        self.rows.append({
            "loss": outputs["loss"].item(),
            "scale": plugin.loss_scale,
            "skipped": plugin.skipped_last_step(trainer.strategy.optimizers[0]),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "logged_scale": trainer.callback_metrics.get("lzero/loss_scale", torch.tensor(-1.0)).item(),
            "logged_skips": trainer.callback_metrics.get("lzero/skipped_steps", torch.tensor(-1.0)).item(),
            "unchanged": all(torch.equal(a, b) for a, b in zip(self._before, after, strict=True)),
            "master_dtype": str(trainer.strategy.optimizers[0].units[0].master_shard.dtype),
            "param_dtype": str(pl_module.net[0].weight.dtype),
        })


TEACHER = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))


GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3 and 4


def step_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: a function of the global step, not of the
    loader's position, so a resumed run, at any world size, sees the samples the uninterrupted one saw
    (Lightning restarts a plain loader's epoch on a mid-epoch resume)."""
    x = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(1000 + step))
    micro = GLOBAL_BATCH // world_size
    x = x[rank * micro : (rank + 1) * micro]
    return x, torch.tanh(x @ TEACHER)


def data(n: int = 320) -> DataLoader:
    """Only paces the loop: 20 batches per rank and epoch."""
    return DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=8)


def fit(out: Path, name: str, stage: int, precision: ZeroPrecision, steps: int,
        inject: Optional[dict[int, str]] = None, ckpt_path: Optional[str] = None, save: bool = False,
        fused: Optional[bool] = None, **options: Any) -> None:
    torch.manual_seed(0)
    model = Toy(inject, fused)
    record = Record()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage, **options), plugins=[precision],
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record])
    error = ""
    try:
        trainer.fit(model, data(), ckpt_path=ckpt_path)
    except (lzero.LossScaleError, FloatingPointError) as err:
        error = f"{type(err).__name__}: {err}"
    if save:
        trainer.save_checkpoint(out / f"{name}.ckpt")
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    torch.save({"rows": record.rows, "error": error, "global_step": trainer.global_step,
                "skipped_steps": trainer.precision_plugin.skipped_steps,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               out / f"{name}_rank{trainer.global_rank}.pt")


def main(out: Path) -> None:
    for stage in (1, 2, 3):
        fit(out, f"fp16_zero{stage}", stage, ZeroPrecision("16-mixed", loss_scaling=SCALING), steps=40)
    # offloaded (host step with the same for-loop kernel as above: fused=False), the same overflows
    fit(out, "fp16_zero2_offload", 2, ZeroPrecision("16-mixed", loss_scaling=SCALING), steps=40, fused=False,
        offload_optimizer="cpu")
    fit(out, "fp16_zero3_offload", 3, ZeroPrecision("16-mixed", loss_scaling=SCALING), steps=40, fused=False,
        offload_optimizer="cpu", offload_param="cpu")
    fit(out, "fp32_zero2", 2, ZeroPrecision("32-true"), steps=40)
    fit(out, "bf16_zero3", 3, ZeroPrecision("bf16-mixed"), steps=12)
    # the loss-scaler state across a save at an epoch boundary (20 batches per epoch) and a resume
    resume_inject = {**INJECT, 22: "inf"}
    fit(out, "fp16_full", 2, ZeroPrecision("16-mixed", loss_scaling=SCALING), steps=30, inject=resume_inject)
    fit(out, "fp16_first", 2, ZeroPrecision("16-mixed", loss_scaling=SCALING), steps=20, inject=resume_inject,
        save=True)
    fit(out, "fp16_resumed", 2, ZeroPrecision("16-mixed", loss_scaling=SCALING), steps=30, inject=resume_inject,
        ckpt_path=str(out / "fp16_first.ckpt"))
    # errors: stuck at the minimum scale (every step overflows from step 2), and nonfinite_grads="raise"
    stuck = LossScaleConfig(initial_scale_power=8, hysteresis=1, min_loss_scale=64, max_overflows_at_min_scale=3)
    fit(out, "fp16_stuck", 1, ZeroPrecision("16-mixed", loss_scaling=stuck), steps=20,
        inject={s: "inf" for s in range(2, 20)})
    fit(out, "fp32_raise", 2, ZeroPrecision("32-true", nonfinite_grads="raise"), steps=10)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    main(out_dir)
    destroy_process_group()
