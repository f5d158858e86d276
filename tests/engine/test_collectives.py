"""gloo's reduce-scatter and all-gather run point to point ([Note: pairwise collectives on gloo] in collectives.py):
the results are checked against sums and concatenations computed locally from every rank's input."""

from __future__ import annotations

import pytest

from _dist import run_ranks


def _inputs(world_size: int, numel: int) -> list:
    import torch

    return [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]


def pairwise_cases(rank: int, world_size: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from lzero.engine import collectives

    numel = 6 * 1000
    every = _inputs(world_size, numel)
    mine = slice(rank * numel // world_size, (rank + 1) * numel // world_size)
    in_rank_order = every[0].clone()
    for other in every[1:]:
        in_rank_order += other
    results = {}
    # asynchronous, then a synchronous one while the first is still unwaited, then land the first
    flat, out = every[rank].clone(), torch.empty(numel // world_size)
    first = collectives.reduce_scatter(out, flat, async_op=True)
    flat2, out2 = (2 * every[rank]).contiguous(), torch.empty(numel // world_size)
    collectives.reduce_scatter(out2, flat2)
    first.wait()
    results["reduce_scatter_async"] = torch.equal(out, in_rank_order[mine])
    results["reduce_scatter_sync"] = torch.equal(out2, (2 * in_rank_order)[mine])
    reference = every[rank].clone()
    dist.all_reduce(reference)
    results["all_reduce_slice"] = torch.equal(out, reference[mine])  # the old path; bitwise at world size 2
    # an all-gather, asynchronous
    gathered = torch.empty(numel)
    collectives.all_gather(gathered, every[rank][mine].clone(), async_op=True).wait()
    k = numel // world_size
    results["all_gather"] = torch.equal(gathered, torch.cat([e[r * k : (r + 1) * k] for r, e in enumerate(every)]))
    # completion is seen without waiting, and not before the peers posted: rank 0 posts late
    if rank == 0:
        time.sleep(0.5)
    flat, out = every[rank].clone(), torch.empty(numel // world_size)
    handle = collectives.reduce_scatter(out, flat, async_op=True)
    results["complete_before_peer_posted"] = handle.is_completed() if rank != 0 else None
    deadline = time.monotonic() + 20
    while not handle.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    results["completed_without_wait"] = handle.is_completed()
    handle.wait()
    results["late"] = torch.equal(out, in_rank_order[mine])
    return results


def one_group_does_not_wait_for_another(rank: int, world_size: int) -> dict:
    """Rank 0 starts a reduce-scatter on group A, which rank 1 starts only after a later collective, then an
    all-gather on group B, which rank 1 starts at once: B completes while A still waits (a shared waiter would wait
    A first and deadlock, as a stage-3 backward gather did behind a deferred reduction)."""
    import time

    import torch
    import torch.distributed as dist

    from lzero.engine import collectives

    a, b, sync = dist.new_group(), dist.new_group(), dist.new_group()
    flat, out = torch.full((8,), float(rank + 1)), torch.empty(4)
    shard, gathered = torch.full((3,), float(rank)), torch.empty(6)
    completed = None
    if rank == 0:
        first = collectives.reduce_scatter(out, flat, a, async_op=True)
        second = collectives.all_gather(gathered, shard, b, async_op=True)
        deadline = time.monotonic() + 10
        while not second.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        completed = second.is_completed() and not first.is_completed()
        collectives.all_reduce(torch.zeros(1), group=sync)  # lets rank 1 start A
        second.wait()
        first.wait()
    else:
        collectives.all_gather(gathered, shard, b, async_op=True).wait()
        collectives.all_reduce(torch.zeros(1), group=sync)
        collectives.reduce_scatter(out, flat, a)
    return {"b_before_a": completed, "sum": out.tolist(), "gathered": gathered.tolist()}


def test_a_group_completes_while_another_waits() -> None:
    r0, r1 = run_ranks(one_group_does_not_wait_for_another, 2)
    assert r0["b_before_a"] is True, r0
    assert r0["sum"] == r1["sum"] == [3.0] * 4 and r0["gathered"] == r1["gathered"] == [0.0] * 3 + [1.0] * 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_pairwise_gloo_collectives_sum_in_rank_order(world_size: int) -> None:
    for rank, result in enumerate(run_ranks(pairwise_cases, world_size)):
        print(rank, result)
        assert result["reduce_scatter_async"] and result["reduce_scatter_sync"] and result["all_gather"], result
        assert result["completed_without_wait"] and result["late"], result
        assert result["complete_before_peer_posted"] in (None, False), result  # rank 0 had not posted yet
        if world_size == 2:
            assert result["all_reduce_slice"], result  # a + b == b + a: bitwise the all-reduce's


def staged_cases(rank: int, world_size: int) -> dict:
    """Every collective with host tensors staged through copies ([Note: host tensors on an accelerator's group]), as
    on an NCCL group: here the "accelerator" is the CPU itself, so the staging is a copy the backend sees instead of
    the caller's tensor, and each result must land back in the caller's tensor."""
    import torch
    import torch.distributed as dist

    from lzero.engine import collectives

    seen = []  # every tensor the backend was handed
    for name in ("broadcast", "all_reduce"):
        real = getattr(dist, name)
        setattr(dist, name, lambda t, *a, _real=real, **k: (seen.append(t), _real(t, *a, **k))[1])
    collectives.stage_device = lambda group, tensor: torch.device("cpu") if tensor.device.type == "cpu" else None
    collectives._pairwise = lambda group, *tensors: False  # gloo's own collectives, as NCCL's would run
    results = {}
    seed = torch.tensor([11 + rank])
    collectives.broadcast_([seed], src=0)
    results["broadcast"] = seed.tolist()
    strided = torch.arange(8.0).view(2, 4).t() * (rank + 1)  # not contiguous: broadcast through its own copy
    collectives.broadcast_([strided], src=0)
    results["broadcast_strided"] = torch.equal(strided, torch.arange(8.0).view(2, 4).t())
    packed = [torch.full((3,), float(rank + 1)), torch.full((2,), float(rank + 5))]
    collectives.broadcast_coalesced_(packed, src=0)
    results["broadcast_coalesced"] = [t.tolist() for t in packed]
    flag = torch.tensor([float(rank)])
    collectives.all_reduce(flag, op=dist.ReduceOp.MAX)
    results["all_reduce_max"] = flag.item()
    total = torch.tensor([1.0 + rank])
    handle = collectives.start_all_reduce(total)
    handle.wait()
    results["start_all_reduce"] = total.item()
    out, flat = torch.empty(2), torch.arange(4.0) + rank
    collectives.reduce_scatter(out, flat, async_op=True).wait()
    results["reduce_scatter"] = out.tolist()
    gathered = torch.empty(4)
    collectives.all_gather(gathered, torch.full((2,), float(rank)))
    results["all_gather"] = gathered.tolist()
    before = collectives.TRAFFIC["reduce"]
    received, sent = torch.empty(2, 2), (torch.arange(4.0) + 10 * rank).view(2, 2)  # row k goes to rank k
    collectives.all_to_all_single(received, sent, async_op=True).wait()
    results["all_to_all"] = received.tolist()
    results["all_to_all_counted"] = collectives.TRAFFIC["reduce"] - before
    results["caller_tensor_never_handed_over"] = not any(t is x for t in seen for x in (seed, flag, total))
    results["backend_calls"] = len(seen)
    return results


def test_host_tensors_go_through_staged_copies_and_land_back() -> None:
    for rank, result in enumerate(run_ranks(staged_cases, 2)):
        print(rank, result)
        assert result["broadcast"] == [11] and result["broadcast_strided"], result
        assert result["broadcast_coalesced"] == [[1.0] * 3, [5.0] * 2], result
        assert result["all_reduce_max"] == 1.0 and result["start_all_reduce"] == 3.0, result
        assert result["reduce_scatter"] == ([1.0, 3.0] if rank == 0 else [5.0, 7.0]), result
        assert result["all_gather"] == [0.0, 0.0, 1.0, 1.0], result
        assert result["all_to_all"] == [[2.0 * rank, 2.0 * rank + 1], [10 + 2.0 * rank, 11 + 2.0 * rank]], result
        assert result["all_to_all_counted"] == 16, result  # the whole input, as a reduce-scatter counts its own
        assert result["caller_tensor_never_handed_over"] and result["backend_calls"] == 5, result


def test_stage_device_picks_the_accelerator_only_for_groups_without_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    from lzero.engine import collectives

    host, device = torch.zeros(1), torch.zeros(1, device="meta")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    for backend, expected in [("nccl", torch.device("cuda", 3)), ("gloo", None), ("cpu:gloo,cuda:nccl", None)]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, _b=backend: _b)
        assert collectives.stage_device(None, host) == expected, backend
        assert collectives.stage_device(None, device) is None, backend  # already on a device: as it is
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert collectives.stage_device(None, host) is None  # no accelerator: the backend's own error stands


def test_collectives_run_on_a_torch_without_the_2_13_names(tmp_path) -> None:
    """The GPU machine's torch (2.11) has no ``dist.reduce_scatter_single`` / ``all_gather_single`` (2.13's names):
    lzero then uses ``reduce_scatter_tensor`` / ``all_gather_into_tensor``. A fresh interpreter without the new names
    runs both through the backend (world size 1, ``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1``)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "old_names.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "del dist.reduce_scatter_single, dist.all_gather_single\n"
        "from lzero.engine import collectives\n"
        "assert collectives._reduce_scatter_single is dist.reduce_scatter_tensor\n"
        "assert collectives.all_gather_single is dist.all_gather_into_tensor\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "out = torch.empty(4); collectives.reduce_scatter(out, torch.arange(4.0)); print(out.tolist())\n"
        "flat = torch.empty(4); collectives.all_gather(flat, torch.arange(4.0) + 1); print(flat.tolist())\n"
        "dist.destroy_process_group()\n")
    env = {**os.environ, "LZERO_COLLECTIVES_AT_WORLD_SIZE_1": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[0.0, 1.0, 2.0, 3.0]", "[1.0, 2.0, 3.0, 4.0]"], done.stdout
