"""Collectives over flat buffers: pure ``@torch.no_grad()`` functions, no Lightning.

Every input handed to a backend is checked to be contiguous: gloo silently reduces the wrong
memory for a non-contiguous tensor. At world size 1 the functions do the local equivalent
without touching the backend, unless ``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1`` is set: a testing aid
that sends them through the process group anyway, so one GPU runs NCCL's reduce-scatter and
all-gather with the data lzero gives them. An asynchronous call returns a handle with ``wait()``.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class Handle(Protocol):
    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class AllGather(Protocol):
    """A parameter all-gather: ``flat`` (1-D, N * len(shard)) receives every rank's ``shard``, in rank order. The
    engine chooses one per run, :func:`all_gather` or qwZ's int8 one (``quantized_collectives.param_all_gather``),
    and every parameter gather calls it; hpZ's gather within a node is one too (``SecondaryPartition.all_gather``).
    As FSDP2 swaps its ``AllGather``."""

    def __call__(self, flat: Tensor, shard: Tensor, group: Optional[dist.ProcessGroup] = None,
                 async_op: bool = False) -> Handle: ...


class _Done:
    """The handle of an operation that already completed locally."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


BACKEND_AT_WORLD_SIZE_1 = os.environ.get("LZERO_COLLECTIVES_AT_WORLD_SIZE_1", "0") == "1"
"""Testing aid, read at import: collectives at world size 1 go through the process group too."""


