"""Clearing gradients reaches the shards, and unused parameters are not stepped when asked: every run at
world size 2 against DDP, bitwise (tests/engine/grad_runs.py). See [Note: clearing gradients]."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script

STAGES = ["zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grad_runs")
    run_script("grad_runs.py", str(out), ranks=2)
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def assert_params_equal(ours: dict, ref: dict) -> None:
    assert ours["global_step"] == ref["global_step"]
    assert ours["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        assert torch.equal(ours["params"][k], v), f"{k}: max |diff| {(ours['params'][k] - v).abs().max():.3e}"


@pytest.mark.parametrize("how", ["module", "module_keep", "param_none", "submodule"])
@pytest.mark.parametrize("stage", STAGES)
def test_manual_clear_and_step_without_backward_equal_ddp(runs: Path, stage: str, how: str) -> None:
    """``self.zero_grad()`` / ``zero_grad(set_to_none=False)`` / ``p.grad = None`` / a submodule's
    ``zero_grad()`` after each AdamW step, and every third step taken with no backward: the cleared
    gradients are not applied again (with ``set_to_none=False``, a zero gradient is, as under DDP)."""
    ref = load(runs, f"ddp_manual_{how}")
    assert ref["global_step"] == 9
    assert_params_equal(load(runs, f"{stage}_manual_{how}"), ref)


@pytest.mark.parametrize("stage", STAGES)
def test_swa_with_batchnorm_equals_ddp(runs: Path, stage: str) -> None:
    """StochasticWeightAveraging's BatchNorm epoch steps with no backward after Lightning cleared the
    module's gradients (before validation): no stale gradient may be applied."""
    ref = load(runs, "ddp_swa")
    assert ref["global_step"] == 25  # 3 epochs of 8 steps and SWA's extra BatchNorm epoch
    assert_params_equal(load(runs, f"{stage}_swa"), ref)
    for k, v in ref["buffers"].items():
        assert torch.equal(load(runs, f"{stage}_swa")["buffers"][k], v), k


@pytest.mark.parametrize("stage", STAGES)
def test_find_unused_parameters_equals_ddp(runs: Path, stage: str) -> None:
    """A layer used every other batch, AdamW: with ``find_unused_parameters=True`` it is not stepped in the
    batches where no rank used it, exactly as under ``ddp_find_unused_parameters_true``."""
    ref = load(runs, "ddp_find_unused_parameters_true_unused")
    ours = load(runs, f"{stage}_unused")
    assert_params_equal(ours, ref)
    assert ours["losses"] == ref["losses"]
