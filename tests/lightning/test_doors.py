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


# --- stage="auto" and the "auto" sizes ---------------------------------------------------------------------------

GPT_SIZES = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
AUTO_BUDGET = 10**9  # bytes: far more than 16 bytes x ~35k parameters, so zero1 (the least communication) fits


def _auto_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records]
    return [line for line in lines if line.startswith(("lzero zero_auto:", "lzero: \"auto\""))]


def test_stage_auto_chooses_records_and_logs_alike_at_both_doors(tmp_path: Path, in_process_fit,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The same model at both doors with ``stage="auto"``, a fixed budget and ``reduce_bucket_size="auto"``: the
    record of the choice is ``auto.choose``'s for the model's count, kept in the sharded checkpoint's manifest, and
    the two lines logged (the choice, the sizes from the hidden size 32) are the same at both doors."""
    from lightning.pytorch import Trainer

    from lzero import ZeroConfig, ZeroStrategy
    from lzero.checkpoint.reader import ShardedCheckpoint
    from lzero.demo import DemoGPT, TextDataModule
    from lzero.demo.model import GPT, GPTConfig
    from lzero.memory import auto
    from lzero.memory.estimate import count_parameters

    options = {"stage": "auto", "memory_budget_bytes": AUTO_BUDGET, "reduce_bucket_size": "auto"}
    _, reference = auto.choose(ZeroConfig(), count_parameters(GPT(GPTConfig(**GPT_SIZES))), 1, 1, "32-true",
                               torch.device("cpu"), AUTO_BUDGET)
    assert reference["chosen"] == "zero1" and reference["host_budget_bytes"] == AUTO_BUDGET
    expected_lines = ["lzero: \"auto\" sizes from the model's hidden size: reduce_bucket_size=1024",
                      auto.summary(reference)]

    with caplog.at_level(logging.INFO):
        torch.manual_seed(0)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(**options), max_steps=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "trainer",
                          limit_val_batches=0)
        trainer.fit(DemoGPT(**GPT_SIZES), datamodule=TextDataModule(block_size=16, batch_size=2, steps_per_epoch=1))
    trainer_lines, caplog.records[:] = _auto_lines(caplog), []
    trainer_saved = ShardedCheckpoint(tmp_path / "trainer" / "checkpoints" / "epoch=0-step=1.ckpt").manifest["auto"]

    with caplog.at_level(logging.INFO):
        fabric = _fabric(**options)
        model = fabric.setup_module(GPT(GPTConfig(**GPT_SIZES)))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
        fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer})
    fabric_lines = _auto_lines(caplog)
    fabric_saved = ShardedCheckpoint(tmp_path / "fabric.ckpt").manifest["auto"]

    assert trainer.strategy._auto_record == fabric.strategy._auto_record == reference
    assert trainer_saved == fabric_saved == reference
    assert trainer.strategy.config.stage == fabric.strategy.config.stage == 1
    assert trainer.strategy.config.reduce_bucket_size == fabric.strategy.config.reduce_bucket_size == 32 * 32
    assert trainer_lines == fabric_lines == expected_lines


# --- generation() misused ----------------------------------------------------------------------------------------


def test_generation_refuses_the_same_misuse_alike_at_both_doors() -> None:
    """Before anything runs (no model set up, no engine): a mode given where the module goes, and an unknown mode,
    refused by the same check with the same words; each door names what it takes and its own call."""
    from lzero import ZeroFabricStrategy, ZeroStrategy

    doors = {"trainer": ZeroStrategy(stage=3, parallel_devices=[torch.device("cpu")]),
             "fabric": ZeroFabricStrategy(stage=3)}
    takes = {"trainer": ("the LightningModule or a module inside it", "with trainer.strategy.generation(self.policy):"),
             "fabric": ("a model set up by `fabric.setup`", "with fabric.strategy.generation(model, mode='streamed'):")}
    for door, strategy in doors.items():
        with pytest.raises(ValueError) as positional:
            with strategy.generation("streamed"):
                pass
        what, call = takes[door]
        assert str(positional.value) == (f"`strategy.generation(module=...)` takes {what}, got 'streamed'. HINT:"
                                         f" `{call}`; the mode is a keyword argument: `generation(mode='streamed')`.")
        with pytest.raises(ValueError) as unknown:
            with strategy.generation(mode="all"):
                pass
        assert str(unknown.value) == ("`generation(mode='all')`: the modes are 'gathered' (every block on the device)"
                                      " and 'streamed' (blocks copied from host memory per forward).")


# --- the rank's memory budget ------------------------------------------------------------------------------------


def test_one_budget_function_behind_the_schedule_stage_auto_and_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, with the host's available memory read as 8 GiB and this process's resident memory as 1 GiB: the
    budget of a rank of 2 on the host is 4 GiB for stage="auto" and generation, 5 GiB (plus what the process holds)
    for the schedule, whose peak is measured over the whole process; a given budget wins everywhere."""
    from lzero import ZeroConfig
    from lzero.engine import rank_memory
    from lzero.engine.rank_memory import MemoryBudget, rank_budget_bytes
    from lzero.memory import auto
    from lzero.memory.estimate import ModelCount

    gib, cpu = 2**30, torch.device("cpu")
    monkeypatch.setattr(rank_memory, "host_available_bytes", lambda: 8 * gib)
    monkeypatch.setattr(rank_memory, "proc_bytes", lambda path, key: gib if key == "VmRSS:" else None)
    assert rank_budget_bytes(cpu, None, 2) == rank_budget_bytes(cpu, None, 2, total=True) == 4 * gib
    assert MemoryBudget(None, 2).read(cpu) == rank_budget_bytes(cpu, None, 2, held=True) == 5 * gib
    assert MemoryBudget(123, 2).read(cpu) == rank_budget_bytes(cpu, 123, 2, held=True) == 123
    _, record = auto.choose(ZeroConfig(), ModelCount(trainable=10**6), 2, 2, "32-true", cpu)
    assert record["host_budget_bytes"] == 4 * gib and record["device_budget_bytes"] is None


def test_generation_prices_against_the_same_budget_at_both_doors(tmp_path: Path, in_process_fit,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3, the same model at both doors, the host's available memory read as 100 kB (less than the
    model's fp32 copy, about 137 kB): ``generation(mode=
    'streamed')`` refuses alike, pricing the whole model's fp32 copy (its units' padded sizes) against the budget
    of rank_budget_bytes."""
    from lightning.pytorch import Trainer

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule
    from lzero.demo.model import GPT, GPTConfig
    from lzero.engine import rank_memory

    options = {"stage": 3, "schedule": "min_memory"}
    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(**options), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0)
    trainer.fit(DemoGPT(**GPT_SIZES), datamodule=TextDataModule(block_size=16, batch_size=2, steps_per_epoch=1))
    fabric = _fabric(**options)
    model = fabric.setup_module(GPT(GPTConfig(**GPT_SIZES)))
    fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))  # an engine with an optimizer, as the Trainer's
    fabric.strategy._start(fabric.strategy._model_of(model))
    engines = [trainer.strategy.engine or trainer.strategy._live_engine, fabric.strategy._models[0].engine]
    need = [sum(u.spec.padded_numel * u.flat_param.element_size() for u in e.units) for e in engines]
    assert need[0] == need[1] > 0.8 * 10**5

    monkeypatch.setattr(rank_memory, "host_available_bytes", lambda: 10**5)
    errors = []
    for strategy in (trainer.strategy, fabric.strategy):
        with pytest.raises(RuntimeError) as refused:
            with strategy.generation(mode="streamed"):
                pass
        errors.append(str(refused.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"`strategy.generation(mode='streamed')` holds the whole model on every rank:"
                                f" {need[0] / 2**30:.2f} GiB more in host memory, where {10**5 / 2**30:.2f} GiB are"
                                " free (x 0.8 margin). HINT:")


# --- the optimizer behind the doors' wrappers ---------------------------------------------------------------------


def test_an_optimizer_not_set_up_by_lzero_is_named_alike_at_both_doors() -> None:
    """A plain torch optimizer where the ZeRO one belongs (clipping at the Trainer's door, the optimizer state at
    Fabric's): the same error naming it, each with its door's HINT; a wrapped ZeRO optimizer is unwrapped."""
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lzero import ZeroFabricStrategy, ZeroOptimizer, ZeroOptimizerError, ZeroPrecision
    from lzero.lightning.wiring import zero_optimizer

    plain = torch.optim.SGD(_net().parameters(), lr=0.1)
    with pytest.raises(ZeroOptimizerError) as trainer_door:
        ZeroPrecision().clip_grad_by_norm(plain, 1.0)
    with pytest.raises(ZeroOptimizerError) as fabric_door:
        ZeroFabricStrategy().get_optimizer_state(plain)
    assert str(trainer_door.value) == ("`SGD` is not an optimizer set up by lzero's strategy. HINT: pass the optimizer"
                                       " of `self.optimizers()` (or `trainer.strategy.optimizers`).")
    assert str(fabric_door.value) == ("`SGD` is not an optimizer set up by lzero's strategy. HINT: pass the optimizer"
                                      " returned by `fabric.setup_optimizers` (or `fabric.setup`).")
    zopt = ZeroOptimizer(plain, None, start=lambda: None)
    fabric = ZeroFabricStrategy()
    for wrapped in (zopt, LightningOptimizer(zopt), _FabricOptimizer(zopt, fabric)):
        assert zero_optimizer(wrapped, "") is zopt
