"""Where a unit's shard state lives: the fp32 master the optimizer steps, the reduced shard gradient,
the optimizer state (created by the optimizer next to its parameter) and, at stage 3, the 16-bit
parameter shard that all-gathers read.

[Note: shard stores]
Every unit asks its stores to hold its master and its parameter shard, to land each reduced gradient
shard, to publish the stepped master into the compute-dtype shard, and to hand a parameter shard to
an all-gather on the compute device. ``DeviceStore`` keeps all of it on the device the model computes
on; ``HostStore`` keeps it in host memory (``ZeroConfig.offload_optimizer`` / ``offload_param``), so
the engine, the reducer and the optimizer wrapper do not change with the choice.

[Note: host store copies]
The host store keeps its tensors (masters, shard gradients, optimizer state, stage-3 parameter shards) in
ordinary pageable host memory, and moves data through a small pool of page-locked ("pinned") staging
buffers, at most ``max_staged`` of them in use per direction (``pin_memory: false``: pageable staging).
Pinned memory is scarce on small hosts (a classic DeepSpeed offload failure) and torch's caching host
allocator rounds each pinned block up to a power of two, so pinning the whole state could take up to
twice its size; the pool costs a few units' worth. On CUDA:

- gradients down: a reduced shard gradient is copied device->host on a side stream (which first waits
  for the compute stream, where the reduction's result is ready), in the dtype it was reduced in (half the
  bytes under bf16/fp16 reductions), into a staging buffer; an event marks the end of the copy, and
  ``record_stream`` keeps the device tensor allocated until then. Backward goes on. A landing is
  completed (the staged values added into, or for the first reduction of a step converted into, the
  fp32 host gradient, and the buffer returned to the pool) as soon as its event has passed, checked at
  each new landing, and at the latest in ``finish``, which runs before anything reads a gradient
  (clipping, the non-finite check, the step). When ``max_staged`` copies are in flight the oldest is
  waited for.
- parameters up: after the host step of a unit, its master is cast to the compute dtype into a staging
  buffer on the host and copied host->device on the compute stream, so the all-gather and the next forward,
  queued behind it, see the new values, while the host steps the next unit. The buffer returns to the
  pool when the copy's event has passed.
- stage-3 parameter shards (``offload_param``): each unit's shard is copied into a staging buffer and from
  there to the device on the side stream, which first waits for the compute stream (the gather's target
  memory is then free); the unit's all-gather is launched from the side stream too, so both run while the
  compute stream computes the current unit (the gather is launched by the prefetch, a unit early). The
  compute stream waits for the all-gather (and for an event after the copy) only when it gathers the unit.

When the model computes on the CPU (this project's test machine) the "device" is the host: the store
still keeps separate tensors and runs the same staging, landing and recycling logic, with synchronous copies
and no events, so the CPU tests exercise the logic that CUDA runs with streams. Publishing is the exception:
there a staging buffer only adds a second copy of every stepped element, so the master is cast straight into
the compute shard (the offloaded step's publish cost as much as the step itself through staging).

A pinned staging buffer can fail to allocate. The store then goes on with pageable buffers for the rest
of the run, with one warning naming ``pin_memory: false``: training continues with slower, synchronous
copies instead of stopping a run that has everything else it needs.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, ContextManager, NamedTuple, Optional, Protocol

import torch
from torch import Tensor


KINDS = ("parameters", "gradients", "masters", "optimizer_state", "buffers")
"""The kinds of model-state memory a rank holds, in the order memory accounting claims a storage; ``buffers``: the
offload stores' staging and swap buffers (see [Note: host store copies])."""


