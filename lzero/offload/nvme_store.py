"""NVMe offload of the optimizer (ZeRO-Infinity, ``offload_optimizer: {device: nvme}``): each unit's fp32 master
and optimizer state live in swap files and are in host memory only while the unit is resident.

[Note: resident units]
Between uses an NVMe unit's ``master_shard`` holds a placeholder of its real shape and no memory (one shared
element, expanded), and so do the per-element tensors of its optimizer state (Adam's moments); scalars such
as ``step`` stay in memory. Whoever reads or writes the master or the state enters ``unit.resident(write)``
(see ``ShardStore.resident`` in store.py): entering reads the unit's files into page-aligned buffers
(:func:`lzero.offload.nvme.aligned_empty`) and puts them in place; leaving with ``write`` writes every per-element
tensor back, then puts the placeholders back. Tensors the optimizer or a checkpoint load created inside the
block (the first step's moments) are copied into aligned buffers to be written; from then on the unit has
files for them. Nesting is allowed (the step is resident for its bucket, and a checkpoint load inside
it); the outermost block reads and writes.

The step (``ZeroEngine.step_and_gather``) walks the units in groups of at most ``sub_group_size``
elements: with ``pipeline_read`` the next group's reads are started before the current group steps, and
with ``pipeline_write`` a group's writes are left in flight while the next group steps (otherwise each
group waits for its writes). At most ``buffer_count`` units have buffers at once (reading, resident or
writing); beyond that the oldest write is waited for. A unit is never read while its last write is in
flight. The shard gradients stay in host memory (as for ``offload_optimizer: cpu``; they exist only from
a backward to its step), and so host memory holds only gradients, buffers and scalars, never the whole
optimizer state.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from lzero.offload.nvme import SwapFiles, aligned_empty
from lzero.offload.store import HostStore


class NvmeStore(HostStore):
    """See [Note: resident units]. Gradients and copies as :class:`lzero.offload.store.HostStore`."""

    name = "nvme"
    in_memory = False

    def __init__(self, device: torch.device, files: SwapFiles, pin_memory: bool = True, buffer_count: int = 4,
                 pipeline_read: bool = False, pipeline_write: bool = False, max_in_cpu: int = 0,
                 initial_bytes: int = 0) -> None:
        super().__init__(device, pin_memory)
        self.progress = Progress(files.rank == 0, "writing the initial state to the swap files", initial_bytes)
        self.max_in_cpu = max_in_cpu  # parameter elements (offload_param) kept in host memory instead of files
        self._in_cpu = 0
        self.files = files
        self.buffer_count = buffer_count
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self._on_disk: dict[int, dict[str, tuple[int, torch.dtype]]] = {}  # unit -> name -> (numel, dtype)
        self._states: dict[int, Callable[[], dict[str, Any]]] = {}  # unit -> its optimizer state dict
        self._reads: dict[int, dict[str, tuple[Future, Tensor]]] = {}  # started reads, by unit
        self._writes: collections.deque[tuple[int, list[Future], list[Tensor]]] = collections.deque()
        self._active: dict[int, bool] = {}  # resident units -> whether to write back
        self._owned: dict[int, Tensor] = {}  # data_ptr -> an aligned buffer of this store in use
        self._pool: list[Tensor] = []  # free buffers, most recently released last, at most ``buffer_count``

    # --- files -------------------------------------------------------------------------------

    @staticmethod
    def _key(index: int, name: str) -> str:
        return f"unit{index}.{name}"

    def _buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        """An aligned buffer, reused from the pool when one of the size is free: a fresh one costs page faults
        (the kernel zero-fills every page an O_DIRECT read lands in), about as long as the read itself."""
        found = next((i for i in range(len(self._pool) - 1, -1, -1)
                      if self._pool[i].numel() == numel and self._pool[i].dtype == dtype), None)
        buffer = self._pool.pop(found) if found is not None else aligned_empty(numel, dtype)
        self._owned[buffer.data_ptr()] = buffer
        return buffer

    def _release(self, tensor: Tensor) -> None:
        """``tensor`` (a buffer of this store, or a view at its start) is no longer in use: back to the pool, which
        keeps the ``buffer_count`` most recently released buffers (host memory stays bounded)."""
        buffer = self._owned.pop(tensor.data_ptr(), None)
        if buffer is not None:
            self._pool.append(buffer)
            del self._pool[: -self.buffer_count]

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers and of this store's aligned buffers (in use or pooled)."""
        mine = sum(b.untyped_storage().nbytes() for b in [*self._pool, *self._owned.values()])
        return super().staging_bytes() + mine

    def _write(self, index: int, tensors: dict[str, Tensor], give: bool = False) -> None:
        """Write ``tensors`` (name -> 1-D tensor) as the unit's files; waits as ``pipeline_write`` and
        ``buffer_count`` say. ``give``: the caller gives up the store's buffers among them, which are written
        as they are and then return to the pool; otherwise every tensor is first copied into a buffer."""
        self._wait_writes(index)  # a file is never written while its last write is in flight
        futures, buffers = [], []
        for name, tensor in tensors.items():
            if give and tensor.data_ptr() in self._owned:
                buffer = tensor
            else:
                buffer = self._buffer(tensor.numel(), tensor.dtype)
                buffer.copy_(tensor)
            futures.append(self.files.write(self._key(index, name), buffer))
            buffers.append(buffer)
            self.progress.add(buffer.numel() * buffer.element_size())
            self._on_disk.setdefault(index, {})[name] = (tensor.numel(), tensor.dtype)
        self._writes.append((index, futures, buffers))
        self._bound(keep=self.buffer_count if self.pipeline_write else 0)

    def _bound(self, keep: int) -> None:
        """Complete the oldest writes until at most ``keep`` units' writes are in flight."""
        while len(self._writes) > keep:
            self._complete_write(self._writes.popleft())

    def _complete_write(self, write: tuple[int, list[Future], list[Tensor]]) -> None:
        _, futures, buffers = write
        for future in futures:
            future.result()  # an NvmeError (ENOSPC...) surfaces here, naming the file
        for buffer in buffers:
            self._release(buffer)

    def _wait_writes(self, index: int) -> None:
        pending = [w for w in self._writes if w[0] == index]
        for write in pending:
            self._writes.remove(write)
            self._complete_write(write)

    def prefetch(self, unit: Any) -> None:
        """Start reading ``unit``'s files (``pipeline_read``: the next group, while this one steps)."""
        if self.pipeline_read and unit.spec.index not in self._reads and unit.spec.index not in self._active:
            self._start_read(unit.spec.index)

    def _start_read(self, index: int) -> None:
        self._wait_writes(index)
        self._bound(keep=max(0, self.buffer_count - 1 - len(self._reads)))
        reads = {}
        for name, (numel, dtype) in self._on_disk.get(index, {}).items():
            if name == "param":  # read by fetch, for gathers; not part of a resident unit
                continue
            buffer = self._buffer(numel, dtype)
            reads[name] = (self.files.read(self._key(index, name), buffer), buffer)
        self._reads[index] = reads

    def _take(self, index: int) -> dict[str, Tensor]:
        if index not in self._reads:
            self._start_read(index)
        out = {}
        for name, (future, buffer) in self._reads.pop(index).items():
            future.result()
            out[name] = buffer
            self.progress.add(buffer.numel() * buffer.element_size())
        return out

    # --- the store ---------------------------------------------------------------------------

    def hold_master(self, values: Tensor, alias_ok: bool, key: str) -> Tensor:
        index = int(key.removeprefix("unit"))
        self._write(index, {"master": values.reshape(-1)})
        return _placeholder(values.dtype).expand(values.numel())

    def hold(self, values: Tensor, key: str = "") -> Tensor:
        """A parameter shard (``unit<i>.param``, or a frozen unit's ``unit<i>.master``): in host memory while
        ``max_in_cpu`` elements allow, else in its file (a placeholder is returned)."""
        if self._in_cpu + values.numel() <= self.max_in_cpu:
            self._in_cpu += values.numel()
            return HostStore.hold(self, values)
        index, name = key.removeprefix("unit").split(".")
        self._write(int(index), {name: values.reshape(-1)})
        return _placeholder(values.dtype).expand(values.numel())

    def holds_in_file(self, unit: Any) -> bool:
        names = self._on_disk.get(unit.spec.index, {})
        return "param" in names or (unit.spec.frozen and "master" in names)

    def write_param(self, unit: Any, values: Tensor) -> None:
        """Write ``values`` (the stepped master, or written full parameters) into the unit's parameter file, cast
        to its dtype."""
        name = "param" if "param" in self._on_disk.get(unit.spec.index, {}) else "master"
        _, dtype = self._on_disk[unit.spec.index][name]
        self._write(unit.spec.index, {name: values.reshape(-1).to(dtype)})

    @torch.no_grad()
    def fetch(self, unit: Any, device: torch.device) -> Tensor:
        if not self.holds_in_file(unit):
            return super().fetch(unit, device)
        index = unit.spec.index
        name = "param" if "param" in self._on_disk[index] else "master"
        numel, dtype = self._on_disk[index][name]
        self._wait_writes(index)
        buffer = self._buffer(numel, dtype)
        self.files.read(self._key(index, name), buffer).result()
        try:
            return self._to_device(buffer, device, blocking=True)  # the buffer goes back to the pool at once
        finally:
            self._release(buffer)

    def bind_state(self, unit: Any, state: Callable[[], dict[str, Any]]) -> None:
        """``state()`` is the optimizer state dict of ``unit``'s master (its inner optimizer's)."""
        self._states[unit.spec.index] = state

    @contextlib.contextmanager
    def resident(self, unit: Any, write: bool) -> Iterator[None]:
        index = unit.spec.index
        if index in self._active:  # nested: the outer block reads and writes
            self._active[index] = self._active[index] or write
            yield
            return
        if "master" not in self._on_disk.get(index, {}):  # a frozen shard kept in host memory (max_in_cpu)
            yield
            return
        self._active[index] = write
        if self.progress.total:  # the initial write-out is over
            self.progress.done_with("swap file traffic")
        buffers = self._take(index)
        master = unit.master_shard
        master.data = buffers.pop("master")
        state = self._state(index)
        if state is not None:
            state.update(buffers)
            _refuse_placeholders(unit, state)
        failed = False
        try:
            yield
        except BaseException:
            failed = True  # the files keep the values from before the block; a failing write is not retried
            raise
        finally:
            write = self._active.pop(index) and not failed
            numel = unit.spec.shard_numel
            state = self._state(index)  # the current dict: a checkpoint load may have replaced it inside
            per_element = {name: value for name, value in (state or {}).items()
                           if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == numel}
            if write:
                self._write(index, {"master": master.detach(), **{k: v.detach() for k, v in per_element.items()}},
                            give=True)
                swapped = per_element
            else:  # only what came from the files goes back to placeholders; the rest has no file yet
                swapped = {name: value for name, value in per_element.items() if name in buffers}
                for tensor in [master.data, *swapped.values()]:
                    self._release(tensor)
            master.data = _placeholder(master.dtype).expand(numel)
            for name, value in swapped.items():
                state[name] = _placeholder(value.dtype).expand(numel)

    def _state(self, index: int) -> Any:
        return self._states[index]() if index in self._states else None

    def close(self) -> None:
        """Wait for the writes in flight and remove this rank's swap folder (end of fit, or after a failure)."""
        try:
            for write in list(self._writes):
                for future in write[1]:
                    future.exception()  # waited for; an error no longer matters
        finally:
            self._writes.clear()
            self._reads.clear()
            self.files.remove()

    def bytes_on_disk(self) -> dict[str, int]:
        """Bytes of this rank's swap files by kind (parameters, masters, optimizer state)."""
        out = {"parameters": 0, "masters": 0, "optimizer_state": 0}
        for names in self._on_disk.values():
            for name, (numel, dtype) in names.items():
                kind = {"master": "masters", "param": "parameters"}.get(name, "optimizer_state")
                out[kind] += numel * torch.empty((), dtype=dtype).element_size()
        return out


