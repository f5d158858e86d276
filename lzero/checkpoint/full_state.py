"""Optimizer state in torch's full per-parameter format (what DDP checkpoints hold).

Gathering walks one unit at a time, so the transient memory is one unit's state; only the
destination keeps the result. Loading slices each saved per-parameter tensor to the piece this
rank owns, so the same state dict loads at any world size.

A state entry whose tensor has the shard's shape is per element (``exp_avg``...); a 0-dim
entry (``step``) is per unit and is copied to every parameter of the unit. A per-tensor unit ([Note: per-tensor
ownership] in lzero/engine/partition.py) holds each owned parameter's state whole, in the optimizer's own format
(Adafactor's factored rows and columns included): gathered from its owner, loaded by its owner.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lzero.engine import collectives
from lzero.checkpoint.rank_state import (ShardedOptimizer, fill_shard, pack_param_groups, restore_param_groups,
                                         tensor_state_value)
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
            if unit.spec.per_tensor:
                _gather_owned_state(zopt, unit, index, to_all, state)
            else:
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


def _gather_owned_state(zopt: ShardedOptimizer, unit: "FlatUnit", index: dict[int, int], to_all: bool,
                        state: dict[int, dict[str, Any]]) -> None:
    """A per-tensor unit's state, each owner's tensors whole, into ``state`` on rank 0 (every rank with ``to_all``).
    A collective: one object gather of the owners' states (host copies)."""
    inner = zopt.shard_optimizer(unit)
    mine = {t.spec.name: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in inner.state[t.param].items()}
            for t in zopt.owned_tensors(unit) if inner.state.get(t.param)}
    group = zopt.engine.group
    world = collectives.world_size(group)
    if world == 1:
        found = [mine]
    elif to_all:
        found = [None] * world
        dist.all_gather_object(found, mine, group=group)
    else:
        found = [None] * world if zopt.engine.rank == 0 else None
        dist.gather_object(mine, found, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if not (to_all or zopt.engine.rank == 0):
        return
    by_name = {name: entry for part in found for name, entry in part.items()}
    device = unit.master_shard.device
    for p, spec in zip(unit.params, unit.spec.params):
        if spec.name in by_name:
            entry = by_name[spec.name]
            state[index[id(p)]] = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in entry.items()}


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
            if unit.spec.per_tensor:
                _load_owned_state(zopt, unit, {s.name: saved_state.get(index[id(p)])
                                               for p, s in zip(unit.params, unit.spec.params)})
            else:
                _load_unit_state(zopt, unit, [saved_state.get(index[id(p)]) for p in unit.params])


def _load_owned_state(zopt: ShardedOptimizer, unit: "FlatUnit", saved: dict[str, Optional[dict[str, Any]]]) -> None:
    """A per-tensor unit's owned tensors take their whole saved state (no communication)."""
    inner = zopt.shard_optimizer(unit)
    for t in zopt.owned_tensors(unit):
        entry = saved[t.spec.name]
        if not entry:
            inner.state.pop(t.param, None)
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() and value.numel() == t.spec.numel and \
                    value.shape != t.param.shape:
                raise OptimizerStateError(
                    f"Optimizer state '{key}' of `{t.spec.name}` has shape {tuple(value.shape)}, the parameter"
                    f" {tuple(t.param.shape)}. HINT: the checkpoint belongs to a different model.")
        inner.state[t.param] = {k: tensor_state_value(k, v, t.param) for k, v in entry.items()}


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
