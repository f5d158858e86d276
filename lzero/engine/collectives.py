"""Collectives over flat buffers: pure ``@torch.no_grad()`` functions, no Lightning.

Every input handed to a backend is checked to be contiguous: gloo silently reduces the wrong
memory for a non-contiguous tensor. At world size 1 the functions do the local equivalent
without touching the backend, unless ``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1`` is set: a testing aid
that sends them through the process group anyway, so one GPU runs NCCL's reduce-scatter and
all-gather with the data lzero gives them. An asynchronous call returns a handle with ``wait()``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class Handle(Protocol):
    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


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


def _require_contiguous(*tensors: Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(
                f"lzero internal error: a collective got a non-contiguous tensor of shape {tuple(t.shape)}"
                " (gloo would silently reduce the wrong memory)."
            )


class _SliceAfter:
    """Handle of an all-reduce whose result this rank reads one slice of."""

    def __init__(self, work: Any, flat: Tensor, output: Tensor, start: int) -> None:
        self.work, self.flat, self.output, self.start = work, flat, output, start

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.output.copy_(self.flat[self.start : self.start + self.output.numel()])
            self.work = self.flat = None  # the bucket can go as soon as its slice is out
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


TRAFFIC: dict[str, int] = {"reduce": 0, "all_gather": 0}
"""Bytes this process has handed to reduce-scatters (the full flat input) and received from all-gathers (the
full output) since it started; the memory monitor logs their growth per step. Local (world size 1) copies count
too: they stand where the collectives would be."""


def reduces_by_all_reduce(group: Optional[dist.ProcessGroup] = None) -> bool:
    """gloo's all-reduce is faster than its reduce-scatter (benchmarks/results_collectives.md), so on gloo
    a reduce-scatter is an all-reduce plus a slice."""
    return dist.get_backend(group) == "gloo"


@torch.no_grad()
def reduce_scatter(output: Tensor, flat: Tensor, group: Optional[dist.ProcessGroup] = None,
                   async_op: bool = False) -> Handle:
    """Sum ``flat`` (1-D, N * len(output)) over ranks; this rank receives its slice in ``output``.
    ``flat`` is scratch: on gloo it ends up holding the whole sum."""
    _require_contiguous(output, flat)
    TRAFFIC["reduce"] += flat.numel() * flat.element_size()
    if local(group):
        output.copy_(flat)
        return _Done()
    if reduces_by_all_reduce(group):
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        handle = _SliceAfter(work, flat, output, rank(group) * output.numel())
        if not async_op:
            handle.wait()
        return handle
    work = dist.reduce_scatter_single(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work if async_op else _Done()


@torch.no_grad()
def all_gather(flat: Tensor, shard: Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> Handle:
    """Concatenate every rank's ``shard`` into ``flat`` (1-D, N * len(shard)), rank order."""
    _require_contiguous(flat, shard)
    TRAFFIC["all_gather"] += flat.numel() * flat.element_size()
    if local(group):
        flat.copy_(shard)
        return _Done()
    work = dist.all_gather_single(flat, shard, group=group, async_op=async_op)
    return work if async_op else _Done()


@torch.no_grad()
def all_reduce(tensor: Tensor, op: Any = None, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """In-place synchronous all-reduce (SUM unless ``op`` is given); returns ``tensor``."""
    _require_contiguous(tensor)
    if not local(group):
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    return tensor


@torch.no_grad()
def start_all_reduce(tensor: Tensor, group: Optional[dist.ProcessGroup] = None) -> Handle:
    """In-place asynchronous SUM all-reduce: ``tensor`` holds the sum once the handle's ``wait()`` returns."""
    _require_contiguous(tensor)
    if local(group):
        return _Done()
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


@torch.no_grad()
def broadcast_(tensors: Sequence[Tensor], src: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite every tensor in place with rank ``src``'s values (as DDP does at construction)."""
    if local(group):
        return
    for t in tensors:
        if t.is_contiguous():
            dist.broadcast(t, src=src, group=group)
        else:
            staging = t.contiguous()
            dist.broadcast(staging, src=src, group=group)
            t.copy_(staging)


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
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for t in batch:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    if not local(group):
        dist.barrier(group=group)
