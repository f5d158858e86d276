"""Stage 3's ``schedule="auto"``: the gather schedule with the fewest collectives whose peak fits the memory the rank
has, chosen from the measured peak of the first two steps.

[Note: choosing the gather schedule]
The knobs of [Note: stage-3 gather schedule] (gather.py) trade collectives for memory and never change what is
computed. FSDP's defaults (and ``schedule="min_memory"``) gather every block for its forward and again for its
backward: two collectives per block per step, each a fixed latency that a model of many small blocks waits on.
DeepSpeed's defaults keep blocks gathered without looking at memory. ``schedule="auto"`` looks:

- The first two training steps run the memory-minimal schedule (knobs given explicitly apply from the start); the
  first records the blocks' forward order. The rank's peak over both is measured (``torch.cuda.max_memory_allocated``
  on CUDA; on CPU the process's resident high-water mark, VmHWM, reset through ``/proc/self/clear_refs``) with the
  activations, the optimizer and the allocator in it. Two steps, because the optimizer's state is made in the first
  step's update, after that step's peak (the backward's), and is there in every later backward: on the 2-CPU
  benchmark the first step alone under-predicted later steps by 12-20% (Adam's moments).
- After the second step's update, each rank's headroom is its budget less ``schedule_margin`` of it less the measured
  peak. The budget: ``memory_budget_bytes`` when given; on CUDA the device's free memory plus what torch's caching
  allocator holds; on CPU the host's available memory shared by the node's ranks plus the process's resident
  memory. The ranks take the smallest headroom (one all-reduce), so all choose the same schedule: the gathers of
  a schedule are collectives every rank of the gather group must run alike.
- :func:`plan` then tries every persistence threshold among the block sizes of at most ``allgather_bucket_size``
  elements (a persistent block is gathered once per step, after the optimizer step, in coalesced all-gathers:
  no collective of its own) and every count of forward's last blocks kept across the forward-backward turn
  (``max_reuse_distance``: one gather per step instead of two), and takes the fewest per-step collectives whose
  predicted peak fits: the measured peak plus the compute-dtype bytes of the blocks gathered at once beyond what
  the first steps held (:func:`peak_elements`, which bounds the gatherer's own rule: the root, the persistent and
  kept blocks, and the computing block with those prefetched ahead). Ties go to the smaller peak.
- ``prefetch`` stays one block and ``gather_bucket_size`` off: neither saves a collective the two above do not
  (deeper prefetch moved the 2-CPU benchmarks by under 3%, benchmarks/results/memory/gather_schedule...md).
- A headroom below zero (the first steps already ran past the budget) keeps the memory-minimal schedule; the
  out-of-memory triage then names the presets that fit. An out-of-memory error under the chosen schedule names it
  and the knob to lower.

The choice is logged once on rank 0, kept on the engine (``auto_schedule.record``) and logged by the memory
monitor. With hybrid sharding and hpZ the same blocks are gathered from their smaller groups: the choice is the
same, only the gathers are cheaper.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from lzero.engine import collectives
from lzero.engine.blocks import SCHEDULED, GatherSchedule
from lzero.log import info_on_rank_zero
from lzero.engine.rank_memory import MemoryBudget, peak_bytes, reset_peak


# --- the arithmetic -------------------------------------------------------------------------------------------


def persistent_indices(sizes: Sequence[int], schedule: GatherSchedule) -> set[int]:
    return {i for i, k in enumerate(sizes) if k <= schedule.param_persistence_threshold}


def kept(sizes: Sequence[int], root: int, schedule: GatherSchedule) -> set[int]:
    """Indices of the blocks (forward order) the gatherer keeps across the turn: its own walk from the last."""
    out: set[int] = set()
    after, live, cap = 0, root, schedule.max_live_parameters
    for i in reversed(range(len(sizes))):
        if 2 * after >= schedule.max_reuse_distance or (cap is not None and live + sizes[i] > cap):
            break
        out.add(i)
        live += sizes[i]
        after += sizes[i]
    return out


def peak_elements(sizes: Sequence[int], root: int, schedule: GatherSchedule, recording: bool = False) -> int:
    """At most how many parameter elements are gathered at once in a step: the root, the persistent blocks, the
    blocks kept across the turn (none while ``recording``, the first step), and the computing block with those
    prefetched ahead (runs of ``gather_bucket_size`` counted as blocks of its size, and one run's staging buffer).
    ``sizes``: the blocks' elements in forward order."""
    persistent = persistent_indices(sizes, schedule)
    held = persistent | (set() if recording else kept(sizes, root, schedule))
    others = sorted((k for i, k in enumerate(sizes) if i not in held), reverse=True)
    largest = others[0] if others else 0
    run = schedule.gather_bucket_size if not recording else 0
    if run:
        largest = max(largest, run)
    if schedule.prefetch_bucket_size is not None:  # blocks ahead until they hold the bucket (the last may pass it)
        ahead = min(sum(others[1:]), schedule.prefetch_bucket_size + largest) if schedule.prefetch_bucket_size else 0
    else:
        ahead = (schedule.prefetch * run) if run else sum(others[1:1 + schedule.prefetch])
    moving = largest + ahead + run  # the computing block, those ahead, a run's staging buffer
    peak = min(root + sum(sizes), root + sum(sizes[i] for i in held) + moving)
    cap = schedule.max_live_parameters
    if cap is not None:  # prefetches and kept blocks wait rather than pass it; the computing block never does
        peak = min(peak, max(cap, root + sum(sizes[i] for i in persistent) + largest))
    return peak


def measured_under(sizes: Sequence[int], root: int, first: GatherSchedule) -> int:
    """The gathered elements the measured steps held at most: the first while recording, the second without (where
    explicit reuse distances and runs apply already)."""
    return max(peak_elements(sizes, root, first, recording=True), peak_elements(sizes, root, first))


def gathers_per_step(sizes: Sequence[int], root: int, schedule: GatherSchedule, bucket: int,
                     coalesced: bool = True) -> int:
    """Parameter all-gathers per step (runs not counted): two per block, one per block kept across the turn, and the
    persistent blocks' coalesced gathers of ``bucket`` elements after the optimizer step (``coalesced`` False:
    parameter shards in host memory or files, which the step does not gather: one per persistent block, in forward)."""
    persistent = persistent_indices(sizes, schedule)
    kept_ = kept(sizes, root, schedule) - persistent
    rest = len(sizes) - len(persistent) - len(kept_)
    if not coalesced:
        return 2 * rest + len(kept_) + len(persistent)
    together = math.ceil(sum(sizes[i] for i in persistent) / max(1, bucket)) if persistent else 0
    return 2 * rest + len(kept_) + together


def extra_elements(sizes: Sequence[int], root: int, first: GatherSchedule, chosen: GatherSchedule) -> int:
    """The elements ``chosen`` gathers at once beyond what the measured steps (under ``first``) held."""
    return peak_elements(sizes, root, chosen) - measured_under(sizes, root, first)


def describe(sizes: Sequence[int], root: int, first: GatherSchedule, chosen: GatherSchedule, bucket: int,
             coalesced: bool = True) -> dict[str, Any]:
    """What ``chosen`` keeps and what it costs in collectives: the fields of a choice's record."""
    return {"param_persistence_threshold": chosen.param_persistence_threshold,
            "max_reuse_distance": chosen.max_reuse_distance,
            "persistent_blocks": len(persistent_indices(sizes, chosen)),
            "kept_blocks": len(kept(sizes, root, chosen) - persistent_indices(sizes, chosen)), "blocks": len(sizes),
            "gathers_per_step": gathers_per_step(sizes, root, chosen, bucket, coalesced),
            "min_memory_gathers_per_step": 2 * len(sizes)}


def plan(sizes: Sequence[int], root: int, headroom: int, first: GatherSchedule, fixed: Sequence[str],
         bucket: int, coalesced: bool = True) -> GatherSchedule:
    """The schedule with the fewest :func:`gathers_per_step` whose :func:`peak_elements` exceeds the first steps'
    (``first``: :func:`measured_under`) by at most ``headroom`` elements; ``fixed``: the knobs given explicitly,
    kept. See [Note: choosing the gather schedule]."""
    base = measured_under(sizes, root, first)
    if "param_persistence_threshold" in fixed:
        thresholds = [first.param_persistence_threshold]
    else:
        thresholds = [0, *sorted({k for k in sizes if 0 < k <= bucket})]
    if "max_reuse_distance" in fixed:
        distances = [first.max_reuse_distance]
    else:  # keep forward's last k blocks: below twice the elements after the k-th from the end
        after = [0]
        for k in reversed(sizes):
            after.append(after[-1] + k)
        distances = [2 * a for a in after[:-1]] + [2 * after[-1] + 1]
    best, best_key = first, None
    for threshold in thresholds:
        for distance in distances:  # more blocks kept: never fewer elements gathered
            candidate = replace(first, param_persistence_threshold=threshold, max_reuse_distance=distance)
            peak = peak_elements(sizes, root, candidate)
            if peak - base > headroom:
                break
            # ties (blocks persistent anyway) go to the smaller peak, then to the longer distance: the kept blocks
            # that persistence already holds cost nothing, and a smaller budget then lowers both knobs
            key = (gathers_per_step(sizes, root, candidate, bucket, coalesced), peak, -distance)
            if best_key is None or key < best_key:
                best, best_key = candidate, key
    return best


# --- at run time ----------------------------------------------------------------------------------------------


class AutoSchedule:
    """The engine's ``schedule="auto"``: :meth:`start` at the first forward, :meth:`choose` after each optimizer step
    (it decides after the second). See [Note: choosing the gather schedule]."""

    def __init__(self, config: Any, device: torch.device, budget: MemoryBudget, group: Any) -> None:
        self.fixed = [k for k in SCHEDULED if getattr(config, k) is not None]
        self.margin = config.schedule_margin
        self.bucket = config.allgather_bucket_size
        self.coalesced = config.offload_param.device == "none"  # the step gathers persistent blocks on the device
        self.device, self.budget, self.group = device, budget, group
        self.started = False
        self.first_step: Optional[int] = None  # the gatherer's step count at the first optimizer step
        self.record: Optional[dict[str, Any]] = None

    def start(self) -> None:
        if not self.started:
            self.started = True
            reset_peak(self.device)

    def choose(self, gatherer: Any, element_bytes: int, names: Sequence[str]) -> None:
        """Measure, agree and reschedule ``gatherer`` (a collective over ``group``); once. ``names``: the blocks
        other than the root."""
        if self.record is not None or not self.started or not gatherer.order_known:
            return
        if self.first_step is None or gatherer.steps == self.first_step:  # the first step (each of its optimizers)
            self.first_step = gatherer.steps
            return
        peak, budget = peak_bytes(self.device), self.budget.read(self.device)
        mine = math.inf if peak is None or budget is None else (1 - self.margin) * budget - peak
        agreed = torch.tensor([mine], dtype=torch.float64,
                              device=self.device if self.device.type == "cuda" else "cpu")
        collectives.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=self.group)
        headroom = agreed.item()
        order = [n for n in gatherer.order if n in names] + [n for n in names if n not in gatherer.order]
        sizes = [gatherer.numel[n] for n in order]
        root = sum(k for n, k in gatherer.numel.items() if n not in names)
        first = gatherer.schedule
        unknown = headroom == math.inf
        chosen = first if unknown or headroom < 0 else plan(sizes, root, int(headroom // element_bytes), first,
                                                              self.fixed, self.bucket, self.coalesced)
        gatherer.reschedule(chosen)
        self.record = {
            **describe(sizes, root, first, chosen, self.bucket, self.coalesced), "prefetch": chosen.prefetch,
            "measured_peak_bytes": peak,
            "predicted_peak_bytes": None if peak is None else peak + element_bytes * extra_elements(sizes, root, first,
                                                                                                   chosen),
            "budget_bytes": budget, "margin": self.margin, "headroom_bytes": None if unknown else headroom,
            "fixed": list(self.fixed),
        }
        info_on_rank_zero(summary(self.record))


def summary(record: dict[str, Any]) -> str:
    """The line logged once the schedule is chosen."""
    r = record
    if r["headroom_bytes"] is None:
        why = " (this machine's memory could not be read: set `memory_budget_bytes` on the strategy)"
        return f"lzero zero3 schedule auto: memory-minimal{why}."
    if r["headroom_bytes"] < 0:
        return (f"lzero zero3 schedule auto: memory-minimal: the first steps' peak {_gb(r['measured_peak_bytes'])}"
                f" already passes the budget {_gb(r['budget_bytes'])} less {r['margin']:.0%}.")
    return (f"lzero zero3 schedule auto: {r['persistent_blocks']} of {r['blocks']} blocks persistent"
            f" (param_persistence_threshold={r['param_persistence_threshold']}), {r['kept_blocks']} kept across the"
            f" turn (max_reuse_distance={r['max_reuse_distance']}): {r['gathers_per_step']} all-gathers per step"
            f" instead of {r['min_memory_gathers_per_step']}; peak {_gb(r['measured_peak_bytes'])} measured in the"
            f" first two steps, {_gb(r['predicted_peak_bytes'])} predicted, budget {_gb(r['budget_bytes'])} less"
            f" {r['margin']:.0%}. `schedule='min_memory'` or a lower `max_reuse_distance` /"
            " `param_persistence_threshold` holds less.")


def _gb(nbytes: Optional[float]) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"
