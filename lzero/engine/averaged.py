"""The averaged weights of a weight-averaging run (EMA, SWA), as sharded as the masters.

[Note: averaged shards]
Lightning's ``WeightAveraging`` (``EMAWeightAveraging``) and ``StochasticWeightAveraging`` keep a whole copy of the
model and average every parameter into it between steps. Under ZeRO the whole parameters exist only briefly (stage 3)
or only as the compute copy of the masters, so lzero keeps the average as it keeps the masters: one tensor per unit,
the size of the unit's shard, in the masters' dtype (fp32 under mixed precision), where the masters live (the device,
or host memory when the optimizer is offloaded; with NVMe offload, host memory), or on the callback's ``device`` when
it names one. Each rank averages the shard it owns; the average is elementwise, so the shards hold the elements DDP's
whole copy holds, bit for bit (one shard or one parameter at a time round the same way).

When the callback swaps the average into the model (validation, the end of fit), the masters and the averages trade
values and the compute parameters are refreshed from the masters, as after a checkpoint load
(``ZeroEngine.republish``). The optimizer state stays with the current masters, as under DDP. Frozen parameters and
units (no optimizer) are not averaged: their average is their value (DDP's whole copy re-averages them, which under
EMA may round them by an ulp). Buffers (BatchNorm statistics) are whole on every rank and stay with the Lightning
side (lzero/lightning/trainer_averaging.py), which also keeps the callback's control flow. With the offloaded
optimizer's delayed update, an update (or a swap) first finishes the step in flight, as DDP's average reads the
stepped weights: the host step then overlaps nothing on those steps. With NVMe offload a swap, a copy and SWA's
update read one unit's master at a time; a ``WeightAveraging`` update reads every unit's at once (torch's averaging
walks them in one call).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
from torch import Tensor

from lzero.engine import collectives

if TYPE_CHECKING:
    from lzero.engine.engine import ZeroEngine
    from lzero.engine.flat_unit import FlatUnit
    from lzero.engine.partition import ParamSpec


class AveragedShards:
    """One averaged shard per trainable unit of ``engine`` (see [Note: averaged shards]), starting from the masters'
    values, as Lightning's copy of the model starts from the model. ``device``: where to keep them (None: where each
    unit's master lives; host memory for masters kept in files)."""

    def __init__(self, engine: "ZeroEngine", device: Optional[torch.device] = None) -> None:
        self.engine = engine
        self.units: list["FlatUnit"] = [u for u in engine.units if not u.spec.frozen]
        self.shards: dict[int, Tensor] = {}  # unit index -> 1D, shard_numel, the master's dtype
        self.memory: dict[int, str] = {}  # unit index -> the memory accounting's label: "device" or "cpu"
        engine.flush_delayed_update()
        for unit in self.units:
            with unit.resident():
                master = unit.master_shard.detach()
                where = device if device is not None else master.device if unit.store.in_memory else torch.device("cpu")
                self.shards[unit.spec.index] = master.to(where, copy=True)
            if torch.device(where) == master.device and unit.store.in_memory:
                self.memory[unit.spec.index] = unit.store.memory
            else:
                self.memory[unit.spec.index] = "cpu" if torch.device(where).type == "cpu" else "device"

    def shard(self, unit: "FlatUnit") -> Tensor:
        """``unit``'s averaged shard (1D, shard_numel)."""
        return self.shards[unit.spec.index]

    @contextlib.contextmanager
    def masters(self) -> Iterator[list[tuple[Tensor, Tensor]]]:
        """(averaged shard, master) of every unit inside the block, the masters resident to be read (an update reads
        them all at once). The delayed update's step in flight is finished first."""
        self.engine.flush_delayed_update()
        with self.engine.resident(self.units):
            yield [(self.shard(u), u.master_shard.detach()) for u in self.units]

    def one_by_one(self, write: bool) -> Iterator[tuple[Tensor, Tensor]]:
        """(averaged shard, master) of one unit at a time, its master resident (``write``: written, then republished;
        the parameters are refreshed after the last: a collective at stages 1-2)."""
        self.engine.flush_delayed_update()
        for unit in self.units:
            with unit.resident(write=write):
                yield self.shard(unit), unit.master_shard.detach()
                if write:
                    self.engine.republish(unit)
        if write:
            self.engine.refresh_params()

    @torch.no_grad()
    def swap(self) -> None:
        """Masters and averages trade values; the parameters then compute with the average. A collective."""
        for average, master in self.one_by_one(write=True):
            held = master.clone()
            master.copy_(average)
            average.copy_(held)

    @torch.no_grad()
    def copy_to_masters(self) -> None:
        """The masters (and so the parameters) take the averaged values. A collective."""
        for average, master in self.one_by_one(write=True):
            master.copy_(average)

    @torch.no_grad()
    def copy_from_masters(self) -> None:
        """The averages take the masters' values (the average restarts from the model)."""
        for average, master in self.one_by_one(write=False):
            average.copy_(master)

    @torch.no_grad()
    def fill(self, fetch: Callable[["ParamSpec", int, int], Optional[Tensor]]) -> None:
        """Every averaged shard from ``fetch(spec, a, b)`` (elements [a, b) of the flattened parameter; None keeps
        them), each rank reading only the pieces it owns (``UnitSpec.owned_runs``, as checkpoints read masters)."""
        for unit in self.units:
            shard = self.shard(unit)
            for spec, a, b, s in unit.spec.owned_runs(unit.rank):  # tensor parallel: ranges of the whole parameter
                value = fetch(spec, a, b)
                if value is not None:
                    shard[s : s + (b - a)].copy_(value)

    def pieces(self) -> Iterator[tuple["ParamSpec", int, int, Tensor]]:
        """(parameter, a, b, elements [a, b) of its average as a view of the shard) for every piece this rank owns."""
        for unit in self.units:
            shard = self.shard(unit)
            for spec, a, b, s in unit.spec.owned_pieces(unit.rank):
                yield spec, a, b, shard[s : s + (b - a)]

    @torch.no_grad()
    def gathered(self) -> Iterator[tuple["FlatUnit", Tensor]]:
        """(unit, its whole averaged flat buffer on the compute device), one unit at a time, on every rank. A
        collective (a full-format checkpoint's averaged state dict)."""
        for unit in self.units:
            device = unit.flat_param.device
            flat = torch.empty(unit.spec.padded_numel, dtype=self.shard(unit).dtype, device=device)
            collectives.all_gather(flat, self.shard(unit).to(device), self.engine.group)
            yield unit, flat

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(memory label, averaged shard) for the memory accounting."""
        for unit in self.units:
            yield self.memory[unit.spec.index], self.shard(unit)
