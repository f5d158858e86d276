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
The host store keeps its tensors (masters, shard gradients, optimizer state, stage-3 parameter shards) in host
memory, in buffers that live for the run (see [Note: persistent host buffers] in host_memory.py): each unit's fp32
shard gradient (a second one while the delayed update's step reads the first), its master and, when a GPU takes the
published values, an outgoing buffer in the compute dtype. On CUDA those that copies read or write are page-locked,
and every copy runs ``non_blocking``. The rule that shapes the rest: nothing inside backward's hooks waits for the
host or does arithmetic on the host, since while a hook waits, backward launches no kernel.

- gradients down: a reduced shard gradient is cast to fp32 on the device and copied into the unit's page-locked
  gradient buffer, on a side stream that first waits for the compute stream (where the reduction's result is
  ready); ``record_stream`` keeps the device tensor allocated until the copy ran. A later reduction of the same step
  (gradient accumulation at stage 2-3) brings the sum so far back up, adds on the device and copies the new sum down:
  twice the bus traffic of that landing, no host arithmetic. The device also computes each landed gradient's sum and
  squared norm (``GRAD_STATS``): the non-finite check and the clipping norm read those (``grad_stat``), so the host
  never rereads gradients for them. ``finish`` waits for the last copy's event, once, where the step needs the
  gradients (never in a hook).
- parameters up: after the host step of a bucket, each master is cast to the compute dtype into its outgoing
  buffer (``cast_for_publish``; the delayed update's worker does it right after the bucket's step) and uploaded on the
  compute stream, so the all-gather and the next forward, queued behind it, see the new values while the host steps
  the next bucket. Before the next cast into that buffer, the host waits for its upload's event.
- stage-3 parameter shards (``offload_param``): each unit's shard (page-locked) is copied to the device on the side
  stream, which first waits for the compute stream (the gather's target memory is then free); the unit's all-gather
  is launched from the side stream too, so both run while the compute stream computes the current unit (the gather
  is launched by the prefetch, a unit early). The compute stream waits for the all-gather (and for an event after
  the copy) only when it gathers the unit. The publish casts straight into the shard, after waiting for the copy
  that reads it; under the delayed update the worker casts into the outgoing buffer while the next forward reads the
  shard, and the publish swaps the two buffers' memory.

When the model computes on the CPU (this project's test machine) the "device" is the host: a landing is the copy
(or the sum) into the persistent gradient buffer and a publish the cast into the parameters, with no streams and no
events; the same code runs on CUDA's path with stand-ins for streams, events and page-locked memory in
tests/offload/test_offload_cuda_path.py.

A page-locked buffer can fail to allocate. The store then goes on with pageable buffers for the rest of the run,
with one warning naming ``pin_memory: false``: training continues with slower, synchronous copies instead of
stopping a run that has everything else it needs.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, ContextManager, Optional, Protocol

import torch
from torch import Tensor

from lzero.offload.host_memory import host_empty, unregister


KINDS = ("parameters", "gradients", "masters", "optimizer_state", "buffers", "averages")
"""The kinds of model-state memory a rank holds, in the order memory accounting claims a storage; ``buffers``: the
offload stores' staging and swap buffers (see [Note: host store copies]); ``averages``: a weight-averaging callback's
averaged shards (see [Note: averaged shards] in lzero/engine/averaged.py)."""


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

    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype, key: str = "",
                  busy: Optional[Tensor] = None) -> Tensor:
        """Add one reduced gradient shard into ``held`` (None: the first reduction since the step; the
        result replaces it); returns the tensor that holds the sum, in ``dtype``, once :meth:`finish` ran.
        ``key`` names the unit; ``busy``: a gradient of the unit that the delayed update's step still reads."""
        ...

    def grad_stat(self, held: Tensor, key: str, which: str) -> Optional[Tensor]:
        """``GRAD_STATS[which]`` of ``held``, where the store computed it while landing it; None: compute it from
        ``held``."""
        ...

    def publish(self, master: Tensor, compute: Tensor, key: str = "", own: bool = False) -> None:
        """Write the stepped master into the compute-dtype shard that the next all-gather reads (``own``: that
        shard is this store's own tensor, whose memory it may exchange)."""
        ...

    def cast_for_publish(self, master: Tensor, compute: Tensor, key: str) -> None:
        """The host side of :meth:`publish`, done ahead (the delayed update's worker, right after the step); a no-op
        for stores whose publish needs no cast ahead."""
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
    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype, key: str = "",
                  busy: Optional[Tensor] = None) -> Tensor:
        if held is None:
            return reduced.to(dtype)
        held.add_(reduced)
        return held

    def grad_stat(self, held: Tensor, key: str, which: str) -> Optional[Tensor]:
        return None

    @torch.no_grad()
    def publish(self, master: Tensor, compute: Tensor, key: str = "", own: bool = False) -> None:
        if compute.data_ptr() != master.data_ptr():
            compute.copy_(master)

    def cast_for_publish(self, master: Tensor, compute: Tensor, key: str) -> None:
        pass

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


GRAD_STATS = {
    "sum": lambda g: g.sum(dtype=torch.float32),
    "sq_norm": lambda g: torch.linalg.vector_norm(g, dtype=torch.float64).square(),
}
"""What the step asks of a unit's reduced gradient besides the gradient itself: its sum (the non-finite check, see
``ZeroEngine.found_nonfinite``) and its squared L2 norm in fp64 (the clipping norm). A store that copies gradients off
the device computes both there, before the copy (see [Note: host store copies])."""


class HostStore:
    """Shard state in host memory. See [Note: host store copies] and [Note: persistent host buffers]."""

    name = "cpu"
    memory = "cpu"
    in_memory = True

    def __init__(self, device: torch.device, pin_memory: bool = True, huge_pages: bool = False) -> None:
        self.device = device  # where the model computes
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda  # nothing to pin for copies between host tensors
        self.huge_pages = huge_pages
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._grads: dict[str, list[Tensor]] = {}  # unit key -> its fp32 shard gradient buffers (2: delayed update)
        self._outgoing: dict[str, Tensor] = {}  # unit key -> the compute-dtype buffer a publish casts into
        self._cast: set[str] = set()  # keys whose outgoing buffer holds a cast not yet published
        self._stats: dict[str, tuple[Tensor, int, dict[str, Tensor]]] = {}  # key -> (held, its version, GRAD_STATS)
        self._landed: Any = None  # CUDA: event after the last gradient copy enqueued
        self._uploading: dict[str, Any] = {}  # key -> event after the upload that reads its outgoing buffer
        self._read_by: dict[int, Any] = {}  # data_ptr of a host shard -> event after the copy that reads it
        self._registered: list[Tensor] = []  # page-locked buffers to unregister at close
        self.copied = {"to_host": 0, "to_device": 0}  # bytes copied since the start (the memory monitor logs them)

    # --- memory ------------------------------------------------------------------------------

    def _persistent(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A buffer kept for the run ([Note: persistent host buffers]): page-locked when a GPU copies it, unless a
        page-locked allocation failed before (then pageable, after one warning)."""
        nbytes = numel * dtype.itemsize
        if self.pin:
            try:
                buffer = self._pinned(nbytes)
                self._registered.append(buffer)
                return buffer.view(dtype)
            except RuntimeError as err:
                self.pin = False
                warnings.warn(
                    f"lzero could not allocate {nbytes:,} bytes of"
                    f" pinned host memory ({str(err).splitlines()[0]}); offload goes on with pageable memory, whose"
                    " copies are synchronous and slower. HINT: set `pin_memory: false` in `offload_optimizer` /"
                    " `offload_param` to start with pageable memory, or raise the page-locked memory limit.",
                    stacklevel=3,
                )
        return host_empty(nbytes, huge_pages=self.huge_pages).view(dtype)

    def _pinned(self, nbytes: int) -> Tensor:
        return host_empty(nbytes, pin=True, huge_pages=self.huge_pages)

    def staging_bytes(self) -> int:
        """Bytes of this store's buffers that hold no model state: the outgoing compute-dtype copies."""
        return sum(t.numel() * t.element_size() for t in list(self._outgoing.values()))

    def gradient_buffers(self) -> list[Tensor]:
        """The persistent fp32 shard gradient buffers (the memory accounting counts them as gradients)."""
        return [t for buffers in list(self._grads.values()) for t in buffers]

    def hold(self, values: Tensor, key: str = "") -> Tensor:
        out = self._persistent(values.numel(), values.dtype)  # stage-3 parameter shards: gathers copy them up
        out.copy_(values.reshape(-1))
        return out

    def holds_in_file(self, unit: Any) -> bool:
        return False

    def hold_master(self, values: Tensor, alias_ok: bool, key: str) -> Tensor:
        # never the device's parameters themselves; page-locked too: in fp32 at stage 3 the master is the parameter
        # shard that gathers copy up
        return HostStore.hold(self, values)

    def resident(self, unit: Any, write: bool) -> ContextManager[None]:
        return contextlib.nullcontext()

    # --- gradients down ----------------------------------------------------------------------

    def _grad_buffer(self, key: str, numel: int, dtype: torch.dtype, busy: Optional[Tensor]) -> Tensor:
        """``key``'s persistent gradient buffer that ``busy`` (the delayed update's step in flight) is not."""
        buffers = self._grads.setdefault(key, [])
        for buffer in buffers:
            if buffer is not busy and buffer.numel() == numel and buffer.dtype == dtype:
                return buffer
        buffers.append(self._persistent(numel, dtype))
        return buffers[-1]

    @torch.no_grad()
    def land_grad(self, held: Optional[Tensor], reduced: Tensor, dtype: torch.dtype, key: str = "",
                  busy: Optional[Tensor] = None) -> Tensor:
        add = held is not None
        if held is None:
            held = self._grad_buffer(key, reduced.numel(), dtype, busy)
        self.copied["to_host"] += reduced.numel() * dtype.itemsize
        if not self.cuda:  # the "device" is this host: the landing is the copy itself
            if add:
                held.add_(reduced)
            else:
                held.copy_(reduced)
            return held
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the reduction's result is ready
        with torch.cuda.stream(self.copy_stream):
            grad = reduced.to(dtype)  # cast on the device
            if add:  # accumulate on the device: the sum so far comes up, the new sum goes down
                grad = grad + held.to(self.device, non_blocking=True)
            stats = {which: term(grad) for which, term in GRAD_STATS.items()}
            held.copy_(grad, non_blocking=True)
            self._landed = torch.cuda.Event()
            self._landed.record(self.copy_stream)
        reduced.record_stream(self.copy_stream)  # its device memory stays allocated until the copy ran
        self._stats[key] = (held, held._version, stats)
        return held

    def grad_stat(self, held: Tensor, key: str, which: str) -> Optional[Tensor]:
        """``GRAD_STATS[which]`` of ``held`` as the device computed it at its last landing; None when the device did
        not (a CPU model: the gradient is in the memory the model computes in), or ``held`` changed since
        (clipping, a cleared gradient): then the caller computes it from ``held``."""
        entry = self._stats.get(key)
        if entry is None or entry[0] is not held or entry[1] != held._version:
            return None
        stat = entry[2][which]
        if self.cuda:  # made on the side stream, read on the compute stream: not reused before that read ran
            stat.record_stream(torch.cuda.current_stream(self.device))
        return stat

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the gradient copies in flight (called by the step, never inside backward's hooks)."""
        if self._landed is not None:
            self._landed.synchronize()
            self._landed = None

    def prefetch(self, unit: Any) -> None:
        pass

    def bind_state(self, unit: Any, state: Any) -> None:
        pass

    def close(self) -> None:
        self.finish()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # no copy still reads a buffer about to go
            for buffer in self._registered:
                unregister(buffer)
        self._registered.clear()
        self._grads.clear()
        self._outgoing.clear()
        self._stats.clear()

    # --- parameters up -----------------------------------------------------------------------

    def _wait_reads(self, shard: Tensor) -> None:
        """Before the host writes ``shard``: the copy that reads it (a gather's fetch) has run."""
        event = self._read_by.pop(shard.data_ptr(), None)
        if event is not None:
            event.synchronize()

    @torch.no_grad()
    def cast_for_publish(self, master: Tensor, compute: Tensor, key: str) -> None:
        """Cast the stepped ``master`` into ``key``'s outgoing buffer (compute dtype), ready for :meth:`publish`. Host
        work only: the delayed update's worker runs it right after the unit's step."""
        self._cast_outgoing(master, compute, key)
        self._cast.add(key)

    def _cast_outgoing(self, master: Tensor, compute: Tensor, key: str) -> Tensor:
        """``master`` cast into ``key``'s outgoing buffer (allocated at first use), once its last upload has run."""
        out = self._outgoing.get(key)
        if out is None:
            out = self._outgoing[key] = self._persistent(compute.numel(), compute.dtype)
        event = self._uploading.pop(key, None)
        if event is not None:  # the previous upload from this buffer has run
            event.synchronize()
        out.copy_(master)
        return out

    @torch.no_grad()
    def publish(self, master: Tensor, compute: Tensor, key: str = "", own: bool = False) -> None:
        """``compute`` takes the stepped ``master``'s values: on a GPU an upload from the outgoing buffer, enqueued on
        the compute stream (the gather queues behind it); in host memory (a CPU model, offloaded stage-3 parameter
        shards) the cast itself, or the outgoing buffer's storage when :meth:`cast_for_publish` ran already."""
        if compute.data_ptr() == master.data_ptr():
            return
        self.copied["to_device"] += compute.numel() * compute.element_size()
        cast = key in self._cast
        self._cast.discard(key)
        if compute.device.type != "cuda":
            self._wait_reads(compute)
            if cast and own:  # the worker's cast becomes the shard: swap the two buffers, no copy
                _swap_storage(compute, self._outgoing[key])
            elif cast:
                compute.copy_(self._outgoing[key])
            else:
                compute.copy_(master)
            return
        out = self._outgoing[key] if cast else self._cast_outgoing(master, compute, key)
        stream = torch.cuda.current_stream(compute.device)
        with torch.cuda.stream(stream):
            compute.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._uploading[key] = event

    def fetch(self, unit: Any, device: torch.device) -> Tensor:
        return self._to_device(unit.compute_shard(), device)

    @torch.no_grad()
    def _to_device(self, shard: Tensor, device: torch.device, blocking: bool = False) -> Tensor:
        """A host shard copied to a new tensor on ``device``; on CUDA on the side stream, straight from the shard
        (page-locked), unless ``blocking`` (the shard's memory is reused as soon as this returns)."""
        out = torch.empty(shard.numel(), dtype=shard.dtype, device=device)  # allocated on the compute stream
        self.copied["to_device"] += shard.numel() * shard.element_size()
        if not self.cuda:
            out.copy_(shard)
            return out
        # the side stream waits for the compute stream: ``out`` and the gather's target are free to write
        self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.copy_stream):
            out.copy_(shard, non_blocking=not blocking)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        if not blocking:
            self._read_by[shard.data_ptr()] = event
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


def _swap_storage(a: Tensor, b: Tensor) -> None:
    """``a`` and ``b`` (same shape and dtype) exchange their memory; both stay the same tensor objects."""
    a_storage, a_offset = a.untyped_storage(), a.storage_offset()
    a.set_(b.untyped_storage(), b.storage_offset(), b.shape, b.stride())
    b.set_(a_storage, a_offset, a.shape, a.stride())


def divide_host_threads(local_processes: int, requested: int = 0) -> Optional[int]:
    """Set the host optimizer step's threads (torch's intra-op threads): ``requested``
    (``offload_optimizer.host_threads``) or, for 0, each of the ``local_processes`` processes of this host an equal
    share of its CPU cores (torch's default, one thread per core in every process, oversubscribes the host). Returns
    the new thread count, or None when the current one is already within the share."""
    if requested:
        torch.set_num_threads(requested)
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    share = max(1, cores // max(1, local_processes))
    if torch.get_num_threads() <= share:
        return None
    torch.set_num_threads(share)
    return share
