"""Where a tensor-parallel rank's local tensor lies in the whole parameter: arithmetic only (no process group), shared
by the engine (loading a checkpoint into local tensors) and the checkpoint reader (assembling whole tensors from the
local pieces of every tensor rank).

[Note: tensor-parallel checkpoints]
Under tensor parallel a rank's units hold the local tensors of its DTensor parameters (see [Note: tensor parallel
under ZeRO] in tensor_parallel.py), and a checkpoint stays keyed by parameter: every rank of every tensor coordinate
writes its pieces as ranges of its flattened local tensor, a tensor-replicated parameter (``Replicate``, or a plain
tensor) by tensor coordinate 0 alone. The manifest's ``tensor_parallel`` names the tensor size T and, for each
tensor-sharded parameter, its sharded dimension; ``params`` holds the whole shapes. File r holds tensor coordinate
r % T's pieces. A ``Shard(d)`` parameter of whole size S on dimension d is cut as torch cuts it (``torch.chunk``):
coordinate t holds rows ``[t*c, min((t+1)*c, S))`` of that dimension, c = ceil(S / T), so its flattened local tensor
is ``outer`` runs (the product of the sizes before d) of ``length * inner`` contiguous elements of the whole
flattened tensor (``runs``). The reader turns each saved piece into the pieces of the whole tensor it covers, so
``consolidate``, ``export-hf``, ``inspect`` and a resume at any (tensor, data) sizes, world size 1 included, read
whole-tensor ranges as from any other checkpoint; a tensor-parallel resume reads its own local tensor's runs.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple


class TensorLayout(NamedTuple):
    """One ``Shard(dim)`` parameter cut over ``size`` tensor ranks: its whole ``shape``."""

    shape: tuple[int, ...]
    dim: int
    size: int

    def extent(self, rank: int) -> tuple[int, int]:
        """The first index along ``dim`` that ``rank`` holds, and how many."""
        whole = self.shape[self.dim]
        chunk = -(-whole // self.size)
        start = min(rank * chunk, whole)
        return start, min(whole, start + chunk) - start

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = self.extent(rank)[1]
        return tuple(shape)

    def runs(self, rank: int, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """Elements ``[start, end)`` of ``rank``'s flattened local tensor as (local start, local end, whole start):
        each run is contiguous in both. See [Note: tensor-parallel checkpoints]."""
        inner = math.prod(self.shape[self.dim + 1:])
        first, length = self.extent(rank)
        local_row, whole_row = length * inner, self.shape[self.dim] * inner  # one outer index's elements
        if local_row == 0:
            return
        at = start
        while at < end:
            outer, offset = divmod(at, local_row)
            stop = min(end, (outer + 1) * local_row)
            yield at, stop, outer * whole_row + first * inner + offset
            at = stop


def layout_of(record: dict, size: int, shape: list[int]) -> TensorLayout:
    """A manifest's ``tensor_parallel.params`` entry (``{"dim": d}``) with the parameter's whole shape."""
    return TensorLayout(tuple(shape), int(record["dim"]), size)
