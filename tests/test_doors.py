"""What both front doors share (lzero/lightning/wiring.py), run through each: the Trainer's ``ZeroStrategy`` and
Fabric's ``ZeroFabricStrategy`` at world size 1, in this process, on a tiny model.

- fp16 dynamic loss scaling resumed after an overflow: the loss scale, the skipped steps and the scaler's growth
  counters after the load are the ones saved, in both checkpoint formats.
- ``stage="auto"``: the same choice, the same record (kept in the checkpoint) and the same logged line.
- ``generation()`` misused: the same error at both doors.
- the rank's memory budget: one function behind the schedule's, ``stage="auto"``'s and generation's budgets.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lzero import LossScaleConfig
from lzero.engine.loss_scale import LossScaler

STEPS = 5
OVERFLOWS = (1, 2)  # the steps whose gradients are inf
SCALING = LossScaleConfig(initial_scale_power=8, loss_scale_window=3, hysteresis=2)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _loss(net: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    loss = nn.functional.mse_loss(net(x).float(), y)
    return loss * float("inf") if step in OVERFLOWS else loss


def _reference_state() -> dict[str, Any]:
    """The precision state after STEPS steps with two overflows, by the scaler's own rules, cross-checked by hand:
    2**8; the overflow at step 1 uses up one of the 2 of hysteresis, the one at step 2 halves the scale to 128; 2
    clean steps since (3, 4), one short of the window that doubles it; every field differs from a fresh scaler's."""
    scaler = LossScaler(SCALING)
    for step in range(STEPS):
        scaler.update(step in OVERFLOWS)
    state = {"skipped_steps": 2, "loss_scaler": scaler.state_dict()}
    assert state["loss_scaler"] == {"scale": 128.0, "iteration": 5, "last_overflow_iteration": 2,
                                    "hysteresis_left": 1, "overflows_at_min_scale": 0}
    return state


def _trainer_run(tmp_path: Path, checkpoint_format: str, resume: Path | None = None) -> tuple[Any, Path]:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lzero import ZeroStrategy

    class Toy(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.net, self.trainer.global_step)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    strategy = ZeroStrategy(stage=2, precision="16-mixed", loss_scaling=SCALING, checkpoint_format=checkpoint_format)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      limit_val_batches=0)
    trainer.fit(Toy(), DataLoader(TensorDataset(torch.zeros(STEPS, 1)), batch_size=1), ckpt_path=resume)
    return trainer, tmp_path / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"


def _fabric(checkpoint_format: str = "sharded", **options: Any) -> Any:
    from lightning.fabric import Fabric

    from lzero import ZeroFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(
        checkpoint_format=checkpoint_format, **options))
    fabric.launch()
    return fabric


def _fabric_run(path: Path, checkpoint_format: str, resume: bool) -> Any:
    fabric = _fabric(checkpoint_format, stage=2, precision="16-mixed", loss_scaling=SCALING)
    net = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))
    state = {"model": net, "optimizer": optimizer}
    if resume:
        fabric.load(path, state)
        return fabric
    for step in range(STEPS):
        fabric.backward(_loss(net, step))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, state)
    return fabric


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_trainer_resumes_fp16_loss_scaling_after_an_overflow(tmp_path: Path, in_process_fit,
                                                             checkpoint_format: str) -> None:
    reference = _reference_state()
    trainer, saved = _trainer_run(tmp_path / "first", checkpoint_format)
    assert trainer.precision_plugin.state_dict() == reference
    resumed, _ = _trainer_run(tmp_path / "second", checkpoint_format, resume=saved)
    assert resumed.global_step == STEPS
    assert resumed.precision_plugin.state_dict() == reference
    assert resumed.precision_plugin.loss_scale == 128.0


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_fabric_resumes_fp16_loss_scaling_after_an_overflow(tmp_path: Path, in_process_fit,
                                                            checkpoint_format: str) -> None:
    reference = _reference_state()
    first = _fabric_run(tmp_path / "ckpt", checkpoint_format, resume=False)
    assert first.strategy.precision.state_dict() == reference
    resumed = _fabric_run(tmp_path / "ckpt", checkpoint_format, resume=True)
    assert resumed.strategy.precision.state_dict() == reference
    assert resumed.strategy.precision.loss_scale == 128.0
