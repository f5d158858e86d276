"""Stage-3 state dicts: the module's own keys and global shapes, values kept sharded until asked.

``sharded_state_dict`` returns, for every sharded parameter, a :class:`ShardedTensor` (this rank's
piece plus ``full_tensor()``), so a caller never needs the whole model on one rank;
``consolidate`` turns such a dict into plain tensors on rank 0, gathering one unit at a time.
Tied parameters appear under each of their keys, as the same object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lzero.engine import ZeroEngine
    from lzero.flat_unit import FlatUnit


class ShardedTensor:
    """One parameter of a stage-3 model as one rank holds it."""

    def __init__(self, engine: "ZeroEngine", unit: "FlatUnit", index: int) -> None:
        self.engine, self.unit, self.index = engine, unit, index
        self.spec = unit.spec.params[index]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.unit.master_shard.dtype

    def local_shard(self) -> tuple[int, Tensor]:
        """(start within the flattened parameter, this rank's elements of it); empty if it owns none."""
        for spec, a, b, s in self.unit.spec.owned_pieces(self.unit.rank):
            if spec.name == self.spec.name:
                return a, self.unit.master_shard.detach()[s : s + (b - a)]
        return 0, self.unit.master_shard.detach()[:0]

    def full_tensor(self) -> Tensor:
        """The whole parameter on every rank (a collective: call it on every rank)."""
        with self.engine.gathered_units([self.unit]):
            return self.unit.params[self.index].detach().clone()

    def __repr__(self) -> str:
        return f"ShardedTensor(name={self.spec.name!r}, shape={tuple(self.shape)}, rank={self.unit.rank})"


def sharded_state_dict(engine: "ZeroEngine", module: nn.Module) -> dict[str, Any]:
    where = {id(p): (u, i) for u in engine.units for i, p in enumerate(u.params)}
    made: dict[int, ShardedTensor] = {}
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in where:
            out[key] = made.setdefault(id(value), ShardedTensor(engine, *where[id(value)]))
        else:
            out[key] = value.detach()
    return out


@torch.no_grad()
def consolidate(engine: "ZeroEngine", state_dict: dict[str, Any]) -> dict[str, Any]:
    """Plain tensors on rank 0 (an empty dict elsewhere), one unit gathered at a time. A collective."""
    keep = engine.rank == 0
    units = []
    for value in state_dict.values():
        if isinstance(value, ShardedTensor) and all(value.unit is not u for u in units):
            units.append(value.unit)
    full: dict[int, Tensor] = {}
    for unit in units:
        with engine.gathered_units([unit]):
            if keep:
                full.update({id(p): p.detach().clone() for p in unit.params})
    if not keep:
        return {}
    return {k: full[id(v.unit.params[v.index])] if isinstance(v, ShardedTensor) else v for k, v in state_dict.items()}


def has_sharded(state_dict: dict[str, Any]) -> bool:
    return any(isinstance(v, ShardedTensor) for v in state_dict.values())
