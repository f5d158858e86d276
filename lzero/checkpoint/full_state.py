"""Optimizer state in torch's full per-parameter format (what DDP checkpoints hold).

Gathering walks one unit at a time, so the transient memory is one unit's state; only the
destination keeps the result. Loading slices each saved per-parameter tensor to the piece this
rank owns, so the same state dict loads at any world size.

A state entry whose tensor has the shard's shape is per element (``exp_avg``...); a 0-dim
entry (``step``) is per unit and is copied to every parameter of the unit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from lzero.engine import collectives
from lzero.checkpoint.rank_state import ShardedOptimizer, fill_shard, pack_param_groups, restore_param_groups
from lzero.errors import ZeroError

if TYPE_CHECKING:
    from lzero.engine.flat_unit import FlatUnit
    from lzero.engine.partition import ParamSpec


class OptimizerStateError(ZeroError, ValueError):
    """A state dict that does not fit this optimizer; the message names the mismatch."""


def _param_indices(zopt: ShardedOptimizer) -> dict[int, int]:
    """id(param) -> index, in the order torch's ``Optimizer.state_dict`` numbers parameters."""
    order = [p for group in zopt.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(order)}


@torch.no_grad()
def gather_optimizer_state(zopt: ShardedOptimizer, to_all: bool = False) -> dict[str, Any]:
    """Full state dict on rank 0 (or on every rank with ``to_all``). A collective."""
    engine = zopt.engine
    keep = to_all or engine.rank == 0
    index = _param_indices(zopt)
    state: dict[int, dict[str, Any]] = {}
    for unit in zopt.units:
        with unit.resident():
            _gather_unit_state(zopt, unit, index, keep, state)
    if not keep:
        return {}
    return {"state": state, "param_groups": pack_param_groups(zopt, lambda p: index[id(p)])}


def _gather_unit_state(zopt: ShardedOptimizer, unit: "FlatUnit", index: dict[int, int], keep: bool,
                       state: dict[int, dict[str, Any]]) -> None:
    """One unit's full per-parameter state into ``state`` (when ``keep``), the unit resident. A collective."""
    shard_state = zopt.shard_optimizer(unit).state.get(unit.master_shard)
    if not shard_state:
        return
    for key in sorted(shard_state):
        value = shard_state[key]
        if isinstance(value, Tensor) and value.shape == unit.master_shard.shape:
            device = unit.flat_param.device  # where collectives run (offloaded state lives in host memory)
            full = torch.empty(unit.spec.padded_numel, dtype=value.dtype, device=device)
            collectives.all_gather(full, value.to(device).contiguous(), zopt.engine.group)
            pieces = {s.name: full[a:b] for s, a, b in unit.spec.param_ranges()}
        else:
            pieces = {s.name: value for s, _, _ in unit.spec.param_ranges()}
        if not keep:
            continue
        for p, spec in zip(unit.params, unit.spec.params):
            v = pieces[spec.name]
            if isinstance(v, Tensor):
                v = v.view(p.shape).clone() if v.dim() else v.clone()
            state.setdefault(index[id(p)], {})[key] = v


@torch.no_grad()
def load_optimizer_state(zopt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a full per-parameter state dict into this rank's shards (no communication)."""
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise OptimizerStateError(
            "The optimizer state has no 'state'/'param_groups'. HINT: pass a torch optimizer state_dict"
            " (as saved by Lightning under 'optimizer_states')."
        )
    _check_groups(zopt, saved_groups)
    restore_param_groups(zopt, saved_groups)
    index = _param_indices(zopt)
    for unit in zopt.units:
        with unit.resident(write=True):
            _load_unit_state(zopt, unit, [saved_state.get(index[id(p)]) for p in unit.params])


def _load_unit_state(zopt: ShardedOptimizer, unit: "FlatUnit", per_param: list[Optional[dict[str, Any]]]) -> None:
    """One unit's shard of a full per-parameter state (the unit resident)."""
    inner = zopt.shard_optimizer(unit)
    template = next((s for s in per_param if s), None)
    if template is None:
        inner.state.pop(unit.master_shard, None)
        return
    shard_state: dict[str, Any] = {}
    for key, value in template.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            shard_state[key] = _slice_into_shard(unit, per_param, key, value.dtype)
        else:
            shard_state[key] = value.clone() if isinstance(value, Tensor) else value
    inner.state[unit.master_shard] = shard_state


def _slice_into_shard(unit: "FlatUnit", per_param: list[Optional[dict[str, Any]]], key: str,
                      dtype: torch.dtype) -> Tensor:
    by_name = dict(zip((s.name for s in unit.spec.params), per_param))

    def fetch(spec: "ParamSpec", a: int, b: int) -> Tensor:
        entry = by_name[spec.name]
        if not entry or key not in entry:
            raise OptimizerStateError(
                f"Optimizer state for `{spec.name}` lacks '{key}' while other parameters of its unit have it."
                " HINT: the checkpoint was written by a different optimizer setup."
            )
        value = entry[key]
        if value.numel() != math.prod(spec.whole_shape):
            raise OptimizerStateError(
                f"Optimizer state '{key}' of `{spec.name}` has {value.numel()} elements, the parameter has"
                f" {math.prod(spec.whole_shape)}. HINT: the checkpoint belongs to a different model."
            )
        return value.reshape(-1)[a:b]

    return fill_shard(torch.zeros(unit.spec.shard_numel, dtype=dtype, device=unit.master_shard.device), unit, fetch)


def _check_groups(zopt: ShardedOptimizer, saved_groups: list) -> None:
    if len(saved_groups) != len(zopt.param_groups):
        raise OptimizerStateError(
            f"The saved optimizer state has {len(saved_groups)} param groups, the optimizer has"
            f" {len(zopt.param_groups)}. HINT: `configure_optimizers` must build the same groups as when saved."
        )
    for i, (saved, group) in enumerate(zip(saved_groups, zopt.param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise OptimizerStateError(
                f"Param group {i}: saved with {len(saved['params'])} parameters, now {len(group['params'])}."
                " HINT: `configure_optimizers` must build the same groups as when saved."
            )
