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
On CUDA the host store moves data with asynchronous copies through page-locked ("pinned") buffers:

- gradients down: a reduced shard gradient is copied device->host on a side stream that first waits
  for the compute stream (the reduction's result is ready there), in the dtype it was reduced in
  (half the bytes under bf16/fp16 reductions), into a pinned staging buffer; an event marks the end of
  the copy. Nothing on the host waits yet: backward goes on. ``finish`` (called before anything reads
  a gradient: clipping, the non-finite check, the step) waits for each event and adds (or, for the
  first reduction of a step, converts) the staged values into the fp32 shard gradient on the host;
  the device tensor is kept alive for the side stream by ``record_stream``.
- parameters up: after the host step of a unit its master is written into a pinned staging buffer in
  the compute dtype and copied host->device on the compute stream, so the all-gather and the next
  forward, queued behind it, see the new values while the host steps the next unit. The staging buffer
  returns to the pool once its event has completed (checked in ``finish``).
- stage-3 parameter shards (``offload_param``): each unit's pinned shard is copied to the device on the
  compute stream inside the gather (and so inside the prefetch), just before its all-gather.

When the model computes on the CPU (this project's test machine) the "device" is the host: the store
still keeps separate tensors and runs the same staging, landing and publishing logic, with
synchronous copies, so the CPU tests exercise the logic that CUDA runs with streams.

Pinned memory can fail to allocate (page-locked memory is limited on small hosts). The store then
goes on with pageable memory for the rest of the run, with one warning naming
``pin_memory: false``: training continues with slower, synchronous copies instead of stopping a run
that has everything else it needs.
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any, NamedTuple, Optional, Protocol

import torch
from torch import Tensor


class ShardStore(Protocol):
    """See [Note: shard stores]."""

    name: str  # the memory this store's tensors occupy: "device" or "cpu"

    def hold(self, values: Tensor) -> Tensor:
        """A copy of ``values`` (1-D) kept in this store."""
        ...

    def hold_master(self, values: Tensor, alias_ok: bool) -> Tensor:
        """The tensor the optimizer steps, holding ``values`` (1-D). ``alias_ok``: ``values`` may be used
        as it is (full precision at stages 1-2, where the master is the owned slice of the parameters)."""
        ...

    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        """Add one reduced gradient shard into ``held`` (None: the first reduction since the step; the
        result replaces it); returns the tensor that holds the sum, in ``dtype``, once :meth:`finish` ran."""
        ...

    def publish(self, master: Tensor, compute: Tensor) -> None:
        """Write the stepped master into the compute-dtype shard that the next all-gather reads."""
        ...

    def fetch(self, shard: Tensor, device: torch.device) -> Tensor:
        """``shard`` (this store's parameter shard) as a tensor on ``device`` for an all-gather to read."""
        ...

    def finish(self) -> None:
        """Complete every copy in flight: landed gradients hold their sums afterwards."""
        ...


class DeviceStore:
    """Everything on the compute device."""

    name = "device"

    def hold(self, values: Tensor) -> Tensor:
        return values.clone()

    def hold_master(self, values: Tensor, alias_ok: bool) -> Tensor:
        return values if alias_ok else values.clone()

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

    def fetch(self, shard: Tensor, device: torch.device) -> Tensor:
        return shard

    def finish(self) -> None:
        pass


class _Landing(NamedTuple):
    """A gradient copy to complete in ``HostStore.finish``."""

    event: Any  # torch.cuda.Event marking the end of the device->host copy; None when synchronous
    staged: Tensor  # the reduced values on the host (a staging buffer), or ``held`` itself when copied there
    held: Tensor  # the fp32 host shard gradient
    add: bool  # add into ``held``; False: ``held`` takes the staged values (the first reduction of a step)


class HostStore:
    """Shard state in host memory. See [Note: host store copies]."""

    name = "cpu"

    def __init__(self, device: torch.device, pin_memory: bool = True) -> None:
        self.device = device  # where the model computes
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda  # nothing to pin for copies between host tensors
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._landings: list[_Landing] = []
        self._publishing: list[tuple[Any, Optional[Tensor]]] = []  # (event, staging buffer) of copies to the device
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = collections.defaultdict(list)

    # --- memory ------------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A host tensor, page-locked when copies to and from a GPU read it (see the Note on failures)."""
        if self.pin:
            try:
                return self._pinned(numel, dtype)
            except RuntimeError as err:
                self.pin = False
                warnings.warn(
                    f"lzero could not allocate {numel * torch.empty((), dtype=dtype).element_size():,} bytes of"
                    f" pinned host memory ({str(err).splitlines()[0]}); offload goes on with pageable memory, whose"
                    " copies are synchronous and slower. HINT: set `pin_memory: false` in `offload_optimizer` /"
                    " `offload_param` to start with pageable memory, or raise the page-locked memory limit.",
                    stacklevel=2,
                )
        return torch.empty(numel, dtype=dtype)

    def _pinned(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def _staging(self, numel: int, dtype: torch.dtype) -> Tensor:
        free = self._free[(numel, dtype)]
        return free.pop() if free else self.empty(numel, dtype)

    def _recycle(self, buffer: Tensor) -> None:
        self._free[(buffer.numel(), buffer.dtype)].append(buffer)

    def hold(self, values: Tensor) -> Tensor:
        out = self.empty(values.numel(), values.dtype)
        out.copy_(values.reshape(-1))
        return out

    def hold_master(self, values: Tensor, alias_ok: bool) -> Tensor:
        return self.hold(values)  # never the device's parameters themselves

    # --- gradients down ----------------------------------------------------------------------

    @torch.no_grad()
    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype) -> Tensor:
        add = held is not None
        if held is None:
            held = self.empty(reduced.numel(), dtype)
        if not self.cuda:  # the "device" is the host: the reduced tensor is already host memory
            self._landings.append(_Landing(None, reduced, held, add))
            return held
        direct = not add and reduced.dtype == dtype and self.pin  # straight into the gradient, no staging
        staged = held if direct else self._staging(reduced.numel(), reduced.dtype)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            staged.copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        reduced.record_stream(self.copy_stream)  # its device memory stays allocated until the copy ran
        self._landings.append(_Landing(event, staged, held, add))
        return held

    @torch.no_grad()
    def finish(self) -> None:
        landings, self._landings = self._landings, []
        for landing in landings:
            if landing.event is not None:
                landing.event.synchronize()
            if landing.staged is not landing.held:
                if landing.add:
                    landing.held.add_(landing.staged)
                else:
                    landing.held.copy_(landing.staged)
                if landing.event is not None:
                    self._recycle(landing.staged)
        publishing, self._publishing = self._publishing, []
        for event, staging in publishing:
            event.synchronize()
            if staging is not None:
                self._recycle(staging)

    # --- parameters up -----------------------------------------------------------------------

    @torch.no_grad()
    def publish(self, master: Tensor, compute: Tensor) -> None:
        if compute.device.type != "cuda":  # host to host (CPU model, or offloaded stage-3 parameter shards)
            if compute.data_ptr() != master.data_ptr():
                compute.copy_(master)
            return
        source = master
        if master.dtype != compute.dtype or not master.is_pinned():
            source = self._staging(master.numel(), compute.dtype)
            source.copy_(master)  # the cast to the compute dtype runs on the host, before the copy
        compute.copy_(source, non_blocking=True)  # on the compute stream: the all-gather queues behind it
        event = torch.cuda.Event()  # the master (or staging) is not written again before this copy ran
        event.record(torch.cuda.current_stream(compute.device))
        self._publishing.append((event, source if source is not master else None))

    def fetch(self, shard: Tensor, device: torch.device) -> Tensor:
        out = torch.empty(shard.numel(), dtype=shard.dtype, device=device)
        out.copy_(shard, non_blocking=shard.is_pinned())  # on the compute stream, before the all-gather
        return out


def stores_for(config: Any, device: torch.device, numels: list[int]) -> tuple[list[ShardStore], ShardStore]:
    """The optimizer store of each unit (``numels``: their sizes, in unit order) and the parameter store,
    as ``config.offload_optimizer`` / ``config.offload_param`` ask. With ``offload_optimizer.ratio`` < 1 the
    first units, up to ``1 - ratio`` of the elements, keep their state on the device (DeepSpeed's Twin-Flow)."""
    device_store = DeviceStore()
    optimizer_offload, param_offload = config.offload_optimizer, config.offload_param
    host = None
    if optimizer_offload.device == "cpu" or param_offload.device == "cpu":
        pin = optimizer_offload.pin_memory if optimizer_offload.device == "cpu" else param_offload.pin_memory
        host = HostStore(device, pin)
    param_store = host if param_offload.device == "cpu" else device_store
    if optimizer_offload.device != "cpu":
        return [device_store] * len(numels), param_store
    on_device = (1.0 - optimizer_offload.ratio) * sum(numels)
    stores, before = [], 0
    for numel in numels:
        stores.append(device_store if before + numel <= on_device else host)
        before += numel
    return stores, param_store


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
