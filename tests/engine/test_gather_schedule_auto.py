"""Stage 3's ``schedule="auto"`` ([Note: choosing the gather schedule] in lzero/engine/schedule.py): the plan over a
budget sweep, explicit knobs, and a run whose gathered parameters the gatherer counts against the prediction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _engine_cases import count_live_peak
from lzero import ZeroConfig
from lzero.engine.blocks import GatherSchedule
from lzero.engine.engine import ZeroEngine
from lzero.engine.schedule import (MemoryBudget, gathers_per_step, kept, measured_under, peak_elements,
                                   persistent_indices, plan)
from lzero.optimizer import ZeroOptimizer

SHAPES = {
    "six equal blocks": ([100] * 6, 30),
    "mixed sizes": ([50, 100, 100, 200, 100, 50, 20], 30),
    "an embedding unit first": ([400, 100, 100, 100, 100], 10),
}


def sweep(sizes: list[int], root: int, first: GatherSchedule = GatherSchedule(), fixed: tuple = ()) -> list[tuple]:
    """(headroom, chosen, extra elements) for every headroom from all blocks gathered down to none, largest first."""
    full = sum(sizes) + root
    out = []
    for headroom in range(full, -1, -5):
        chosen = plan(sizes, root, headroom, first, fixed, bucket=10**6)
        extra = peak_elements(sizes, root, chosen) - measured_under(sizes, root, first)
        out.append((headroom, chosen, extra))
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_smaller_budget_lowers_both_knobs_step_by_step_and_never_passes_it(shape: str) -> None:
    sizes, root = SHAPES[shape]
    results = sweep(sizes, root)
    for (_, before, _), (headroom, after, extra) in zip(results, results[1:]):
        assert extra <= headroom, (headroom, after)
        assert after.param_persistence_threshold <= before.param_persistence_threshold, (headroom, before, after)
        assert after.max_reuse_distance <= before.max_reuse_distance, (headroom, before, after)
        assert gathers_per_step(sizes, root, after, 10**6) >= gathers_per_step(sizes, root, before, 10**6)
    most, least = results[0][1], results[-1][1]
    assert persistent_indices(sizes, most) == set(range(len(sizes)))  # room for all: every block persistent,
    assert gathers_per_step(sizes, root, most, 10**6) == 1  # one coalesced all-gather after the step
    assert least == GatherSchedule()  # no room: FSDP's schedule, two gathers per block
    assert gathers_per_step(sizes, root, least, 10**6) == 2 * len(sizes)
    # on the way down, blocks kept across the turn (one gather instead of two) before none at all
    assert any(kept(sizes, root, s) and not persistent_indices(sizes, s) for _, s, _ in results), shape


def test_explicit_knobs_are_kept() -> None:
    sizes, root = SHAPES["six equal blocks"]
    for _, chosen, _ in sweep(sizes, root, GatherSchedule(max_reuse_distance=0), fixed=("max_reuse_distance",)):
        assert chosen.max_reuse_distance == 0
    for _, chosen, _ in sweep(sizes, root, GatherSchedule(param_persistence_threshold=0),
                              fixed=("param_persistence_threshold",)):
        assert chosen.param_persistence_threshold == 0
    big = plan([10**7] * 4, 0, 10**9, GatherSchedule(), (), bucket=5 * 10**6)  # larger than a coalesced bucket:
    assert big.param_persistence_threshold == 0 and len(kept([10**7] * 4, 0, big)) == 4  # kept, not persistent


def test_schedule_values_are_checked() -> None:
    from lzero.config import ZeroConfigError

    with pytest.raises(ZeroConfigError, match="`schedule='fast'`.*'auto'.*'min_memory'"):
        ZeroConfig(stage=3, schedule="fast")
    with pytest.raises(ZeroConfigError, match="`schedule_margin=1.5`"):
        ZeroConfig(stage=3, schedule_margin=1.5)
    with pytest.raises(ZeroConfigError, match="`schedule='min_memory'` at stage 2"):
        ZeroConfig(stage=2, schedule="min_memory")
    assert GatherSchedule.of(ZeroConfig(stage=3)) == GatherSchedule()  # the first step: memory-minimal


class Deep(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h.sum()


@pytest.mark.parametrize("room_for", [6, 3, 0])
def test_a_run_gathers_what_was_predicted_within_the_budget(room_for: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1, six blocks of 4160 elements; the measure is the gathered parameter bytes (deterministic: the
    gatherer counts them) above a fixed 1 MB, and the budget leaves room for ``room_for`` blocks more than the first
    two steps held. From the third step on the gatherer holds at most the predicted peak, within the budget, and the
    parameters equal those of ``schedule="min_memory"`` bitwise."""
    from lzero.engine import schedule as schedule_module

    block, base = 64 * 64 + 64, 10**6
    results = {}
    for name in ("auto", "min_memory"):
        torch.manual_seed(0)
        model = Deep()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        first_peak = 4 * (8 * 64 + 64 + 2 * block)  # the root and two blocks: the computing one and one prefetched
        budget = int((base + first_peak + 4 * room_for * block + 4) / 0.9)
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, schedule=name, unit_modules=("Sequential",)),
                            memory_budget=MemoryBudget(budget))
        zopt = ZeroOptimizer(opt, engine, 0)
        gatherer = engine.gatherer
        live = count_live_peak(gatherer)
        monkeypatch.setattr(schedule_module, "peak_bytes", lambda device: base + 4 * live[0])
        monkeypatch.setattr(schedule_module, "reset_peak", lambda device: live.__setitem__(0, 0))
        peaks = []
        for step in range(4):
            engine.gather_root()
            live[0] = max(live[0], gatherer.live_numel())
            model(torch.randn(4, 8)).backward()
            zopt.step()
            zopt.zero_grad()
            peaks.append(base + 4 * live[0])
            live[0] = gatherer.live_numel()  # blocks kept between steps count in the next step's peak
        record = engine.auto_schedule.record if engine.auto_schedule is not None else None
        engine.unshard()
        results[name] = {"params": [p.detach().clone() for p in model.parameters()], "record": record, "peaks": peaks}
        engine.remove()
    record, peaks = results["auto"]["record"], results["auto"]["peaks"]
    assert record["measured_peak_bytes"] == base + first_peak
    assert max(peaks[2:]) <= record["predicted_peak_bytes"] <= 0.9 * budget, (peaks, record)  # chosen after step 2
    # every block persistent holds 4 blocks more than the first step (root + 6 against root + 2); 3 blocks kept
    # across the turn hold 3 more (root + 3 kept + the computing one + one prefetched)
    expected = {6: (6, 0, 1), 3: (0, 3, 9), 0: (0, 0, 12)}[room_for]
    assert (record["persistent_blocks"], record["kept_blocks"], record["gathers_per_step"]) == expected, record
    assert results["min_memory"]["record"] is None and max(results["min_memory"]["peaks"]) == base + first_peak
    assert all(torch.equal(a, b) for a, b in zip(results["auto"]["params"], results["min_memory"]["params"]))


