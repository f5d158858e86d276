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


class _Pending:
    """A reduce-scatter the peer has not joined yet: never completes, and waiting on it would hang."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("a gradient hook waited on a reduction the peer had not launched: it would hang")


class _Unit:
    """What the reducer reads of a FlatUnit."""

    def __init__(self, numel: int) -> None:
        import torch

        self.spec = type("Spec", (), {"padded_numel": numel, "shard_numel": numel // 2})()
        self.accumulates_locally = False
        self.waiting_for_grads = False
        self.expected = 1
        self.launched = False
        self.reduce_dtype = torch.float32
        self.grads = torch.ones(numel)

    def mark_launched(self) -> None:
        self.launched = True

    def pack_grads(self, scale: float):
        return self.grads * scale


def test_hooks_never_wait_on_a_reduction_the_peer_deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hang seen on the wide benchmark, replayed on one process: a small unit is held, then a large unit is
    ready while one reduction may be in flight. The hook flushes the held bucket (its reduction now in flight and,
    on the peer, deferred to the end of backward) and must then return rather than wait for room to launch the
    large unit. Launching the rest at the end of backward waits, as it may."""
    from lzero.config import ZeroConfig
    from lzero.engine import reducer as reducer_module

    launched = []

    def reduce_scatter(out, bucket, group, async_op):
        launched.append(bucket.numel())
        return _Pending()

    monkeypatch.setattr(reducer_module.dist, "new_group", lambda *a, **k: None)
    monkeypatch.setattr(reducer_module.collectives, "reduce_scatter", reduce_scatter)
    small, large = _Unit(8), _Unit(64)
    config = ZeroConfig(stage=2, reduce_bucket_size=64, max_inflight_reductions=1)
    reducer = reducer_module.Reducer([small, large], config, group=None, world_size=2)
    reducer.begin_backward()
    reducer.launch_ready_in_order()  # as a hook would: must not block
    assert launched == [8]  # the held small unit went out alone, then the hook stopped at the large unit
    assert reducer.next == 1 and not large.launched
    with pytest.raises(AssertionError, match="would hang"):  # the end of backward waits for room, as it should
        reducer.launch(large)
