"""Which ranks shard together: flat (every rank one shard group, the default) or hybrid.

[Note: hybrid sharding]
With ``shard_group_size=G`` the N ranks form N/G shard groups of G consecutive ranks (one node each, typically):
parameters, gradients and optimizer state are sharded within a group, as a flat run of world size G would shard
them, and replicated across the R = N/G groups. Within a group nothing changes: units padded to G, all-gathers and
reduce-scatters over the group's G ranks. A gradient is reduce-scattered within the group, then all-reduced across
the groups on the shard only (1/G of it), so the slow links between nodes carry a shard per step rather than the
whole model twice (MiCS, arXiv 2205.00119; FSDP2's HSDP). Every rank divides by N before summing, as DDP does, so
the sum of both reductions is DDP's average in another order: equal within rounding. What must agree across every
rank (the initial weights of an eager model, the seed of a block-wise initialization, the replay's RNG state)
is broadcast over the whole world; checkpoints are written by group 0 alone, in the flat format of world size G, so
they resume flat or hybrid at any world size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from lzero.config import ZeroConfigError


@dataclass(frozen=True)
class Layout:
    """This rank's place in a hybrid layout. See [Note: hybrid sharding]."""

    world: int  # N
    group_size: int  # G
    rank: int  # global

    @classmethod
    def of(cls, shard_group_size: Union[int, str]) -> Optional["Layout"]:
        """The layout of the current process group, or None when it is flat (one group of every rank)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        size = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if shard_group_size == "node" else int(shard_group_size)
        if world % size:
            raise ZeroConfigError(
                f"`shard_group_size={shard_group_size!r}` ({size} ranks per shard group) does not divide the world"
                f" size {world}. HINT: use a divisor of {world} (the ranks per node, typically), or drop it to shard"
                " over every rank.")
        if size == world:
            return None
        return cls(world, size, dist.get_rank())

    @property
    def replicas(self) -> int:
        """R = N / G."""
        return self.world // self.group_size

    @property
    def replica_index(self) -> int:
        """Which shard group this rank is in (0: the one that writes checkpoints)."""
        return self.rank // self.group_size

    def shard_groups(self) -> list[list[int]]:
        return [list(range(g * self.group_size, (g + 1) * self.group_size)) for g in range(self.replicas)]

    def replica_groups(self) -> list[list[int]]:
        return [list(range(r, self.world, self.group_size)) for r in range(self.group_size)]

    def new_shard_group(self, backend: Optional[str] = None, timeout_s: Optional[float] = None) -> Any:
        """This rank's shard group, made fresh (every rank makes every group: a collective)."""
        return self._mine(self.shard_groups(), backend, timeout_s)

    def new_replica_group(self) -> Any:
        """The group of the ranks holding the same shard as this one, one per shard group."""
        return self._mine(self.replica_groups(), None, None)

    def _mine(self, groups: list[list[int]], backend: Optional[str], timeout_s: Optional[float]) -> Any:
        kwargs: dict[str, Any] = {}
        if backend is not None:
            kwargs["backend"] = backend
        if timeout_s is not None:
            kwargs["timeout"] = timedelta(seconds=timeout_s)
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks, **kwargs)
            if self.rank in ranks:
                mine = group
        return mine