def test_estimate_prints_what_auto_would_keep_for_the_memory_given(capsys: pytest.CaptureFixture) -> None:
    """`lzero estimate --model ... --free-memory`: the demo GPT (4 blocks of 198,272 elements and an 8,192-element
    embedding unit; 16.65 MB of fp32 states and working set at world size 1; all gathered: 1.62 MB more) keeps every
    block persistent with 21 MB free, the small unit persistent and the last block kept with 20 MB (1.35 MB of room
    after the 10% margin), and nothing with 18.5 MB (none)."""
    from lzero.cli import main

    base = ["estimate", "--model", "lzero.demo:DemoGPT", "--precision", "32-true", "--free-memory"]
    assert main([*base, "21e6"]) == 0
    out = capsys.readouterr().out
    assert "5 of 5 blocks persistent" in out and "1 all-gathers per step instead of 10" in out, out
    assert main([*base, "20e6"]) == 0
    out = capsys.readouterr().out
    assert "1 of 5 blocks persistent (param_persistence_threshold=8192), 1 kept" in out, out
    assert main([*base, "18.5e6"]) == 0
    out = capsys.readouterr().out
    assert "0 of 5 blocks persistent" in out and "0 kept" in out and "10 all-gathers per step instead of 10" in out
    assert main(["estimate", "--params", "1e6", "--free-memory", "1e9"]) == 2  # no blocks to plan over: said so
    assert "pass `--model package.module:Class` with `--free-memory`" in capsys.readouterr().err


def test_the_out_of_memory_triage_names_the_schedule_and_the_knob_to_lower() -> None:
    from lzero.memory.triage import schedule_line

    record = {"persistent_blocks": 0, "kept_blocks": 3, "blocks": 6, "param_persistence_threshold": 0,
              "max_reuse_distance": 800, "measured_peak_bytes": 10 * 2**20, "predicted_peak_bytes": 12 * 2**20}
    line = schedule_line(record)
    assert "3 kept across the turn (max_reuse_distance=800)" in line
    assert "HINT: a lower `max_reuse_distance`, or `schedule='min_memory'`" in line and "holds 2.0 MiB" in line
