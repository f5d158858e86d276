"""Gradient reductions: every unit's gradients reduce-scattered into its shard, in unit order.

[Note: reduction order]
Collectives on one process group are matched by the order in which ranks issue them, so every
rank must reduce units in the same order even when a rank's backward skips a parameter. Units
are reduced strictly in unit order: a unit whose gradients are all in is launched only after
every earlier unit was launched. At the end of backward, one tiny MAX all-reduce on a separate
process group tells every rank which units got a gradient on any rank; the rest of those are then
launched in unit order, with zeros for the gradients a rank lacks. A unit that got no gradient on
any rank is not reduced and its shard keeps ``grad = None``, so the optimizer skips it (as DDP
leaves ``grad = None`` for a globally unused parameter).

[Note: coalesced reductions]
A reduce-scatter costs a fixed latency whatever its size, so a model of many small units (zero3 blocks of a
narrow model) would pay it once per unit. Units that pack their gradients (stages 2-3) and hold at most a
quarter of ``reduce_bucket_size`` are therefore held once ready and reduced together: when the held units reach
``reduce_bucket_size`` elements, before a larger unit is launched, and at the end of backward. The bucket is
laid out rank by rank (every unit's rank-0 slice, then every unit's rank-1 slice, ...) so one reduce-scatter
hands each rank its slice of every unit. Grouping depends only on unit sizes and unit order, so every rank
forms the same buckets; held gradients stay alive until their bucket launches (at most
``reduce_bucket_size`` elements). In backward's hooks a rank launches one reduction at a time, each only when
there is room for it without waiting: a hook that flushed the held bucket and then launched a large unit could
block on that bucket's reduction while the peer, which had deferred it to the end of backward, waited for this
rank in the flag exchange (a deadlock seen on the wide GPT-2 benchmark; the hooks never block).

[Note: the sum across replicas overlaps]
Under hybrid sharding a reduction has two phases: the reduce-scatter within the shard group, then an all-reduce
of the resulting shard across the replicas (the slow inter-node link). The second phase is started asynchronously
as soon as the first is seen done (by a hook's check for room, or by landing a reduction), so the inter-node sum
of one bucket runs while backward computes and the next bucket reduces within the node, as FSDP's HSDP does.
Replica all-reduces start strictly oldest first: every rank of a replica group issues them in the same order.
A hook never waits for one: a blocking all-reduce across replicas in a hook could wait for a replica that is
itself waiting for this rank in the flag exchange. Quantized sums across replicas (qgZ: an all-to-all, then an
all-gather) run synchronously, so they run only where the reducer may block (end of backward, ``wait``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lzero.engine import collectives, quantized_collectives
from lzero.config import ZeroConfig
from lzero.engine.flat_unit import FlatUnit


@dataclasses.dataclass
class InflightReduction:
    """A launched reduce-scatter: what to wait on and where its result lands. Under hybrid sharding a second phase
    follows, the sum of ``out`` across the replicas (``across``): [Note: the sum across replicas overlaps]."""

    handle: collectives.Handle
    units: list[FlatUnit]
    out: Tensor  # 1D, the units' shard_numel in order: this rank's shards of the averaged gradients once done
    bucket: Tensor  # 1D, the units' padded_numel: the scaled gradients being reduced; kept alive until then
    across: Optional[collectives.Handle] = None  # hybrid: the replicas' all-reduce of ``out``, once started


class Reducer:
    """Launches and completes the reduce-scatters of one engine's units. See [Note: reduction order]."""

    def __init__(self, units: Sequence[FlatUnit], config: ZeroConfig, group: Optional[dist.ProcessGroup],
                 world_size: int, replicas: Optional[dist.ProcessGroup] = None, replica_count: int = 1,
                 flag_group: Optional[dist.ProcessGroup] = None) -> None:
        """``replicas``, ``replica_count``: hybrid sharding, the ranks holding this rank's shard in the other shard
        groups; the reduced shard is summed over them too (see [Note: hybrid sharding] in mesh.py). ``flag_group``:
        every rank (the mesh's ``flags``), for the tiny all-reduces of which units were used; None: one rank."""
        self.units = units
        self.config = config
        self.group = group
        self.world_size = world_size
        self.replicas, self.replica_count = replicas, replica_count
        # the tiny flag all-reduces: over every rank (a unit used on any rank of any group is reduced everywhere)
        self.flag_group = flag_group
        self.loss_scale = 1.0  # the fp16 loss scale of the current backward; divided out before summing
        self.next = 0  # index of the next unit to launch in this backward
        self._inflight: collections.deque[InflightReduction] = collections.deque()
        self._held: list[FlatUnit] = []  # ready small units waiting to be reduced together: [Note: coalesced reductions]
        self._held_numel = 0
        # qgZ's stochastic rounding: one generator per rank, on the device the gradients are on
        self._rounding: Optional[torch.Generator] = None
        if config.quantized_gradients is not None:
            device = units[0].flat_param.device if units else torch.device("cpu")
            self._rounding = torch.Generator(device).manual_seed(dist.get_rank() if dist.is_initialized() else 0)

    def begin_backward(self) -> None:
        self.next = 0

    def launch_ready_in_order(self) -> None:
        """Launch complete units in unit order, without ever blocking: a rank whose backward skips
        a parameter launches that unit only at the end of backward, and a peer blocked here
        waiting for it would never reach the flag exchange. See [Note: reduction order]."""
        self._start_sums_across()
        while self.next < len(self.units):
            unit = self.units[self.next]
            if unit.waiting_for_grads:
                return
            if unit.expected:
                # one launch at a time, each only with room for it: a second launch could block on a reduction
                # the peer has not launched yet (it may have deferred it to the end of backward), while the
                # peer waits for this rank in the flag exchange
                if self._held and not self._small(unit):  # the held bucket goes first, on its own
                    if not self._room_without_waiting():
                        return
                    self.flush()
                if self._launches(unit) and not self._room_without_waiting():
                    return
                self.launch(unit)
            self.next += 1

    def _small(self, unit: FlatUnit) -> bool:
        """Whether ``unit`` waits to be reduced with others: [Note: coalesced reductions]."""
        return not unit.accumulates_locally and 4 * unit.spec.padded_numel <= self.config.reduce_bucket_size \
            and self.world_size > 1

    def _launches(self, unit: FlatUnit) -> bool:
        """Whether :meth:`launch` of ``unit`` starts a reduction (a large unit, or a small one that fills the held
        bucket) rather than only holding it."""
        return not self._small(unit) or self._held_numel + unit.spec.padded_numel >= self.config.reduce_bucket_size

    def _room_without_waiting(self) -> bool:
        self._start_sums_across()
        while len(self._inflight) >= self.config.max_inflight_reductions:
            if not self._lands_without_waiting(self._inflight[0]):
                return False
            self._finish_oldest()
        return True

    def _lands_without_waiting(self, reduction: InflightReduction) -> bool:
        """Whether landing ``reduction`` would not block: its reduce-scatter done and, under hybrid sharding, its sum
        across the replicas too (qgZ's, synchronous, is never started here: it always waits)."""
        if not reduction.handle.is_completed():
            return False
        return self.replicas is None or (reduction.across is not None and reduction.across.is_completed())

    def _start_sums_across(self) -> None:
        """Hybrid sharding: start, oldest first, the replicas' sum of every reduction whose reduce-scatter is done;
        never blocks. See [Note: the sum across replicas overlaps]."""
        if self.replicas is None or self.config.quantized_gradients is not None:
            return
        for reduction in self._inflight:
            if reduction.across is None:
                if not reduction.handle.is_completed():
                    return  # later ones wait: every rank of a replica group starts them in the same order
                reduction.handle.wait()  # completed: lands this rank's sums in ``out``
                reduction.across = collectives.start_all_reduce(reduction.out, group=self.replicas)

    def reduce_remaining(self, units: Sequence[FlatUnit]) -> None:
        """Launch, in unit order, every unit that has a gradient on any rank. See [Note: reduction order]."""
        flags = torch.tensor(
            [1.0 if u.has_local_grads else 0.0 for u in units],
            device=units[0].flat_param.device if units else None,
        )
        if len(units):
            collectives.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.flag_group)
        for unit, flag in zip(units, flags.tolist()):
            if flag and not unit.launched:
                self.launch(unit)
        self.flush()
        self.wait()
        for unit in units:
            unit.end_round()

    def launch(self, unit: FlatUnit) -> None:
        """Reduce ``unit`` now, or hold it to reduce with the next small units: [Note: coalesced reductions]."""
        unit.mark_launched()
        # only small units wait for others: a unit of a quarter bucket or more keeps its reduction overlapping the
        # rest of backward, as before (stage 1-2 units are about a bucket each, wide zero3 blocks too)
        if not self._small(unit):
            self.flush()
            self._launch([unit])
            return
        fills = self._launches(unit)
        self._held.append(unit)
        self._held_numel += unit.spec.padded_numel
        if fills:
            self.flush()

    def flush(self) -> None:
        """Launch the held units' reduction (one reduce-scatter for all of them)."""
        if self._held:
            held, self._held, self._held_numel = self._held, [], 0
            self._launch(held)

    def _launch(self, units: list[FlatUnit]) -> None:
        while len(self._inflight) >= self.config.max_inflight_reductions:
            self._finish_oldest()
        # multiply before summing, exactly as DDP's reducer does (by every rank of every group); the loss scale is
        # divided out here too
        scale = 1.0 / (self.world_size * self.replica_count * self.loss_scale)
        if len(units) == 1 and units[0].accumulates_locally:
            unit = units[0]
            bucket = unit.local_grads().to(unit.reduce_dtype)  # the gradient buffer itself when dtypes agree
            bucket.mul_(scale)
        elif len(units) == 1:
            bucket = units[0].pack_grads(scale)
        else:  # rank by rank: every unit's slice of rank 0, then of rank 1, ..., each unit packed in place
            dtype = functools.reduce(torch.promote_types, (u.reduce_dtype for u in units))  # kept-fp32 units: fp32
            rows = torch.empty(self.world_size, sum(u.spec.shard_numel for u in units), dtype=dtype,
                               device=units[0].flat_param.device)
            column = 0
            for unit in units:
                unit.pack_grads(scale, out=rows[:, column : column + unit.spec.shard_numel])
                column += unit.spec.shard_numel
            bucket = rows.view(-1)
        out = torch.empty(sum(u.spec.shard_numel for u in units), dtype=bucket.dtype, device=bucket.device)
        # qgZ: [Note: quantized collectives] in quantized_collectives.py
        if self.config.quantized_gradients is not None:
            handle = quantized_collectives.reduce_scatter(out, bucket, self.group,
                                                         async_op=self.config.overlap_comm,
                                                         bits=self.config.quantized_gradients, generator=self._rounding)
        else:
            handle = collectives.reduce_scatter(out, bucket, self.group, async_op=self.config.overlap_comm)
        self._inflight.append(InflightReduction(handle, units, out, bucket))
        if not self.config.overlap_comm:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        """Land the oldest reduction (blocking until it is done)."""
        self._inflight[0].handle.wait()
        self._start_sums_across()  # this one's sum across replicas first, then any later ones already reduced
        done = self._inflight.popleft()
        if self.replicas is not None and self.config.quantized_gradients is not None:  # qgZ between nodes too
            quantized_collectives.all_reduce(done.out, self.replicas, self.config.quantized_gradients, self._rounding)
        elif self.replicas is not None:  # the other groups' sums of the same shard, started above
            done.across.wait()
        offset = 0
        for unit in done.units:
            unit.land_reduced(done.out[offset : offset + unit.spec.shard_numel])
            offset += unit.spec.shard_numel

    def wait(self) -> None:
        """Block until every launched reduction has landed in its shard."""
        self.flush()
        while self._inflight:
            self._finish_oldest()

    def any_rank(self, flag: Tensor) -> bool:
        """Whether ``flag`` (a 0-dim float, 0 or 1) is set on any rank: one MAX all-reduce. A collective."""
        collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flag_group)
        return bool(flag.item())

    def remove(self, after_failure: bool = False) -> None:
        """Done reducing; ``after_failure``: without waiting for reductions in flight (they run on the main group).
        The flag group only ever runs synchronous collectives, so nothing can be pending on it: its owner, the
        mesh, destroys it next without waiting for any rank."""
        if after_failure:
            self._inflight.clear()
            self._held, self._held_numel = [], 0
        else:
            self.wait()
        self.flag_group = None
