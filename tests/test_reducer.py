"""Gradient reductions (lzero/engine/reducer.py, [Note: reduction order]) on two gloo ranks, directly: rank 1 skips
a layer that rank 0 uses."""

from __future__ import annotations

import pytest

from _dist import run_ranks
import _engine_cases as cases


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(cases.reducer_order, 2, timeout=120)


def test_every_rank_launches_the_same_units_in_unit_order(ranks: list[dict]) -> None:
    first, second = ranks
    print(f"launch order rank 0 {first['launched']}, rank 1 {second['launched']}")
    assert first["launched"] == second["launched"] == list(range(first["units"]))  # all used somewhere: all reduced
    assert first["second"] == second["second"] == [i for i in range(first["units"]) if i not in first["spare_units"]]


def test_each_shard_holds_the_average_with_zeros_for_what_a_rank_lacks(ranks: list[dict]) -> None:
    for res in ranks:
        assert res["expected_ok"] and res["no_grad_units"] == []
        assert len(res["spare_units"]) == 2  # weight and bias, one unit each


def test_a_unit_no_rank_used_keeps_no_gradient(ranks: list[dict]) -> None:
    assert all(res["spare_no_grad"] for res in ranks)