class ShardStore(Protocol):
    """See [Note: shard stores]."""

    name: str  # the memory this store's tensors occupy: "device" or "cpu"
    in_memory: bool  # the master and optimizer state stay in memory between uses (see ``resident``)

    def hold(self, values: Tensor, key: str) -> Tensor:
        """A copy of ``values`` (1-D) kept in this store; ``key`` names it (``unit<i>.<what>``) for stores that
        keep it in a file (it then is a placeholder of the right shape: see ``holds_in_file``)."""
        ...

    def holds_in_file(self, unit: Any) -> bool:
        """``unit``'s compute shard lives in a file of this store (written with ``write_param``)."""
        ...

    def hold_master(self, values: Tensor, alias_ok: bool, key: str) -> Tensor:
        """The tensor the optimizer steps, holding ``values`` (1-D). ``alias_ok``: ``values`` may be used
        as it is (full precision at stages 1-2, where the master is the owned slice of the parameters).
        ``key`` names the unit (a store that keeps masters in files names them by it)."""
        ...

    def resident(self, unit: Any, write: bool) -> ContextManager[None]:
        """Inside the block ``unit.master_shard`` and its optimizer state hold their values (``write``: what is
        changed inside is kept). Every reader or writer of masters and optimizer state enters it; a no-op
        for stores that keep them in memory."""
        ...

    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        """Add one reduced gradient shard into ``held`` (None: the first reduction since the step; the
        result replaces it); returns the tensor that holds the sum, in ``dtype``, once :meth:`finish` ran."""
        ...

    def publish(self, master: Tensor, compute: Tensor) -> None:
        """Write the stepped master into the compute-dtype shard that the next all-gather reads."""
        ...

    def fetch(self, unit: Any, device: torch.device) -> Tensor:
        """``unit``'s compute shard (held by this store) as a tensor on ``device`` for an all-gather to read."""
        ...

    def gather_from_side_stream(self, launch: Any) -> tuple[Any, Any]:
        """Run ``launch()`` (an all-gather of fetched shards) where their copies run; returns its result and an
        event the compute stream waits for before reading what it gathered (None: nothing to wait for)."""
        ...

    def finish(self) -> None:
        """Complete every copy in flight: landed gradients hold their sums afterwards."""
        ...

    def prefetch(self, unit: Any) -> None:
        """``unit`` will be resident soon: a store that keeps it in files may start reading them."""
        ...

    def bind_state(self, unit: Any, state: Any) -> None:
        """``state()`` returns the optimizer state dict of ``unit``'s master (for stores that swap it)."""
        ...

    def close(self) -> None:
        """The engine is done with the store (end of fit, or after a failure): release what it holds."""
        ...


