"""Partition math: parameters -> units -> flat ranges -> the shard each rank owns.

Pure functions of (parameter names, shapes, param groups, world size, unit policy); no tensors, no
communication. The result is exported as JSON-able metadata keyed by parameter name, so a
checkpoint written at one world size or stage can be re-sliced for another.

[Note: unit layout]
A unit is a flat 1-D buffer holding its parameters back to back, padded at the end to a multiple
of the world size N. Rank r owns the contiguous slice [r * S, (r + 1) * S) with S = padded / N.
A unit never mixes param groups (its shard is one tensor in exactly one optimizer param group) nor
compute dtypes (mixed precision may keep some module types in fp32), nor numbers with packed codes
(quantized weights, one storage dtype per unit: see [Note: packed parameters] in packed_weights.py).
At stages 1 and 2 units are formed in backward order (reverse registration order) up to
``max_unit_numel`` elements, so the first units to complete in backward are the first reduced.

[Note: per-tensor ownership]
An optimizer that reads a whole matrix (Muon's Newton-Schulz, Adafactor's row and column statistics) cannot step
a slice that cuts tensors. A param group stepped by one gets units laid out by owner instead: each parameter is
owned by one rank, and rank r's shard ``[r * S, (r + 1) * S)`` holds its owned parameters whole, back to back,
then padding; S is the largest rank's total, so every shard has one size and the reduce-scatters, all-gathers and
stores work unchanged, the owner receiving each of its tensors' whole averaged gradient and stepping it, the
all-gather (stages 1-2) or the shard (stage 3) carrying the values to the others. Owners are chosen per unit,
largest tensor first, to the rank with the least of the unit so far (which keeps S, and so the padding, small),
ties to the rank with the least of all units so far (which balances the optimizer's state across the model),
then the lowest rank: a pure function of the names and shapes, so every rank computes the same owners.
The padding is the price: N * S - (the unit's elements) per unit, in the full buffer and every collective. At stages
1-2 a per-tensor unit may therefore grow to N times the group's largest tensor (a tensor per rank, so S stays near a
1/N share); at stage 3 the units are the blocks, so each rank holds at least the block's largest tensor: a Llama
block of 7 matrices holds 1.06-1.08x the even share's elements at N = 2, 1.08-1.22x at N = 4, 1.8-2.2x at N = 8
(Llama-2-7B and Llama-3-8B shapes), and from N = 7 on some ranks own none of a block.
``UnitSpec.owners`` holds each parameter's owner; empty for an elementwise unit, laid out as [Note: unit layout]
says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from lzero.engine.tensor_layout import TensorLayout

GroupKey = tuple[int, int]
"""(optimizer index, param group index) of a parameter."""

FROZEN: GroupKey = (-1, -1)
"""The group of a parameter that does not train (stage 3 shards it too): no optimizer steps it."""


@dataclass(frozen=True)
class ParamSpec:
    """What the partition needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    group: GroupKey
    keep_fp32: bool = False  # mixed precision: computes in fp32 (a module type kept out of 16-bit)
    storage: str = ""  # a packed (quantized) frozen weight: its storage dtype, e.g. "uint8" (see packed_weights.py)
    # tensor parallel: a tensor-sharded parameter's whole layout and this rank's tensor coordinate; ``shape`` is then
    # its local tensor's (see [Note: tensor-parallel checkpoints] in tensor_layout.py)
    whole: Optional[TensorLayout] = None
    tensor_rank: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The parameter's shape: its whole tensor's under tensor parallel."""
        return self.whole.shape if self.whole is not None else self.shape

    def whole_runs(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """Elements ``[start, end)`` of the flattened (local) parameter as contiguous runs (start, end, where the run
        starts in the flattened whole parameter): one run, unless tensor parallel cut the parameter on a dimension
        after the first."""
        if self.whole is None:
            yield start, end, start
        else:
            yield from self.whole.runs(self.tensor_rank, start, end)

    @property
    def frozen(self) -> bool:
        return self.group == FROZEN

    @property
    def kind(self) -> tuple[GroupKey, bool, str]:
        """What a unit never mixes: param group, compute dtype, and packed storage."""
        return self.group, self.keep_fp32, self.storage


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its parameters, where each starts in the flat buffer, and the padding."""

    index: int
    group: GroupKey
    params: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]  # start of each param in the flat buffer
    numel: int  # sum of the params' numel
    world_size: int
    # per-tensor ownership ([Note: per-tensor ownership]): each param's owning rank, and the shard size S
    owners: tuple[int, ...] = ()
    chunk: int = 0

    @property
    def keep_fp32(self) -> bool:
        return self.params[0].keep_fp32

    @property
    def storage(self) -> str:
        """Packed (quantized) codes in this storage dtype, moved raw and never cast; "" for numbers."""
        return self.params[0].storage

    @property
    def per_tensor(self) -> bool:
        """Laid out by owner: every parameter whole in one rank's shard ([Note: per-tensor ownership])."""
        return bool(self.owners)

    @property
    def padded_numel(self) -> int:
        if self.owners:
            return self.chunk * self.world_size
        return math.ceil(self.numel / self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def frozen(self) -> bool:
        """A unit of parameters that do not train: no master, gradient or optimizer state."""
        return self.group == FROZEN

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def padding(self, rank: int) -> Iterator[tuple[int, int]]:
        """[start, end) of rank's shard holding no parameter's elements (zero in values and gradients): both layouts
        pack a rank's elements from the start of its shard, so the padding is at most one run, at its end."""
        used = sum(b - a for _, a, b, _ in self.owned_pieces(rank))
        if used < self.shard_numel:
            yield used, self.shard_numel

    def owned_params(self, rank: int) -> Iterator[tuple[ParamSpec, int]]:
        """Per-tensor units: each parameter ``rank`` owns, and where it starts in the rank's shard."""
        lo = rank * self.chunk
        for spec, offset, owner in zip(self.params, self.offsets, self.owners):
            if owner == rank:
                yield spec, offset - lo

    def param_ranges(self) -> Iterator[tuple[ParamSpec, int, int]]:
        """(param, flat start, flat end) for every param of the unit."""
        for spec, offset in zip(self.params, self.offsets):
            yield spec, offset, offset + spec.numel

    def owned_pieces(self, rank: int) -> Iterator[tuple[ParamSpec, int, int, int]]:
        """(param, start within param, end within param, start within shard) for the parts of
        params that fall in rank's shard."""
        lo, hi = self.shard_range(rank)
        for spec, start, end in self.param_ranges():
            a, b = max(start, lo), min(end, hi)
            if a < b:
                yield spec, a - start, b - start, a - lo

    def owned_runs(self, rank: int) -> Iterator[tuple[ParamSpec, int, int, int]]:
        """:meth:`owned_pieces` with each piece's range in the whole flattened parameter: under tensor parallel a
        piece of a local tensor cut on a later dimension is several runs ([Note: tensor-parallel checkpoints] in
        tensor_layout.py); otherwise the same pieces."""
        for spec, a, b, s in self.owned_pieces(rank):
            for lo, hi, whole in spec.whole_runs(a, b):
                yield spec, whole, whole + hi - lo, s + lo - a


@dataclass(frozen=True)
class Partition:
    """All units of a model at one world size."""

    units: tuple[UnitSpec, ...]
    world_size: int

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padding_numel(self) -> int:
        return sum(u.padded_numel - u.numel for u in self.units)

    def metadata(self) -> dict[str, Any]:
        """JSON-able description, keyed by parameter name, of where every element lives."""
        params: dict[str, Any] = {}
        for unit in self.units:
            for spec, start, end in unit.param_ranges():
                ranks = {}
                for rank in range(self.world_size):
                    lo, hi = unit.shard_range(rank)
                    a, b = max(start, lo), min(end, hi)
                    if a < b:
                        ranks[rank] = [a - start, b - start]
                params[spec.name] = {
                    "unit": unit.index,
                    "frozen": spec.frozen,
                    "group": list(spec.group),
                    "offset": start,
                    "numel": spec.numel,
                    "shape": list(spec.shape),
                    "ranks": ranks,
                }
        units = [
            {
                "index": u.index,
                "group": list(u.group),
                "numel": u.numel,
                "padded_numel": u.padded_numel,
                "shard_numel": u.shard_numel,
                "params": [p.name for p in u.params],
                **({"owners": list(u.owners)} if u.owners else {}),
            }
            for u in self.units
        ]
        return {"world_size": self.world_size, "units": units, "params": params}


def partition_by_size(params: Sequence[ParamSpec], world_size: int, max_unit_numel: int,
                      per_tensor: frozenset[GroupKey] = frozenset(),
                      per_tensor_numel: Optional[int] = None) -> Partition:
    """Pack ``params`` (given in registration order) into units of at most ``max_unit_numel``
    elements, in backward order, never mixing param groups or compute dtypes. See [Note: unit layout]; the groups
    in ``per_tensor`` are laid out by owner ([Note: per-tensor ownership]), in units of at most ``per_tensor_numel``
    elements (by default ``max_unit_numel``, or ``world_size`` times the largest of their parameters if that is more,
    so that a unit has a tensor for every rank and little padding)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_unit_numel < 1:
        raise ValueError(f"max_unit_numel must be >= 1, got {max_unit_numel}")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique (pass each shared parameter once)")
    if per_tensor_numel is None:
        largest = max((p.numel for p in params if p.group in per_tensor), default=0)
        per_tensor_numel = max(max_unit_numel, world_size * largest)
    open_units: dict[tuple[GroupKey, bool], list[ParamSpec]] = {}
    closed: list[list[ParamSpec]] = []
    for spec in reversed(params):
        current = open_units.setdefault(spec.kind, [])
        limit = per_tensor_numel if spec.group in per_tensor else max_unit_numel
        if current and sum(p.numel for p in current) + spec.numel > limit:
            closed.append(current)
            current = open_units[spec.kind] = []
        current.append(spec)
    closed.extend(u for u in open_units.values() if u)
    # order units by when their first parameter appears in backward order, so that every rank
    # agrees on one order and it follows backward as closely as the grouping allows
    position = {p.name: i for i, p in enumerate(reversed(params))}
    closed.sort(key=lambda members: position[members[0].name])
    return _partition(closed, world_size, per_tensor)


def partition_by_label(params: Sequence[ParamSpec], world_size: int, labels: dict[str, str],
                       per_param: bool = False, per_tensor: frozenset[GroupKey] = frozenset()) -> Partition:
    """Stage 3: one unit per (label, param group, compute dtype), where a label names the module block a parameter
    belongs to ("" for the root); with ``per_param`` one unit per parameter. Block units are ordered as they
    complete in backward (reverse registration order); root units come last, since the root typically holds
    the input embedding (often tied to the output head), whose gradient completes last. See [Note: unit layout]."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    members: dict[tuple[str, Any], list[ParamSpec]] = {}
    for spec in reversed(params):
        kind = (spec.kind, spec.name) if per_param else spec.kind
        members.setdefault((labels[spec.name], kind), []).append(spec)
    keys = [k for k in members if k[0] != ""] + [k for k in members if k[0] == ""]
    ordered = [list(reversed(members[k])) for k in keys]  # registration order inside a unit
    return _partition(ordered, world_size, per_tensor)


def _partition(units: list[list[ParamSpec]], world_size: int, per_tensor: frozenset[GroupKey]) -> Partition:
    loads = [0] * world_size  # each rank's owned elements so far, over every per-tensor unit
    return Partition(tuple(_owned_unit(i, m, world_size, loads) if m[0].group in per_tensor
                           else _make_unit(i, m, world_size) for i, m in enumerate(units)), world_size)


def _make_unit(index: int, members: list[ParamSpec], world_size: int) -> UnitSpec:
    offsets, total = [], 0
    for spec in members:
        offsets.append(total)
        total += spec.numel
    return UnitSpec(index, members[0].group, tuple(members), tuple(offsets), total, world_size)


def _owned_unit(index: int, members: list[ParamSpec], world_size: int, loads: list[int]) -> UnitSpec:
    """A unit laid out by owner, ``loads`` updated with its owners' elements: see [Note: per-tensor ownership]."""
    here = [0] * world_size
    owners = [0] * len(members)
    for i in sorted(range(len(members)), key=lambda i: (-members[i].numel, i)):
        rank = min(range(world_size), key=lambda r: (here[r], loads[r], r))
        owners[i] = rank
        here[rank] += members[i].numel
        loads[rank] += members[i].numel
    chunk = max(here)
    filled = [r * chunk for r in range(world_size)]
    offsets = []
    for spec, rank in zip(members, owners):
        offsets.append(filled[rank])
        filled[rank] += spec.numel
    return UnitSpec(index, members[0].group, tuple(members), tuple(offsets), sum(here), world_size,
                    owners=tuple(owners), chunk=chunk)
