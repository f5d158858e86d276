"""hpZ: a secondary copy of each stage-3 block's parameters, partitioned within a node, for backward's all-gathers.

[Note: hpZ]
ZeRO++'s hierarchical partitioning (arXiv 2306.10209, DeepSpeed's ``zero_hpz_partition_size``). The primary shards
(masters, optimizer state, the compute shards) stay sharded over all N ranks, so memory for them falls as 1/N. A
block's forward gathers it over all N, across nodes; when forward releases it and a backward will follow, each rank
keeps its 1/H slice of the gathered values, H being the ranks of its node (groups of H consecutive ranks). The
block's gather in backward is then an all-gather of those slices within the node, and never crosses nodes: one
inter-node all-gather per block per step instead of two. The values are the same ones forward computed with
(bitwise, quantized or not), so results do not change.
- The buffers are allocated once, at start (1/H of every block's padded parameters, in the compute dtype), as
  DeepSpeed does: the memory logs and ``lzero estimate`` count them as ``hpz_secondary``.
- A slice is valid from the forward that kept it to the end of that backward (``Gatherer.end_backward``; also
  dropped when a step's first forward begins), so no gather after the optimizer step, nor a state_dict or a
  generation between steps, reads it. Only backward's gathers read it; a block whose slices are not valid is
  gathered over all N, as without hpZ. Validity follows the forward and backward, so every rank decides alike.
  The root (gathered for the whole step) keeps none.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lzero.engine import collectives
from lzero.engine.flat_unit import FlatUnit


class SecondaryPartition:
    """This rank's slices of the blocks' gathered parameters, and the node group they are gathered over."""

    def __init__(self, units: Sequence[FlatUnit], group: Any, size: int, index: int) -> None:
        self.group = group  # the H ranks of this rank's node
        self.size = size  # H
        self.index = index  # this rank's place in it
        self._slices = {id(u): torch.empty(u.spec.padded_numel // size, dtype=u.flat_param.dtype,
                                           device=u.flat_param.device) for u in units}  # 1D each
        self._valid: set[int] = set()
        self.gathered_bytes = 0  # received by all-gathers within the node since the start

    def tensors(self) -> list[torch.Tensor]:
        return list(self._slices.values())

    def held(self) -> int:
        """Elements of the copy this rank holds: 1/H of the blocks' (padded) parameters."""
        return sum(s.numel() for s in self._slices.values())

    def keep(self, units: Sequence[FlatUnit]) -> None:
        """Copy this rank's slice of each of ``units``' gathered values (the block is gathered)."""
        for unit in units:
            piece = self._slices.get(id(unit))
            if piece is None or id(unit) in self._valid:
                continue
            piece.copy_(unit.flat_param[self.index * piece.numel() : (self.index + 1) * piece.numel()])
            self._valid.add(id(unit))

    def holds(self, units: Sequence[FlatUnit]) -> bool:
        return bool(units) and all(id(u) in self._valid for u in units)

    def source(self, unit: FlatUnit) -> torch.Tensor:
        return self._slices[id(unit)]

    def gather(self, unit: FlatUnit) -> collectives.Handle:
        """Launch the all-gather of ``unit``'s values from the node's slices (the unit is allocated)."""
        return self.all_gather(unit.flat_param, self._slices[id(unit)], async_op=True)

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> collectives.Handle:
        """A :class:`~lzero.engine.collectives.AllGather` of ``shard`` (slices of this partition) over ``group``, the
        node's (``self.group``) when None, counted in ``gathered_bytes``."""
        self.gathered_bytes += flat.numel() * flat.element_size()
        return collectives.all_gather(flat, shard, group if group is not None else self.group, async_op=async_op)

    def invalidate(self) -> None:
        self._valid.clear()
