"""Where a unit's shard state lives: the fp32 master the optimizer steps, the reduced shard gradient
and (created by the optimizer next to its parameter) the optimizer state.

[Note: shard stores]
Every unit asks its store to hold its master, to land each reduced gradient shard, and to publish the
stepped master into the compute-dtype shard that all-gathers read. ``DeviceStore`` keeps all of it on
the device the model computes on. Offload adds stores (pinned host memory, NVMe files) that implement
the same three calls, so the engine, the reducer and the optimizer wrapper do not change with the
choice (``ZeroConfig.offload_optimizer``).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor


class ShardStore(Protocol):
    """See [Note: shard stores]."""

    name: str

    def hold_master(self, values: Tensor, alias_ok: bool) -> Tensor:
        """The tensor the optimizer steps, holding ``values`` (1-D). ``alias_ok``: ``values`` may be used
        as it is (full precision at stages 1-2, where the master is the owned slice of the parameters)."""
        ...

    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        """Add one reduced gradient shard into ``held`` (None before the first reduction since it was
        allocated); returns the tensor that now holds the sum, in ``dtype``."""
        ...

    def publish(self, master: Tensor, compute: Tensor) -> None:
        """Write the stepped master into the compute-dtype shard that the next all-gather reads."""
        ...


class DeviceStore:
    """Everything on the compute device: today's only store."""

    name = "none"

    def hold_master(self, values: Tensor, alias_ok: bool) -> Tensor:
        return values if alias_ok else values.clone()

    @torch.no_grad()
    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        if held is None:
            return reduced.to(dtype)
        held.add_(reduced)
        return held

    @torch.no_grad()
    def publish(self, master: Tensor, compute: Tensor) -> None:
        if compute.data_ptr() != master.data_ptr():
            compute.copy_(master)


def store_for(offload_optimizer: str) -> ShardStore:
    """The store ``ZeroConfig.offload_optimizer`` names (only "none" is built; the config refuses others)."""
    if offload_optimizer != "none":
        raise NotImplementedError(f"offload_optimizer={offload_optimizer!r} has no store yet.")
    return DeviceStore()