def local(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether a collective over ``group`` is a local copy (world size 1) rather than a backend call."""
    return world_size(group) == 1 and not (BACKEND_AT_WORLD_SIZE_1 and dist.is_available() and dist.is_initialized())


# torch 2.13 renamed the tensor collectives (the old names warn); the GPU image and older installs have only the old.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``dist.all_gather_single`` where torch has it, else its older name ``all_gather_into_tensor``."""


# [Note: host tensors on an accelerator's group]
# NCCL takes only device tensors ("No backend type associated with device type cpu", seen on the first GPU run):
# a CPU tensor handed to a collective on such a group (a seed, a run id, a size, an offloaded value) goes through a
# copy on the current accelerator, and the result is copied back into the caller's tensor. A group with gloo in its
# backend (gloo alone, or "cpu:gloo,cuda:nccl") takes CPU tensors as they are. Collectives of small host values
# only: the bulk traffic (buckets, gathered units) is on the device already.
def stage_device(group: Optional[dist.ProcessGroup], tensor: Tensor) -> Optional[torch.device]:
    """The device a collective over ``group`` must copy ``tensor`` to first, or None (it goes as it is)."""
    if tensor.device.type != "cpu":
        return None
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return None
    if not hasattr(torch, "accelerator"):  # torch before 2.6
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return None  # nothing to stage through: the backend reports its own error
    index = getattr(torch.accelerator, "current_device_index", None) or torch.accelerator.current_device_idx
    return torch.device(accelerator.type, index())


class _CopyBack:
    """Handle of a collective that ran on staged copies: ``wait()`` copies the result into the caller's tensor."""

    def __init__(self, work: Any, copy_back: Callable[[], None]) -> None:
        self.work, self.copy_back = work, copy_back

    def wait(self) -> bool:
        if self.copy_back is not None:
            self.work.wait()
            self.copy_back()
            self.copy_back = None
        return True

    def is_completed(self) -> bool:
        return self.copy_back is None or self.work.is_completed()


def _backend_call(call: Callable[..., Any], out: Tensor, inputs: Sequence[Tensor], group: Optional[dist.ProcessGroup],
                  async_op: bool) -> Handle:
    """``call(out, *inputs, async_op=async_op)`` on the backend, through staged copies when ``out`` is a host tensor
    on an accelerator's group ([Note: host tensors on an accelerator's group]). Inputs that alias ``out`` (in-place
    collectives) pass an empty ``inputs``."""
    device = stage_device(group, out)
    if device is None:
        work = call(out, *inputs, async_op=async_op)
        return work if async_op else _Done()
    staged = out.to(device, copy=True)  # copy: also when the stage is the same device (the CPU tests)
    work = call(staged, *[t.to(device) for t in inputs], async_op=async_op)
    copy_back = functools.partial(out.copy_, staged)
    if async_op:
        return _CopyBack(work, copy_back)
    copy_back()
    return _Done()


def _require_contiguous(*tensors: Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(
                f"lzero internal error: a collective got a non-contiguous tensor of shape {tuple(t.shape)}"
                " (gloo would silently reduce the wrong memory)."
            )


TRAFFIC: dict[str, int] = {"reduce": 0, "all_gather": 0}
"""Bytes this process has handed to reduce-scatters (the full flat input) and received from all-gathers (the
full output) since it started; the memory monitor logs their growth per step. Local (world size 1) copies count
too: they stand where the collectives would be."""

# [Note: pairwise collectives on gloo]
# gloo's reduce-scatter is slower than its all-reduce, and its all-gather slows down with the ranks. On gloo with CPU
# tensors both are therefore point to point: each rank sends every peer that peer's slice (or its own shard) and
# receives one slice from every peer, all posted at once, so a rank sends (N-1)/N of the buffer where an all-reduce
# sends 2(N-1)/N. On this 2-CPU machine (benchmarks/README.md, collectives), 20 MB over 2 ranks: reduce-scatter 8 ms
# against gloo's 24 ms (its all-reduce 17 ms), all-gather 7 ms against 15 ms; over 4 ranks: 21 ms against 52 ms (all-
# reduce 30 ms) and 19 ms against 82 ms. At 200 MB over 4 ranks the reduce-scatter is 318 ms against the all-reduce's
# 291 ms (its scratch for 3 received slices), the all-gather 156 ms against 363 ms. The received slices are summed
# in rank order, whatever order they arrive in; at N = 2 that is bitwise the all-reduce's (a + b == b + a). gloo
# matches messages in the order a pair of ranks posts them on one tag, and every rank issues lzero's collectives on
# a group in the same order.
# gloo's send/recv works report completion only from ``wait()``, so a daemon thread per process group waits them in
# posting order and each handle answers ``is_completed()`` without blocking (the reducer's hooks must never block:
# [Note: coalesced reductions] in reducer.py). One thread per group, not one for all: a stage-3 backward gather
# must not queue behind a reduction that the peer defers to the end of backward (a deadlock seen in the tests).
# Within one group order is harmless: every rank posts that group's messages in the same order.
_TAG = 0x1E20  # lzero's point-to-point messages; anything else a user sends on its own tag never matches them


def _pairwise(group: Optional[dist.ProcessGroup], *tensors: Tensor) -> bool:
    """Whether a collective runs point to point: gloo, CPU tensors, and peers to talk to (at world size 1 the switch
    ``LZERO_COLLECTIVES_AT_WORLD_SIZE_1`` asks for the backend's own collectives)."""
    return dist.get_backend(group) == "gloo" and world_size(group) > 1 and all(t.device.type == "cpu" for t in tensors)


class _Pairwise:
    """Handle of point-to-point sends and receives, with a ``finish`` to run once all arrived."""

    def __init__(self, works: list[Any], finish: Optional[Callable[[], None]]) -> None:
        self.works, self.finish = works, finish
        self.arrived = threading.Event()
        self.error: Optional[BaseException] = None
        self.submitted = False  # to the waiter thread, which then waits the works; else wait() does

    def wait(self) -> bool:
        if self.works is not None:
            if self.submitted:
                self.arrived.wait()
            else:
                self._wait_works()
            self.works = None
            if self.error is not None:
                raise self.error
            if self.finish is not None:
                self.finish()
                self.finish = None  # drop the scratch as soon as the result is out
        return True

    def is_completed(self) -> bool:
        return self.works is None or self.arrived.is_set()

    def _wait_works(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except BaseException as error:  # handed to the caller's wait()
            self.error = error
        self.arrived.set()


class _Waiters:
    """Daemon threads that wait asynchronous pairwise handles, one per process group, each in posting order:
    [Note: pairwise collectives on gloo]. A thread starts on its group's first handle and ends after
    ``_IDLE_S`` without one; a forked child starts its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.queues: dict[int, queue.SimpleQueue[_Pairwise]] = {}

    def submit(self, group: Optional[dist.ProcessGroup], handle: _Pairwise) -> _Pairwise:
        key = id(group if group is not None else dist.group.WORLD)
        with self.lock:
            if self.pid != os.getpid():  # a forked child: the parent's threads did not come along
                self.pid, self.queues = os.getpid(), {}
            handles = self.queues.get(key)
            if handles is None:
                handles = self.queues[key] = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(key, handles), name="lzero-gloo-waiter", daemon=True).start()
            handle.submitted = True
            handles.put(handle)
        return handle

    def _run(self, key: int, handles: queue.SimpleQueue[_Pairwise]) -> None:
        while True:
            try:
                handle = handles.get(timeout=_IDLE_S)
            except queue.Empty:
                with self.lock:  # nothing is submitted to this queue while the lock is held
                    if handles.empty():
                        if self.queues.get(key) is handles:
                            del self.queues[key]
                        return
                continue
            handle._wait_works()


_IDLE_S = 30.0
_waiters = _Waiters()


def _post(sends: Sequence[tuple[Tensor, int]], receives: Sequence[tuple[Tensor, int]],
          group: Optional[dist.ProcessGroup], async_op: bool, finish: Optional[Callable[[], None]]) -> Handle:
    # global ranks: ``group_dst``/``group_src`` would need torch >= 2.6, and lzero runs on the torch it declares
    ranks = dist.get_process_group_ranks(group) if group is not None else range(world_size())
    works = [dist.isend(t, dst=ranks[peer], group=group, tag=_TAG) for t, peer in sends]
    works += [dist.irecv(t, src=ranks[peer], group=group, tag=_TAG) for t, peer in receives]
    handle = _Pairwise(works, finish)
    if async_op:
        return _waiters.submit(group, handle)
    handle.wait()
    return _Done()


@torch.no_grad()
def reduce_scatter(output: Tensor, flat: Tensor, group: Optional[dist.ProcessGroup] = None,
                   async_op: bool = False) -> Handle:
    """Sum ``flat`` (1-D, N * len(output)) over ranks; this rank receives its slice in ``output``.
    ``flat`` must stay untouched until the handle is waited."""
    _require_contiguous(output, flat)
    TRAFFIC["reduce"] += flat.numel() * flat.element_size()
    if local(group):
        output.copy_(flat)
        return _Done()
    if not _pairwise(group, output, flat):
        return _backend_call(lambda o, i, async_op: _reduce_scatter_single(o, i, op=dist.ReduceOp.SUM, group=group,
                                                                           async_op=async_op),
                             output, [flat], group, async_op)
    n, me = world_size(group), rank(group)
    slices = flat.view(n, -1)
    peers = [p for p in range(n) if p != me]
    if n == 2:  # the peer's slice lands in ``output`` itself: no scratch
        def finish() -> None:
            output.add_(slices[me])
        return _post([(slices[peers[0]], peers[0])], [(output, peers[0])], group, async_op, finish)
    received = torch.empty(n - 1, output.numel(), dtype=flat.dtype, device=flat.device)

    def finish_in_rank_order() -> None:
        parts = [received[i] for i in range(me)] + [slices[me]] + [received[i] for i in range(me, n - 1)]
        output.copy_(parts[0])
        for part in parts[1:]:
            output.add_(part)
    return _post([(slices[p], p) for p in peers], list(zip(received, peers)), group, async_op, finish_in_rank_order)


@torch.no_grad()
def all_gather(flat: Tensor, shard: Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Handle:
    """Concatenate every rank's ``shard`` into ``flat`` (1-D, N * len(shard)), rank order."""
    _require_contiguous(flat, shard)
    TRAFFIC["all_gather"] += flat.numel() * flat.element_size()
    if local(group):
        flat.copy_(shard)
        return _Done()
    if not _pairwise(group, flat, shard):
        return _backend_call(lambda o, i, async_op: all_gather_single(o, i, group=group, async_op=async_op),
                             flat, [shard], group, async_op)
    n, me = world_size(group), rank(group)
    slices = flat.view(n, -1)
    slices[me].copy_(shard)
    peers = [p for p in range(n) if p != me]
    return _post([(slices[me], p) for p in peers], [(slices[p], p) for p in peers], group, async_op, None)


@torch.no_grad()
def all_to_all_single(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> Handle:
    """Rank r receives row k of rank k's ``input`` as row k of its ``output`` (both N rows of equal length). lzero's
    one all-to-all is qgZ's reduce-scatter of quantized chunks ([Note: quantized collectives] in
    quantized_collectives.py), so its bytes count in ``TRAFFIC["reduce"]``: the whole input, as :func:`reduce_scatter`
    counts its own."""
    _require_contiguous(output, input)
    TRAFFIC["reduce"] += input.numel() * input.element_size()
    if local(group):
        output.copy_(input)
        return _Done()
    return _backend_call(lambda o, i, async_op: dist.all_to_all_single(o, i, group=group, async_op=async_op),
                         output, [input], group, async_op)


@torch.no_grad()
def all_reduce(tensor: Tensor, op: Any = None, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """In-place synchronous all-reduce (SUM unless ``op`` is given); returns ``tensor``."""
    _require_contiguous(tensor)
    if not local(group):
        op = op if op is not None else dist.ReduceOp.SUM
        _backend_call(lambda t, async_op: dist.all_reduce(t, op=op, group=group, async_op=async_op), tensor, [], group,
                      async_op=False)
    return tensor


@torch.no_grad()
def start_all_reduce(tensor: Tensor, group: Optional[dist.ProcessGroup] = None) -> Handle:
    """In-place asynchronous SUM all-reduce: ``tensor`` holds the sum once the handle's ``wait()`` returns."""
    _require_contiguous(tensor)
    if local(group):
        return _Done()
    return _backend_call(lambda t, async_op: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op),
                         tensor, [], group, async_op=True)


@torch.no_grad()
def broadcast_(tensors: Sequence[Tensor], src: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite every tensor in place with rank ``src``'s values (as DDP does at construction); ``src`` is a rank
    within ``group``."""
    if local(group):
        return
    for t in tensors:
        staging = t if t.is_contiguous() else t.contiguous()
        _broadcast(staging, src, group)
        if staging is not t:
            t.copy_(staging)


def _broadcast(t: Tensor, src: int, group: Optional[dist.ProcessGroup]) -> None:
    if group is not None:  # torch's ``src`` is a global rank: a group's rank 0 is another rank's in every other group
        src = dist.get_global_rank(group, src)
    _backend_call(lambda x, async_op: dist.broadcast(x, src=src, group=group, async_op=async_op), t, [], group,
                  async_op=False)


@torch.no_grad()
def broadcast_coalesced_(tensors: Sequence[Tensor], src: int = 0, group: Optional[dist.ProcessGroup] = None,
                         max_numel: int = 2**62) -> None:
    """Like :func:`broadcast_` but packing tensors of one dtype into collectives of up to
    ``max_numel`` elements (a larger tensor goes alone): for many small tensors."""
    if local(group) or not tensors:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        batch: list[Tensor] = []
        for t in same + [None]:
            if batch and (t is None or sum(b.numel() for b in batch) + t.numel() > max_numel):
                _broadcast_packed(batch, src, group)
                batch = []
            if t is not None:
                batch.append(t)


def _broadcast_packed(batch: list[Tensor], src: int, group: Optional[dist.ProcessGroup]) -> None:
    flat = torch.cat([t.reshape(-1) for t in batch])
    _broadcast(flat, src, group)
    offset = 0
    for t in batch:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if not local(group):
        dist.barrier(group=group)
