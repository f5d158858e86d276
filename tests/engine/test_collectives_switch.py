"""``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1`` (a testing aid, see collectives.py) sends world-size-1
collectives through the process group, so a single GPU exercises NCCL, and changes no result."""

from __future__ import annotations


from _dist import run_ranks
import _engine_cases as cases

CONFIGS = [{"stage": 1}, {"stage": 2}, {"stage": 2, "acc": 2}, {"stage": 3}]


def counted_against_ddp(rank: int, world_size: int) -> dict:
    """cases.against_ddp at world size 1, counting the backend calls lzero's collectives make."""
    import torch.distributed as dist

    from lzero.engine import collectives

    calls = {"all_reduce": 0, "all_gather_single": 0, "reduce_scatter_single": 0}
    # where collectives.py looks each one up: torch's module, or its own name bound at import (torch < 2.13 has only
    # the older names of the tensor collectives)
    homes = {"all_reduce": (dist, "all_reduce"), "all_gather_single": (collectives, "all_gather_single"),
             "reduce_scatter_single": (collectives, "_reduce_scatter_single")}
    for name, (home, attribute) in homes.items():
        original = getattr(home, attribute)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(home, attribute, counting)
    results = cases.against_ddp(rank, world_size, CONFIGS)
    return {"results": results, "calls": calls, "switch": collectives.BACKEND_AT_WORLD_SIZE_1}


def test_switch_routes_world_size_1_through_the_backend_without_changing_results(monkeypatch) -> None:
    monkeypatch.delenv("LZERO_COLLECTIVES_AT_WORLD_SIZE_1", raising=False)
    (plain,) = run_ranks(counted_against_ddp, 1)
    monkeypatch.setenv("LZERO_COLLECTIVES_AT_WORLD_SIZE_1", "1")
    (routed,) = run_ranks(counted_against_ddp, 1)
    print(f"backend calls without the switch {plain['calls']}, with it {routed['calls']}")
    assert not plain["switch"] and routed["switch"]
    for cfg, a, b in zip(CONFIGS, plain["results"], routed["results"], strict=True):
        assert a["bitwise"] and b["bitwise"], (cfg, a, b)  # both equal DDP at world size 1, bit for bit
    # (DDP reduces in C++, outside these counters.) at world size 1 the switch sends gloo its own collectives
    assert plain["calls"] == {"all_reduce": 0, "all_gather_single": 0, "reduce_scatter_single": 0}
    assert routed["calls"]["all_reduce"] > 0 and routed["calls"]["all_gather_single"] > 0
