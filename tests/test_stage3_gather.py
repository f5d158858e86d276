"""Stage 3's block lifecycle (lzero/gather.py, [Note: stage-3 parameter lifecycle]) on gloo ranks: the
state of every block seen from inside forward and backward, ``gathered_parameters``, and a unit run on
only some ranks."""

from __future__ import annotations

import pytest

from _dist import run_ranks
import _engine_cases as cases

BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, run_ranks(cases.stage3_gather, world_size, timeout=300)


def expected(gathered: int, launched: list[int]) -> dict[str, str]:
    states = {"": "GATHERED"}  # the root stays gathered from the start of the step to the end of backward
    for i, name in enumerate(BLOCKS):
        states[name] = "GATHERED" if i == gathered else "GATHERING" if i in launched else "RELEASED"
    return states


@pytest.mark.parametrize("ranks", [2], indirect=True)
def test_block_states_follow_forward_and_backward_with_prefetch(ranks: tuple[int, list[dict]]) -> None:
    for res in ranks[1]:
        seen = res["states"]
        assert seen["after_root_gather"] == expected(-1, [])
        # forward, prefetch 1: block k computes, block k+1's all-gather is in flight
        assert seen["forward"] == [(k, expected(k, [k + 1] if k < 3 else [])) for k in range(4)]
        # backward (reverse order): when block k's fc.weight gets its gradient, block k is still gathered (its
        # LayerNorm's gradients are still to come) and block k-1's all-gather is in flight
        assert seen["backward"] == [(k, expected(k, [k - 1] if k > 0 else [])) for k in (3, 2, 1, 0)]
        assert seen["after_backward"] == {name: "RELEASED" for name in ["", *BLOCKS]}


@pytest.mark.parametrize("ranks", [2], indirect=True)
def test_stage3_unit_run_on_some_ranks_is_a_clear_error(ranks: tuple[int, list[dict]]) -> None:
    for rank, res in enumerate(ranks[1]):
        print(f"rank {rank}: {res['partial']}")
        assert "Ranks disagree on the next unit to gather" in res["partial"]
        assert "'spare'" in res["partial"] and "'out'" in res["partial"]


@pytest.mark.parametrize("ranks", [2, 3, 4], indirect=True)
def test_stage3_gathered_parameters_context(ranks: tuple[int, list[dict]]) -> None:
    world_size, results = ranks
    for res in results:
        assert res["gathered"] == {"released_before": True, "seen_full": True, "others_released": True,
                                   "released_after": True, "write_carried": True, "stray_access_refused": True}
