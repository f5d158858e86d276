"""lzero.MemoryMonitor at world size 2: TensorBoard event files hold the memory tags, and each rank's measured
model states are within 3% of what the ZeRO formula expects (tests/memory/monitor_runs.py trains the runs); with a
frozen reference model (DPO), the logs equal the bytes each rank holds, counted without lzero's accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _launch import run_script

RUNS = [f"zero{stage}_{precision}" for stage in (1, 2, 3) for precision in ("32-true", "bf16-mixed")]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("monitor_runs")
    run_script("monitor_runs.py", str(out), ranks=2)
    return out


def scalars(logs: Path, name: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs / name / "version_0"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("name", RUNS)
def test_model_states_within_3_percent_of_the_formula_on_every_rank(logs: Path, name: str) -> None:
    found = scalars(logs, name)
    for rank in (0, 1):
        measured = found[f"memory/model_states_bytes/rank{rank}"]
        expected = found[f"memory/model_states_expected_bytes/rank{rank}"]
        assert [s for s, _ in measured] == [2, 4]  # every log_every_n_steps=2 steps of 4
        for (_, got), (_, want) in zip(measured, expected):
            print(f"{name} rank {rank}: measured {got:,.0f} bytes, formula {want:,.0f} ({got / want - 1:+.4%})")
            assert abs(got / want - 1) < 0.03
        # the split adds up to the total, and nothing is held as gradients between steps
        kinds = sum(found[f"memory/device/{k}_bytes/rank{rank}"][-1][1]
                    for k in ("parameters", "gradients", "masters", "optimizer_state"))
        assert kinds == measured[-1][1]
        assert found[f"memory/device/gradients_bytes/rank{rank}"][-1][1] == 0
        assert found[f"memory/peak_rss_bytes/rank{rank}"][-1][1] > measured[-1][1]
        assert found[f"comm/reduce_bytes_per_step/rank{rank}"][-1][1] > 0
        assert found[f"memory/monitor_seconds/rank{rank}"][-1][1] < 0.5


def test_the_split_is_the_stage_layout(logs: Path) -> None:
    """fp32: at stages 1-2 the full parameters stay (4Ψ) and the masters are their own slices (no master bytes);
    at stage 3 only the shard; all-gathers after the step at stages 1-2, and at stage 3 too once ``schedule="auto"``
    has made every block of this small model persistent (logged)."""
    z2, z3 = scalars(logs, "zero2_32-true"), scalars(logs, "zero3_32-true")
    assert z2["memory/device/masters_bytes/rank0"][-1][1] == 0
    assert z2["memory/device/parameters_bytes/rank0"][-1][1] == 2 * z3["memory/device/parameters_bytes/rank0"][-1][1]
    # AdamW's 8 bytes per owned element with N = 2 equal the 4 bytes per element of the full fp32 parameters
    # (plus a 4-byte `step` per unit)
    assert z2["memory/device/optimizer_state_bytes/rank0"][-1][1] == pytest.approx(
        z2["memory/device/parameters_bytes/rank0"][-1][1], rel=1e-4)
    # schedule="auto" keeps this small model's blocks persistent: one gather of the model per step, as at stage 2
    assert z3["memory/schedule/persistent_blocks/rank0"][-1][1] > 0
    assert z3["memory/schedule/gathers_per_step/rank0"][-1][1] == 1
    assert z3["comm/all_gather_bytes_per_step/rank0"][-1][1] == z2["comm/all_gather_bytes_per_step/rank0"][-1][1]
    assert z3["memory/schedule/predicted_peak_bytes/rank0"][-1][1] <= z3["memory/schedule/budget_bytes/rank0"][-1][1]
    # bf16-mixed at stage 2: 2-byte parameters (half the fp32 run's) and 4-byte masters of the owned half
    b2 = scalars(logs, "zero2_bf16-mixed")
    params = b2["memory/device/parameters_bytes/rank0"][-1][1]
    assert params == z2["memory/device/parameters_bytes/rank0"][-1][1] / 2
    assert b2["memory/device/masters_bytes/rank0"][-1][1] == pytest.approx(params, rel=1e-4)  # 4 x Ψ/2 = 2 x Ψ


DPO_RUNS = [f"zero{stage}-{precision}" for precision in ("32-true", "bf16-mixed") for stage in (1, 2, 3)]


@pytest.fixture(scope="module")
def dpo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from _pretrained_models import save_models

    out = tmp_path_factory.mktemp("dpo_memory_runs")
    model = save_models(out / "models", ["gpt2"])["gpt2"]
    run_script("dpo_memory_runs.py", str(model), str(out), ranks=2, timeout=300)
    return out


@pytest.mark.parametrize("run", DPO_RUNS)
def test_dpo_memory_logs_are_the_bytes_held_frozen_reference_included(dpo: Path, run: str) -> None:
    """A policy and a frozen reference, both from_pretrained in configure_model (tests/memory/dpo_memory_runs.py):
    the logged and the expected model states equal, within 0.01%, the storage bytes of every tensor the rank's model
    and optimizers hold (the module's parameters, zero3's shards, the masters and the optimizer state). At zero1/2
    the reference is whole on every rank (before: left out of both logs), at zero3 sharded."""
    for rank in (0, 1):
        found = json.loads((dpo / f"{run}-rank{rank}.json").read_text())
        assert len(found["held"]) == len(found["logged"]) == len(found["expected"]) == 2  # every step of 2
        for held, logged, expected in zip(found["held"], found["logged"], found["expected"]):
            actual = sum(held.values())
            print(f"{run} rank {rank}: held {actual:,} ({held}), logged {logged:,.0f} ({logged / actual - 1:+.4%}),"
                  f" expected {expected:,.0f} ({expected / actual - 1:+.4%})")
            assert abs(logged / actual - 1) < 1e-4
            assert abs(expected / actual - 1) < 1e-4
