"""Memory on a rank against the ZeRO formulas (see ../shared/DESIGN.md): live tensor bytes after backward
at stages 1-2 in fp32 and bf16-mixed (world sizes 2 and 4), and stage 3's peak working set and
between-step total (world sizes 2, 3 and 4)."""

from __future__ import annotations

import pytest

from _dist import run_ranks
import _engine_cases as cases

BUCKET = 20_000  # elements; the memory tolerance allows one bucket


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, run_ranks(cases.memory, world_size, BUCKET, world_size != 3, timeout=300)


@pytest.mark.parametrize("ranks", [2, 4], indirect=True)
@pytest.mark.parametrize("stage", [1, 2])
def test_memory_follows_zero_formula(ranks: tuple[int, list[dict]], stage: int) -> None:
    world_size, results = ranks
    for r in (res["fp32"][stage] for res in results):
        psi, n = r["psi"], world_size
        formula = 8 * psi + 8 * psi / n if stage == 1 else 4 * psi + 12 * psi / n  # fp32 Adam
        padding = 16 * r["padding"]
        print(f"stage {stage} N={n}: {r['bytes']} bytes, formula {formula:.0f}, padding {padding}, psi {psi}")
        assert r["units"] > 1
        assert formula - padding <= r["bytes"] <= formula + padding + 4 * BUCKET


@pytest.mark.parametrize("ranks", [2, 4], indirect=True)
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_mixed_memory_follows_mixed_precision_formula(ranks: tuple[int, list[dict]], stage: int) -> None:
    """ZeRO's mixed-precision formula: 2 bytes/param of bf16 parameters, 2 of bf16 gradients (stage 1:
    the full flat gradient; stage 2: freed after each reduction) and, sharded, 12 of fp32 master and
    Adam moments plus 4 of fp32 gradient shard (lzero reduces into fp32, where the paper counts 2)."""
    world_size, results = ranks
    for r in (res["bf16"][stage] for res in results):
        psi, n = r["psi"], world_size
        formula = 2 * psi + 2 * psi + 16 * psi / n if stage == 1 else 2 * psi + 16 * psi / n
        padding = 20 * r["padding"]
        print(f"bf16-mixed stage {stage} N={n}: {r['bytes']} bytes, formula {formula:.0f}, padding {padding}")
        assert formula - padding <= r["bytes"] <= formula + padding + 4 * BUCKET


@pytest.mark.parametrize("ranks", [2, 4], indirect=True)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_between_steps_no_gradient_is_held(ranks: tuple[int, list[dict]], precision: str, stage: int) -> None:
    """After the step (and zero_grad) no gradient buffer is left: the formula without its gradient term. fp32 Adam:
    4 bytes/param of parameters (the fp32 master is their owned slice) + 8/N of Adam moments; bf16-mixed: 2 of
    bf16 parameters + 12/N of fp32 master and moments. See [Note: gradient buffers] in flat_unit.py."""
    world_size, results = ranks
    for r in (res[precision][stage] for res in results):
        psi, n = r["psi"], world_size
        formula = 4 * psi + 8 * psi / n if precision == "fp32" else 2 * psi + 12 * psi / n
        padding = 16 * r["padding"]
        print(f"{precision} stage {stage} N={n}: between steps {r['between']} bytes, formula {formula:.0f}")
        assert formula - padding <= r["between"] <= formula + padding + 1024  # + the batch, Adam step counters


@pytest.mark.parametrize("ranks", [2, 3, 4], indirect=True)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stage3_memory(ranks: tuple[int, list[dict]], prefetch: int) -> None:
    world_size, results = ranks
    for r in (res["stage3"][prefetch] for res in results):
        formula = 12 * r["psi"] / world_size  # fp32 Adam: parameter shard, m and v; no gradient between steps
        padding = 16 * r["padding"]
        bound = r["root_bytes"] + (prefetch + 1) * r["max_block_bytes"]
        print(f"stage 3 N={world_size} prefetch={prefetch}: between steps {r['between']} bytes (12Psi/N"
              f" {formula:.0f}, padding {padding}); peak gathered params {r['peak_params']} bytes (bound {bound},"
              f" full model {r['full_bytes']})")
        assert r["units"] >= 9
        assert formula - padding <= r["between"] <= formula + padding + 1024  # + the batch, Adam step counters
        assert r["peak_params"] <= bound + 4 < r["full_bytes"]  # + the shared one-element NaN placeholder


@pytest.mark.parametrize("ranks", [2, 3, 4], indirect=True)
def test_stage3_bf16_mixed_between_steps(ranks: tuple[int, list[dict]]) -> None:
    """bf16-mixed at stage 3 between steps: 2 bytes/param of bf16 shard + 12 of fp32 master and Adam moments, / N."""
    world_size, results = ranks
    for r in (res["stage3_bf16"] for res in results):
        formula = 14 * r["psi"] / world_size
        print(f"bf16-mixed stage 3 N={world_size}: between steps {r['between']} bytes, 14Psi/N {formula:.0f}")
        assert formula - 14 * r["padding"] <= r["between"] <= formula + 14 * r["padding"] + 1024
