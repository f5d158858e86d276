"""Which optimizers step whole tensors, and so which param groups are laid out by owner.

See [Note: per-tensor ownership] in partition.py for the layout. An optimizer that reads a whole matrix (Newton-Schulz
orthogonalization, factored second moments, Kronecker preconditioners) cannot step a slice that cuts tensors; it steps
each of a rank's owned parameters whole. Known ones are recognised by class; ``optimizer_partition="per_tensor"``
names any other (and lays out elementwise optimizers by owner too, which is exact for them as well).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lzero.engine.partition import GroupKey

WHOLE_TENSOR_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in ("Muon", "Adafactor")
                                if hasattr(torch.optim, name))
"""torch's optimizers whose update of a parameter reads the whole parameter: Muon (Newton-Schulz on each 2-D
gradient), Adafactor (row and column statistics of each matrix)."""


def steps_whole_tensors(optimizer: torch.optim.Optimizer, partition: str) -> bool:
    """Whether ``optimizer``'s groups are laid out by owner under ``optimizer_partition=partition``."""
    return partition == "per_tensor" or isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS)


def per_tensor_groups(optimizers: Sequence[torch.optim.Optimizer], partition: str) -> frozenset[GroupKey]:
    """The (optimizer, param group) keys laid out by owner."""
    return frozenset((k, g) for k, optimizer in enumerate(optimizers) if steps_whole_tensors(optimizer, partition)
                     for g in range(len(optimizer.param_groups)))


def state_tensors(zopt: Any, unit: Any) -> list[Tensor]:
    """Every tensor of this rank's optimizer state for ``unit`` (``zopt`` a ZeroOptimizer): its shard's, or for a
    per-tensor unit its owned tensors'."""
    inner = zopt.shard_optimizer(unit)
    if unit.spec.per_tensor:
        states = [inner.state.get(t.param, {}) for t in zopt.owned_tensors(unit)]
    else:
        states = [inner.state.get(unit.master_shard, {})]
    # one C-level copy of the values: the delayed update's first step may be adding state on its thread
    return [v for state in states for v in list(state.values()) if isinstance(v, Tensor)]