class Progress:
    """On rank 0, one line every ``every_s`` seconds while swap-file work goes on for longer than that (the
    initial write-out of a large state, a checkpoint read from or written through the swap files), so a long
    silent phase is not taken for a hang."""

    def __init__(self, show: bool, what: str, total: int = 0, every_s: float = 10.0) -> None:
        self.show, self.every_s = show, every_s
        self.done_with(what, total)

    def done_with(self, what: str, total: int = 0) -> None:
        """Start counting a new phase."""
        self.what, self.total, self.bytes = what, total, 0
        self.start = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        now = time.monotonic()
        if self.show and now - self.last >= self.every_s:
            self.last = now
            of = f" of {self.total / 1e9:.2f} GB" if self.total else " GB"
            print(f"lzero NVMe: {self.what}: {self.bytes / 1e9:.2f}{of} in {now - self.start:.0f} s",
                  file=sys.stderr, flush=True)


def _refuse_placeholders(unit: Any, state: dict[str, Any]) -> None:
    """A per-element state tensor still a placeholder here has no file: stepping it would write through one shared
    element. Refuse rather than corrupt memory."""
    for name, value in state.items():
        if isinstance(value, Tensor) and value.dim() == 1 and value.numel() > 1 and value.stride() == (0,):
            raise RuntimeError(
                f"lzero NVMe offload: the optimizer state `{name}` of the unit holding `{unit.spec.params[0].name}` has"
                " no swap file (it was dropped without being written). This is a bug in lzero; please report it."
            )


_PLACEHOLDERS: dict[torch.dtype, Tensor] = {}


def _placeholder(dtype: torch.dtype) -> Tensor:
    """One element per dtype, expanded to a shard's shape between uses (no memory behind the shape)."""
    if dtype not in _PLACEHOLDERS:
        _PLACEHOLDERS[dtype] = torch.zeros(1, dtype=dtype)
    return _PLACEHOLDERS[dtype]
