"""Each rank's optimizer state as the optimizer holds it, computed from the partition (no tensors): what the memory
monitor expects and ``lzero estimate --optimizer`` prints, beside what accounting.py measures.

[Note: optimizer state by rank]
An elementwise optimizer's state is its bytes per element over the rank's shard of each unit (padding included), plus
a 0-dim fp32 ``step`` per shard for the Adam family. A per-tensor unit's ([Note: per-tensor ownership] in
lzero/engine/partition.py) is the state of each tensor the rank owns, in the optimizer's own format:

| optimizer | state of one tensor of n elements |
|---|---|
| Muon | ``momentum_buffer``: 4n |
| Adafactor, a matrix (..., r, c) | ``row_var`` (..., r, 1) and ``col_var`` (..., 1, c): 4 (n/c + n/r), ``step``: 4 |
| Adafactor, a vector | ``variance``: 4n, ``step``: 4 |
| Adam, AdamW, Adamax, NAdam, RAdam | ``exp_avg``, ``exp_avg_sq``: 8n, ``step``: 4 (RAdam, NAdam: the same) |
| SGD (momentum), RMSprop, Adagrad | 4n (RMSprop: 4n more with momentum, 4n with centered), ``step``: 4 (not SGD) |

Masters are fp32 (4 bytes); the formulas count fp32 state, as torch keeps it beside fp32 parameters. So the ranks'
state differs by the tensors each owns: the imbalance is the largest rank's bytes over the mean.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

from lzero.engine.partition import UnitSpec

ADAM_FAMILY = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")

StateBytes = Callable[[tuple[int, ...]], int]
"""The state bytes of one whole tensor of a shape."""


def state_bytes_of(name: str, defaults: Optional[dict[str, Any]] = None) -> Optional[StateBytes]:
    """The state formula of optimizer class ``name`` with hyperparameters ``defaults`` (see the Note); None: unknown."""
    d = defaults or {}
    if name == "Muon":
        return lambda shape: 4 * math.prod(shape)
    if name == "Adafactor":
        def factored(shape: tuple[int, ...]) -> int:
            n = math.prod(shape)
            if len(shape) < 2:
                return 4 * n + 4
            return 4 * (n // shape[-1] + n // shape[-2]) + 4
        return factored
    rates = shard_rates(name, d)
    if rates is None:
        return None
    return lambda shape: rates[0] * math.prod(shape) + rates[1]


def shard_rates(name: str, defaults: dict[str, Any]) -> Optional[tuple[int, int]]:
    """An elementwise optimizer's (bytes per element, bytes of its 0-dim ``step`` per tensor it steps); None:
    unknown."""
    per_element = elementwise_bytes(name, defaults)
    if per_element is None:
        return None
    return per_element, 4 if name in ADAM_FAMILY or name in ("Adagrad", "RMSprop") else 0


def elementwise_bytes(name: str, defaults: dict[str, Any]) -> Optional[int]:
    """Bytes of state per element of an elementwise optimizer (its ``step`` aside); None: unknown."""
    if name in ADAM_FAMILY:
        return 8 + (4 if defaults.get("amsgrad") else 0)
    if name == "SGD":
        return 4 if defaults.get("momentum", 0) else 0
    if name == "Adagrad":
        return 4
    if name == "RMSprop":
        return 4 + (4 if defaults.get("momentum", 0) else 0) + (4 if defaults.get("centered") else 0)
    return None


def rank_state_bytes(units: Sequence[UnitSpec], world_size: int,
                     formulas: dict[tuple[int, int], Optional[StateBytes]],
                     per_element: dict[tuple[int, int], Optional[tuple[int, int]]]) -> Optional[list[int]]:
    """Each rank's optimizer state bytes over ``units``: per-tensor units by ``formulas[group]`` over the tensors a rank
    owns, elementwise ones by ``per_element[group]`` = (bytes per element, bytes of the 0-dim state per shard) over its
    shard. None where a group's optimizer is unknown."""
    ranks = [0] * world_size
    for unit in units:
        if unit.frozen:
            continue
        if unit.per_tensor:
            formula = formulas.get(unit.group)
            if formula is None:
                return None
            for spec, owner in zip(unit.params, unit.owners):
                ranks[owner] += formula(spec.shape)
        else:
            rates = per_element.get(unit.group)
            if rates is None:
                return None
            for r in range(world_size):
                ranks[r] += rates[0] * unit.shard_numel + rates[1]
    return ranks


def imbalance(per_rank: Sequence[int]) -> float:
    """The largest rank's bytes over the mean (1.0: even)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


def engine_state_bytes(engine: Any, optimizers: Sequence[Any]) -> Optional[list[int]]:
    """Each rank of ``engine``'s group: the optimizer state ``optimizers`` (ZeroOptimizers) hold by the formulas of the
    Note, over the engine's partition; None where an optimizer is unknown."""
    formulas: dict[tuple[int, int], Optional[StateBytes]] = {}
    per_element: dict[tuple[int, int], Optional[tuple[int, int]]] = {}
    for zopt in optimizers:
        name = type(zopt.optimizer).__name__
        for g, hyper in enumerate(zopt.param_groups):
            formulas[(zopt.index, g)] = state_bytes_of(name, hyper)
            per_element[(zopt.index, g)] = shard_rates(name, hyper)
    return rank_state_bytes([u.spec for z in optimizers for u in z.units], engine.world_size, formulas, per_element)


def padding_bytes(config: Any, units: Sequence[UnitSpec], world_size: int, compute_bytes: int,
                  mixed: bool) -> dict[tuple[str, str], float]:
    """What per-tensor units hold beyond the formula of lzero/memory/estimate.py (which counts Ψ and Ψ/N, no padding),
    by (store, kind): each rank's shard S against the unit's Ψ/N, and at stages 1-2 the full buffer N * S against Ψ;
    the terms placed as ``model_states`` places them (gradients aside)."""
    owned = [u for u in units if u.per_tensor]
    shard = sum(u.shard_numel - u.numel / world_size for u in owned)
    opt = config.offload_optimizer
    offloaded = opt.ratio if opt.device != "none" else 0.0
    param_store = {"none": "device", "cpu": "cpu", "nvme": "nvme"}[config.offload_param.device]
    out: dict[tuple[str, str], float] = {}

    def add(store: str, kind: str, nbytes: float) -> None:
        if nbytes:
            out[(store, kind)] = out.get((store, kind), 0.0) + nbytes

    if config.stage < 3:
        add("device", "parameters", compute_bytes * sum(u.padded_numel - u.numel for u in owned))
    for share, store in ((1.0 - offloaded, "device"), (offloaded, "nvme" if opt.device == "nvme" else "cpu")):
        elements = share * shard
        if config.stage < 3:
            add(store, "masters", 4 * elements if mixed or store != "device" else 0)
        elif not mixed and store == param_store:
            add(store, "parameters", 4 * elements)  # the parameter shard is the master
        else:
            add(param_store, "parameters", compute_bytes * elements)
            add(store, "masters", 4 * elements)
    return out


def optimizer_store_shares(config: Any) -> list[tuple[float, str]]:
    """Where a rank's optimizer state lives: (share, store) as ``model_states`` splits it by ``offload_optimizer``."""
    opt = config.offload_optimizer
    offloaded = opt.ratio if opt.device != "none" else 0.0
    return [(share, store) for share, store in ((1.0 - offloaded, "device"), (offloaded, opt.device if opt.device
                                                                                     != "none" else "cpu")) if share]
