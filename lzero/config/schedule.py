"""ZeroConfig's schedule section: when stage 3 gathers each block's parameters, and for how long."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from lzero.config.checks import AUTO, BY_HIDDEN_SIZE, set_whole
from lzero.errors import ZeroConfigError

GATHER_KNOBS = ("prefetch", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                "param_persistence_threshold", "gather_bucket_size")
"""The stage-3 knobs of [Note: stage-3 gather schedule]: whole numbers, or None (unset)."""

_KNOB_WORDS = {  # (unit, HINT) of a knob's error
    **{name: (" of elements", "e.g. 0, or leave it unset.") for name in GATHER_KNOBS},
    "prefetch": ("", "e.g. `prefetch=1`."),
    **{name: (" of elements", '"auto" sizes it from the model\'s hidden size.') for name in BY_HIDDEN_SIZE},
}


@dataclass(frozen=True)
class ScheduleConfig:
    """Stage 3: when each block's parameters are gathered and how long they stay gathered ([Note: stage-3 gather
    schedule] in lzero/engine/gather.py; the engine runs it as ``lzero.engine.blocks.GatherSchedule``)."""

    schedule: Literal["auto", "min_memory"] = "auto"
    """Stage 3: who sets the gather schedule's knobs (``prefetch``, ``max_reuse_distance``,
    ``param_persistence_threshold``, ``gather_bucket_size``) left at None. "auto": the first two training steps run
    the memory-minimal schedule and measure their peak; from the third step on, the blocks are kept gathered
    (persistent, or across the forward-backward turn) as far as the measured peak plus the extra gathered bytes fits
    the rank's memory budget less ``schedule_margin``: the fewest collectives that fit. "min_memory": every knob left
    at None takes its memory-minimal value (one block prefetched, none kept, none persistent), FSDP's schedule. Knobs
    given explicitly always win. See [Note: choosing the gather schedule] in lzero/engine/schedule.py."""

    schedule_margin: float = 0.1
    """Stage 3, ``schedule="auto"``: the fraction of the memory budget kept free (allocator fragmentation, a longer
    batch later) when the schedule is chosen."""

    prefetch: Optional[int] = None
    """Stage 3: how many units ahead to all-gather while the current one computes (0: none). None: 1 (the
    ``schedule`` does not change it)."""

    prefetch_bucket_size: Union[None, int, Literal["auto"]] = None
    """Stage 3: prefetch by size instead of by count: all-gather the next units while those already gathered
    or launched ahead of the current one hold fewer than this many elements (a unit is never split, so the last
    one may pass the limit; 0: no prefetch). DeepSpeed's ``stage3_prefetch_bucket_size``. None: ``prefetch``
    units ahead. "auto": 0.9*h*h, filled at setup. See [Note: stage-3 gather schedule] in gather.py."""

    max_live_parameters: Optional[int] = None
    """Stage 3: a prefetch, or a unit kept gathered by ``max_reuse_distance``, never takes the gathered
    parameters past this many elements (the unit being computed is always gathered). DeepSpeed's
    ``stage3_max_live_parameters``. None: no limit."""

    max_reuse_distance: Optional[int] = None
    """Stage 3: a unit whose next use is fewer than this many elements away is kept gathered instead of being
    released and gathered again. The distance is counted in the elements of the units used in between: for
    the unit at position k of n in forward, twice the elements of units k+1..n-1 (their forward, then their
    backward), so the last units of forward, which backward needs first, are kept from the second step on
    (the first step records the order). DeepSpeed's ``stage3_max_reuse_distance``. 0: none kept. None: the
    ``schedule`` chooses (``min_memory``: 0)."""

    param_persistence_threshold: Union[None, int, Literal["auto"]] = None
    """Stage 3: a unit of at most this many elements stays gathered from its forward to the end of its
    backward, and is gathered again right after the optimizer step, with the other such units in coalesced
    all-gathers of ``allgather_bucket_size``, so the next forward finds it gathered: many small blocks cost one
    collective per bucket instead of two per block. DeepSpeed's ``stage3_param_persistence_threshold``
    compares each parameter; lzero gathers a unit's parameters in one collective, so it compares the unit
    (small parameters inside a large unit cost no collective of their own). 0: none. "auto": 10*h, filled
    at setup. None: the ``schedule`` chooses (``min_memory``: 0)."""

    gather_bucket_size: Optional[int] = None
    """Stage 3: from the second step on (the first records the order), consecutive units of at most a quarter
    of this many elements each are all-gathered together, in forward and again in backward: one collective (and
    one order check) of at most this many elements per run of units instead of one per unit, which is what a
    model of many small blocks waits on. A run counts as one unit for ``prefetch``, so up to about two runs are
    gathered at once. Units whose parameter shards live in host memory or files, and persistent ones, are
    gathered alone. 0: one all-gather per unit. None: 0 (the ``schedule`` does not choose runs). See [Note: stage-3
    gather schedule] in gather.py."""

    def __post_init__(self) -> None:
        if self.schedule not in ("auto", "min_memory"):
            raise ZeroConfigError(f"`schedule={self.schedule!r}` is not a gather schedule policy. HINT: 'auto' (the"
                                  " fastest that fits the memory budget) or 'min_memory' (FSDP's: every block gathered"
                                  " for its forward and again for its backward).")
        margin = self.schedule_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ZeroConfigError(f"`schedule_margin={margin!r}` must be a fraction in [0, 1). HINT: e.g. 0.1.")
        for name in GATHER_KNOBS:
            value = getattr(self, name)
            if value is not None and not (value == AUTO and name in BY_HIDDEN_SIZE):
                set_whole(self, name, 0, *_KNOB_WORDS[name])
        if self.prefetch_bucket_size is not None and self.prefetch is not None:
            raise ZeroConfigError(f"`prefetch={self.prefetch}` and `prefetch_bucket_size={self.prefetch_bucket_size}`"
                                  " both say how far to prefetch. HINT: give one of them.")
