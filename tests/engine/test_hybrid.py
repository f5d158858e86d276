"""Hybrid sharding under the Trainer at world size 4 as 2 shard groups x 2 ranks (tests/engine/hybrid_precision_runs.py):
fp16 with an overflow injected on a rank of the second group, and bf16-mixed, against the flat layout; zero2 and
zero3_offload against DDP at world size 4. The Fabric cases (zero1, zero3, hpZ, checkpoints across layouts) are in
test_fabric.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid_precision")
    run_script("hybrid_precision_runs.py", str(out), ranks=4)
    return out


def load(runs: Path, name: str, rank: int = 0) -> dict:
    return torch.load(runs / f"{name}_rank{rank}.pt", weights_only=True)


def test_fp16_overflow_in_one_group_skips_every_rank_as_flat(runs: Path) -> None:
    """Rank 3 (group 1) injects inf, NaN, inf at steps 3, 4, 9: every rank of both groups skips those steps and keeps
    the flat layout's loss scales; the losses and final weights are the flat run's within 1e-6 (measured: equal)."""
    for rank in range(4):
        flat, hybrid = load(runs, "fp16_flat", rank), load(runs, "fp16_hybrid", rank)
        assert [i for i, r in enumerate(hybrid["rows"]) if r["skipped"]] == [3, 4, 9]
        assert [i for i, r in enumerate(hybrid["rows"]) if r["unchanged"]] == [3, 4, 9]
        assert [r["scale"] for r in hybrid["rows"]] == [r["scale"] for r in flat["rows"]] == \
            [256.0] * 4 + [128.0] * 5 + [64.0] * 3
        assert hybrid["skipped_steps"] == 3
        worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(hybrid["rows"], flat["rows"], strict=True))
        assert worst < 1e-6, worst
        for name, value in flat["params"].items():
            assert torch.allclose(hybrid["params"][name], value, rtol=1e-6, atol=1e-7), name


def test_bf16_mixed_hybrid_as_flat(runs: Path) -> None:
    flat, hybrid = load(runs, "bf16_flat"), load(runs, "bf16_hybrid")
    assert len(hybrid["losses"]) == 8
    worst = max(abs(a - b) / b for a, b in zip(hybrid["losses"], flat["losses"], strict=True))
    print(f"bf16-mixed hybrid vs flat zero3 at 4 ranks: worst relative loss difference {worst:.2e}")
    assert worst < 1e-6
    for name, value in flat["params"].items():
        assert torch.allclose(hybrid["params"][name], value, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize(("name", "reference"), [("zero2_hybrid", "ddp"), ("zero3_offload_hybrid", "ddp"),
                                                 ("zero3_hybrid_per_layer", "ddp"), ("zero3_groups_of_one", "ddp"),
                                                 ("zero3_hybrid_frozen", "ddp_frozen")])
def test_hybrid_matches_ddp_at_world_size_4(runs: Path, name: str, reference: str) -> None:
    """fp32, 8 steps: losses and final weights within 1e-6 of DDP's (the two reductions sum in another order); a
    frozen layer keeps its initial weights exactly."""
    ours, ddp = load(runs, name), load(runs, reference)
    if "frozen" in name:
        assert torch.equal(ours["params"]["net.0.weight"], ddp["params"]["net.0.weight"])
    assert len(ours["losses"]) == len(ddp["losses"]) == 8
    worst = max(abs(a - b) / b for a, b in zip(ours["losses"], ddp["losses"], strict=True))
    weights = max(((ours["params"][k] - v).abs().max() / v.abs().max()).item() for k, v in ddp["params"].items())
    validated = abs(ours["val_loss"] / ddp["val_loss"] - 1)
    print(f"{name}: losses within {worst:.2e} of DDP@4, weights within {weights:.2e}, trainer.validate {validated:.1e}")
    assert worst < 1e-6 and weights < 1e-6 and validated < 1e-6


def test_quantized_collectives_within_and_across_groups_track_ddp(runs: Path) -> None:
    """qwZ and int8 qgZ under hybrid sharding: the within-group all-gathers and reduce-scatters and the all-reduce
    across the groups all carry int8 codes. Over 8 steps of the toy the mean loss stays within 1% of DDP's, each step
    within 5% (the rounded weights of a small loss; the 200-step figures: benchmarks/results/collectives/)."""
    ours, ddp = load(runs, "zero3_hybrid_quantized"), load(runs, "ddp")
    worst = max(abs(a - b) / b for a, b in zip(ours["losses"], ddp["losses"], strict=True))
    mean = sum(ours["losses"]) / sum(ddp["losses"]) - 1
    print(f"hybrid zero3 with qwZ + int8 qgZ: mean loss {mean:+.2%} of DDP@4's, worst step {worst:.2%}")
    assert 0 < worst < 0.05 and abs(mean) < 0.01


def _hpz_node(rank: int, world_size: int) -> tuple[int, int]:
    from torch import nn

    from lzero import ZeroConfig
    from lzero.engine.engine import ZeroEngine

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)],
                        ZeroConfig(stage=3, hpz_partition_size="node", unit_modules=("Linear",)))
    secondary = engine.gatherer.secondary
    return secondary.size, secondary.held()


def test_hpz_partition_size_node_is_the_ranks_of_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hpz_partition_size="node"` reads LOCAL_WORLD_SIZE: 4 ranks as 2 nodes of 2 keep halves of each block."""
    from _dist import run_ranks

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for size, held in run_ranks(_hpz_node, 4):
        assert size == 2 and held == 2 * (8 * 8 + 8) // 2  # two Linear blocks of 72 elements (padded to 4: 72)