class DeviceStore:
    """Everything on the compute device."""

    name = "device"
    memory = "device"  # where its in-memory tensors are (the label memory accounting uses)
    in_memory = True

    def hold(self, values: Tensor, key: str) -> Tensor:
        return values.clone()

    def holds_in_file(self, unit: Any) -> bool:
        return False

    def hold_master(self, values: Tensor, alias_ok: bool, key: str) -> Tensor:
        return values if alias_ok else values.clone()

    def resident(self, unit: Any, write: bool) -> ContextManager[None]:
        return contextlib.nullcontext()

    @torch.no_grad()
    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        if held is None:
            return reduced.to(dtype)
        held.add_(reduced)
        return held

    @torch.no_grad()
    def publish(self, master: Tensor, compute: Tensor) -> None:
        if compute.data_ptr() != master.data_ptr():
            compute.copy_(master)

    def fetch(self, unit: Any, device: torch.device) -> Tensor:
        return unit.compute_shard()

    def gather_from_side_stream(self, launch: Any) -> tuple[Any, Any]:
        return launch(), None

    def finish(self) -> None:
        pass

    def prefetch(self, unit: Any) -> None:
        pass

    def bind_state(self, unit: Any, state: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Landing(NamedTuple):
    """A gradient copy to complete: add (or convert) ``staged`` into ``held`` once ``event`` has passed."""

    event: Any  # torch.cuda.Event marking the end of the device->host copy; None when synchronous
    staged: Tensor  # the reduced values in a staging buffer, in the reduce dtype
    base: Tensor  # the staging buffer itself (bytes), returned to the pool once the landing is complete
    held: Tensor  # the fp32 host shard gradient
    add: bool  # add into ``held``; False: ``held`` takes the staged values (the first reduction of a step)


class HostStore:
    """Shard state in host memory. See [Note: host store copies]."""

    name = "cpu"
    memory = "cpu"
    in_memory = True

    def __init__(self, device: torch.device, pin_memory: bool = True, max_staged: int = 4) -> None:
        self.device = device  # where the model computes
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda  # nothing to pin for copies between host tensors
        self.max_staged = max_staged
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._landings: list[_Landing] = []  # gradient copies not yet summed into their host gradient
        self._uploads: list[tuple[Any, Tensor]] = []  # (event, staging buffer) of copies to the device
        self._free: list[Tensor] = []  # staging buffers (bytes) not in use, at most ``max_staged``
        self.copied = {"to_host": 0, "to_device": 0}  # bytes copied since the start (the memory monitor logs them)

    # --- memory ------------------------------------------------------------------------------

    def _staging(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``numel`` elements of ``dtype`` in a staging buffer, and the buffer: the smallest free one that is large
        enough, or a new one, page-locked when copies to and from a GPU read it (see the Note on failures)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fits = [b for b in self._free if b.numel() >= nbytes]
        if fits:
            base = min(fits, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not base]
        else:
            base = self._allocate(nbytes)
        return base[:nbytes].view(dtype), base

    def _allocate(self, nbytes: int) -> Tensor:
        if self.pin:
            try:
                return self._pinned(nbytes)
            except RuntimeError as err:
                self.pin = False
                warnings.warn(
                    f"lzero could not allocate {nbytes:,} bytes of"
                    f" pinned host memory ({str(err).splitlines()[0]}); offload goes on with pageable memory, whose"
                    " copies are synchronous and slower. HINT: set `pin_memory: false` in `offload_optimizer` /"
                    " `offload_param` to start with pageable memory, or raise the page-locked memory limit.",
                    stacklevel=2,
                )
        return torch.empty(nbytes, dtype=torch.uint8)

    def _pinned(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _recycle(self, base: Tensor) -> None:
        """Return a staging buffer to the pool, which keeps the ``max_staged`` largest free ones."""
        self._free.append(base)
        if len(self._free) > self.max_staged:
            smallest = min(self._free, key=lambda b: b.numel())
            # by identity: ``list.remove`` compares tensors with ``==`` (elementwise; raised on the GPU run's sizes)
            self._free = [b for b in self._free if b is not smallest]

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers this store holds now (free or in flight)."""
        busy = [landing.base for landing in self._landings] + [base for _, base in self._uploads]
        return sum(b.numel() for b in self._free + busy)

    def hold(self, values: Tensor, key: str = "") -> Tensor:
        out = torch.empty(values.numel(), dtype=values.dtype)
        out.copy_(values.reshape(-1))
        return out

    def holds_in_file(self, unit: Any) -> bool:
        return False

    def hold_master(self, values: Tensor, alias_ok: bool, key: str) -> Tensor:
        return HostStore.hold(self, values)  # never the device's parameters themselves

    def resident(self, unit: Any, write: bool) -> ContextManager[None]:
        return contextlib.nullcontext()

    # --- gradients down ----------------------------------------------------------------------

    @torch.no_grad()
    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        add = held is not None
        if held is None:
            held = torch.empty(reduced.numel(), dtype=dtype)
        self._complete_landings(block=False)
        while len(self._landings) >= self.max_staged:  # bound the staging buffers in flight
            self._complete(self._landings.pop(0))
        staged, base = self._staging(reduced.numel(), reduced.dtype)
        self.copied["to_host"] += reduced.numel() * reduced.element_size()
        event = None
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                staged.copy_(reduced, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            reduced.record_stream(self.copy_stream)  # its device memory stays allocated until the copy ran
        else:
            staged.copy_(reduced)
        self._landings.append(_Landing(event, staged, base, held, add))
        return held

    def _complete_landings(self, block: bool) -> None:
        """Complete the landings whose copies have finished (``block``: all of them), oldest first."""
        while self._landings and (block or self._landings[0].event is None or self._landings[0].event.query()):
            self._complete(self._landings.pop(0))

    def _complete(self, landing: _Landing) -> None:
        if landing.event is not None:
            landing.event.synchronize()
        if landing.add:
            landing.held.add_(landing.staged)
        else:
            landing.held.copy_(landing.staged)
        self._recycle(landing.base)

    def _complete_uploads(self, block: bool) -> None:
        while self._uploads and (block or self._uploads[0][0] is None or self._uploads[0][0].query()):
            event, base = self._uploads.pop(0)
            if event is not None:
                event.synchronize()
            self._recycle(base)

    @torch.no_grad()
    def finish(self) -> None:
        self._complete_landings(block=True)
        self._complete_uploads(block=True)

    def prefetch(self, unit: Any) -> None:
        pass

    def bind_state(self, unit: Any, state: Any) -> None:
        pass

    def close(self) -> None:
        self.finish()

    # --- parameters up -----------------------------------------------------------------------

    def _upload(self, dst: Tensor, src: Tensor, stream: Any) -> None:
        """``dst`` (device) takes ``src`` (host, any float dtype) through a staging buffer, on ``stream``."""
        self._complete_uploads(block=False)
        while len(self._uploads) >= self.max_staged:
            event, base = self._uploads.pop(0)
            event.synchronize()
            self._recycle(base)
        staging, base = self._staging(src.numel(), dst.dtype)
        self.copied["to_device"] += dst.numel() * dst.element_size()
        staging.copy_(src)  # on the host: the cast to the compute dtype happens here, before the copy
        with torch.cuda.stream(stream):
            dst.copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._uploads.append((event, base))

    @torch.no_grad()
    def publish(self, master: Tensor, compute: Tensor) -> None:
        if compute.device.type != "cuda":  # host to host (CPU model, or offloaded stage-3 parameter shards)
            if compute.data_ptr() != master.data_ptr():
                # one pass, casting on the way: a staging buffer serves a copy to a GPU only (it doubled this copy)
                self.copied["to_device"] += compute.numel() * compute.element_size()
                compute.copy_(master)
            return
        self._upload(compute, master, torch.cuda.current_stream(compute.device))  # the gather queues behind it

    def fetch(self, unit: Any, device: torch.device) -> Tensor:
        return self._to_device(unit.compute_shard(), device)

    @torch.no_grad()
    def _to_device(self, shard: Tensor, device: torch.device) -> Tensor:
        """A host shard copied to a new tensor on ``device`` (through a staging buffer)."""
        out = torch.empty(shard.numel(), dtype=shard.dtype, device=device)  # allocated on the compute stream
        if not self.cuda:
            self.copied["to_device"] += shard.numel() * shard.element_size()
            staging, base = self._staging(shard.numel(), shard.dtype)
            staging.copy_(shard)
            out.copy_(staging)
            self._recycle(base)
            return out
        # the side stream waits for the compute stream: ``out`` and the gather's target are free to write
        self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        self._upload(out, shard, self.copy_stream)
        out.record_stream(self.copy_stream)
        return out

    def gather_from_side_stream(self, launch: Any) -> tuple[Any, Any]:
        """Launch ``launch()`` (the all-gather reading fetched shards) from the side stream, after their copies;
        returns its handle and an event the compute stream must wait for before reading the gathered values."""
        if not self.cuda:
            return launch(), None
        with torch.cuda.stream(self.copy_stream):
            handle = launch()
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return handle, event


def divide_host_threads(local_processes: int) -> Optional[int]:
    """Give each of the ``local_processes`` processes of this host an equal share of its CPU cores for the
    host optimizer step (torch's default, one thread per core in every process, oversubscribes the host).
    Returns the new thread count, or None when the current one is already within the share."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    share = max(1, cores // max(1, local_processes))
    if torch.get_num_threads() <= share:
        return None
    torch.set_num_threads(share)
    return share
