"""A stage-3 block (the units of one module instance, gathered and released together), its states, the handles
of its gathers in flight, and the schedule that decides when it is gathered. See [Note: stage-3 parameter
lifecycle] and [Note: stage-3 gather schedule] in gather.py, which moves blocks through these states."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Optional, Sequence

import torch

from lzero.config import ScheduleConfig
from lzero.engine import collectives
from lzero.engine.flat_unit import FlatUnit, fill_from_gathered


class Gathering(NamedTuple):
    """A launched all-gather of one unit and the shard it reads."""

    handle: collectives.Handle
    source: torch.Tensor
    copied: Any  # CUDA event after the shard's copy to the device (offloaded shards), or None

    def wait(self) -> None:
        self.handle.wait()  # NCCL: the compute stream waits for the all-gather
        if self.copied is not None:  # a local (world size 1) gather is a copy on the side stream
            torch.cuda.current_stream(self.source.device).wait_event(self.copied)


class RunGathering:
    """One all-gather of a run of blocks (``gather_bucket_size``): every rank's shards of the run's units, rank by
    rank. Each block of the run holds this handle; the first wait copies the result into every unit's buffer."""

    def __init__(self, handle: collectives.Handle, units: list[FlatUnit], out: torch.Tensor, world_size: int) -> None:
        self.handle = handle
        self.units = units
        self.out: Optional[torch.Tensor] = out  # 1D, world_size * the run's shard elements; freed once copied
        self.world_size = world_size

    def wait(self) -> None:
        if self.out is not None:  # the run's units are allocated until then: a release waits first
            self.handle.wait()
            fill_from_gathered(self.units, self.out, self.world_size)
            self.out = None


class HostCopy(NamedTuple):
    """A block's copy from host memory onto the device, on a side stream (CUDA); see [Note: blocks streamed from
    host memory]."""

    copied: Any  # CUDA event after the copy; None: the copy was synchronous (CPU)
    device: torch.device

    def wait(self) -> None:
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)


class BlockState(enum.Enum):
    RELEASED = "only this rank's shard is resident"
    GATHERING = "all-gathers launched, not yet waited for"
    GATHERED = "full parameters resident"


class Block:
    """The units of one module instance (or of the root), gathered and released together."""

    def __init__(self, name: str, units: Sequence[FlatUnit]) -> None:
        self.name = name
        self.units = list(units)
        self.state = BlockState.RELEASED
        self.handles: list[Any] = []
        self.pending_backwards = 0  # forwards run with gradients whose backward has not passed the block's inputs
        self.sticky = False  # a torch.autograd.grad call went through the block: kept gathered until released whole


@dataclass(frozen=True)
class GatherSchedule(ScheduleConfig):
    """When blocks are gathered and how long they stay: [Note: stage-3 gather schedule]. The configuration's
    schedule section with every knob set: one left at None takes its memory-minimal value (what the first step
    runs under ``schedule="auto"``, and every step under ``"min_memory"``) until the ``schedule`` policy sets it."""

    def __post_init__(self) -> None:  # the values were checked by the ZeroConfig they come from
        for name, value in MEMORY_MINIMAL.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    @classmethod
    def of(cls, config: ScheduleConfig) -> "GatherSchedule":
        """``config``'s schedule section (a ``ZeroConfig`` is one), its knobs left at None memory-minimal."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(ScheduleConfig)})


MEMORY_MINIMAL = {"prefetch": 1, "max_reuse_distance": 0, "param_persistence_threshold": 0, "gather_bucket_size": 0}
"""The memory-minimal values of the knobs a ``ZeroConfig`` may leave at None (FSDP's schedule: one block prefetched,
none kept, none persistent, one all-gather per unit)."""

SCHEDULED = tuple(MEMORY_MINIMAL)
"""The knobs a ``ZeroConfig`` may leave at None: the ``schedule`` policy's to set ([Note: choosing the gather
schedule] in schedule.py); memory-minimal until it does."""
