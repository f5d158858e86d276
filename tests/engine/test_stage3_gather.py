"""Stage 3's block lifecycle (lzero/engine/gather.py, [Note: stage-3 parameter lifecycle]) on gloo ranks: the
state of every block seen from inside forward and backward, ``gathered_parameters``, and a unit run on
only some ranks (a sample generated on one rank: the error named on every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

import _launch
from _dist import run_ranks
import _engine_cases as cases
from test_setup_failure import last_error

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


def states(gathered: set[int], launched: set[int] = set()) -> dict[str, str]:
    return {"": "GATHERED", **{name: "GATHERED" if i in gathered else "GATHERING" if i in launched else "RELEASED"
                               for i, name in enumerate(BLOCKS)}}


FORWARD, BACKWARD = range(4), (3, 2, 1, 0)
SCHEDULES = {  # [Note: stage-3 gather schedule]: the states seen in forward and backward of the second step
    # prefetch_bucket_size 1.5 blocks: blocks are launched until those ahead hold 1.5 blocks, so two ahead
    "bucket": ([states({k}, {k + 1, k + 2}) for k in FORWARD], [states({k}, {k - 1, k - 2}) for k in BACKWARD]),
    # prefetch=2 capped by max_live_parameters = root + 2 blocks: only one ahead
    "live": ([states({k}, {k + 1}) for k in FORWARD], [states({k}, {k - 1}) for k in BACKWARD]),
    # max_reuse_distance 2b + 1: blocks 3 (distance 0) and 2 (distance 2b) stay gathered at the end of forward
    "reuse": ([states({0}, {1}), states({1}, {2}), states({2}, {3}), states({2, 3})],
              [states({2, 3}), states({2}, {1}), states({1}, {0}), states({0})]),
    # reuse distance 10b, but max_live_parameters = root + 1.5 blocks: block 3 alone is kept, nothing prefetched
    "reuse_live": ([states({k}) for k in FORWARD], [states({k}) for k in BACKWARD]),
    # every block under param_persistence_threshold: gathered again by the first step's optimizer step (in one
    # coalesced all-gather), so the whole forward finds them gathered; each is released after its backward
    "persist": ([states(set(FORWARD)) for k in FORWARD], [states(set(range(k + 1))) for k in BACKWARD]),
    # gather_bucket_size 4 blocks: the first block's hook launches all four in one all-gather, in forward and again
    # in backward; each block is still released after its use
    "run": ([states({k}, set(range(k + 1, 4))) for k in FORWARD], [states({k}, set(range(k))) for k in BACKWARD]),
}


@pytest.mark.parametrize("ranks", [2], indirect=True)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gather_schedule_knobs_change_when_blocks_are_gathered_not_the_result(ranks, schedule: str) -> None:
    forward, backward = SCHEDULES[schedule]
    for res in ranks[1]:
        seen = res["schedules"][schedule]
        # persistent blocks: gathered by the previous optimizer step, kept when the step begins
        assert seen["after_root_gather"] == states(set(FORWARD) if schedule == "persist" else set())
        assert seen["forward"] == list(zip(FORWARD, forward))
        assert seen["backward"] == list(zip(BACKWARD, backward))
        assert seen["after_backward"] == {name: "RELEASED" for name in ["", *BLOCKS]}
        assert seen["params"] == res["states"]["params"]  # bitwise those of the default schedule (prefetch=1)


@pytest.mark.parametrize("ranks", [2], indirect=True)
def test_a_gradient_penalty_through_the_blocks_equals_the_plain_model(ranks: tuple[int, list[dict]]) -> None:
    """``torch.autograd.grad(create_graph=True)`` through gathered blocks, then ``backward()``: the blocks stay
    gathered for the second differentiation, and only the real backward reduces ([Note: one backward hook per
    block])."""
    for res in ranks[1]:
        print(f"gradient penalty vs plain model: {res['penalty']}")
        assert res["penalty"]["bitwise"], res["penalty"]


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


def test_a_unit_skipped_after_the_order_is_recorded_is_named_on_every_rank() -> None:
    """From the second step the order checks run one block ahead (asynchronously); a divergence is still caught
    before the mismatched all-gather is launched (gloo would abort the process on it)."""
    for rank, res in enumerate(run_ranks(cases.stage3_unit_skipped_after_recording, 2, timeout=120)):
        print(f"rank {rank}: {res}")
        assert res.startswith("step 3: Ranks disagree on the next unit to gather"), res
        assert "'spare'" in res and "'hidden.1.0'" in res


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from _pretrained_models import save_models

    return save_models(tmp_path_factory.mktemp("generate_misuse"), ["gpt2"])["gpt2"]


@pytest.mark.parametrize(("door", "alone"), [("trainer", 0), ("trainer", 1), ("fabric", 0)])
def test_generate_on_one_rank_is_named_on_every_rank(gpt2: Path, door: str, alone: int) -> None:
    """``model.generate`` on one rank alone under zero3 (tests/engine/generate_misuse.py, the check's timeout 3 s):
    the rank that times out raises the UnitOrderError naming ``strategy.generation()``; the one generating fails in
    transformers' all-reduce once its peer is gone, and prints the same error, raised from that failure ([Note: the
    misuse named on every rank]). Before, its last line was gloo's "Connection closed by peer"."""
    codes, outputs = _launch.run_ranks("generate_misuse.py", str(gpt2), door, str(alone), ranks=2, timeout=180)
    for rank, (code, (_, stderr)) in enumerate(zip(codes, outputs)):
        name, message = last_error(stderr)
        print(f"{door}, rank {alone} alone: rank {rank} exited {code}, last error {name}: {message[:100]}...")
        assert code != 0
        assert name == "UnitOrderError" and "`strategy.generation()`" in message, stderr[-3000:]
