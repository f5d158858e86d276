"""A recorded construction run on real tensors: eager-exact initialization of a model built on the meta device.

[Note: replayed construction]
Built on the meta device (zero3's ``configure_model``, ``init_module(empty_init=True)``), a model draws no random
numbers: an initializer on a meta tensor computes nothing. Initializing it afterwards, block by block, draws other
numbers than the same code run eagerly under DDP from the same seed. So while lzero's meta context is open, a
:class:`Recorder` (a ``TorchDispatchMode``, recording.py) builds the model on fake tensors ([Note: a fake device]
in recording.py) and writes down every operation that creates or writes storage: factories (``empty``),
initializers (``uniform_``, ``normal_``, ``fill_``, ...), copies between tensors (tied or derived weights), casts
(``.to(dtype)``), with each tensor argument as (storage, dtype, size, stride, offset). View operations are not
recorded: a later use names the storage and the geometry it reads. The few ``torch.nn.init`` functions that skip meta
tensors in Python (``trunc_normal_``, ``orthogonal_``, ``dirac_``, ``sparse_``) are recorded as the call itself on
meta tensors; on fake tensors only ``trunc_normal_``'s value-reading loop is. The RNG state of the CPU (and of the
current CUDA device) is taken when the context opens.

At setup :class:`Replay` runs the record on real tensors, on every rank, from rank 0's RNG state: the same draws in
the same order as eager construction, so every parameter and buffer is bitwise what eager construction gives. Each
rank keeps only the pieces of its own shards (``owned``) and whole tensors outside the units (buffers), which the
engine then reads as it reads a pretrained checkpoint (``WeightSource``). Memory stays near one tensor at a time:
- a storage exists from the record's first write of a *version* (a ``create`` or an overwrite that reads nothing of
  it) to the last operation touching that version; a version overwritten later without being read (``nn.Linear``'s
  own ``reset_parameters`` draw, redrawn by Hugging Face's ``post_init``) is replayed into storage freed right after,
  so it costs its draws and no memory;
- the final version of a parameter's storage is cut into the rank's pieces at its last use, then freed;
- a storage the files of a pretrained model hold (``loads``: a loaded tensor, or its bf16-true cast) is read from
  them where an entry reads it, and an entry that only makes such storages, none wanted, is skipped ([Note: a cast
  of pretrained tensors] in lzero/hf/pretrained.py): the engine reads their pieces from the files itself.
After the replay the global RNG is left where eager construction would have left it (when nothing drew from it
since the context opened), so dropout and data order continue as under DDP.

What the replay cannot reproduce, lzero refuses to guess: a meta tensor the record did not see created (built
outside the context), or a read of storage never written. The engine then falls back to block-wise initialization
([Note: meta-device initialization] in materialize.py) with a warning that says the draws differ from eager.

The record (recording.py) is a list of :class:`Entry`, each naming its tensors by :class:`Ref`; a replay needs nothing
else of the recorder (:class:`Record`). How the engine reads a replay as a checkpoint: replayed_weights.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from lzero.errors import ZeroError


def storage_key(t: Tensor) -> int:
    """Which storage ``t`` views: its address, unique while the recording keeps the storage alive."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class Ref:
    """A tensor argument: which recorded storage, and how it is viewed."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: Tensor) -> "Ref":
        return cls(storage_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def whole(self, nbytes: int) -> bool:
        """The view covers its whole storage, contiguously."""
        return (self.offset == 0 and math.prod(self.size) * self.dtype.itemsize == nbytes
                and self.stride == torch.empty(self.size, device="meta").stride())

    def view(self, storage: torch.UntypedStorage) -> Tensor:
        """The tensor this Ref names, on ``storage``."""
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(storage, self.offset, self.size,
                                                                           self.stride)


@dataclass
class Entry:
    """One recorded operation: ``func(*args, **kwargs)`` with tensors as :class:`Ref`; ``creates``: the storages its
    outputs own (new); ``writes``: storages it writes in place; ``overwrites``: those of ``writes`` it does not read."""

    func: Callable
    args: tuple
    kwargs: dict
    creates: tuple[int, ...]
    writes: tuple[int, ...]
    overwrites: tuple[int, ...]
    reads: tuple[int, ...]
    outputs: Any  # the op's outputs as Refs (their storages in ``creates``)


class Record(Protocol):
    """What a replay runs: the recorded entries, and the size of every storage they name (a ``Recorder``)."""

    entries: list[Entry]
    nbytes: dict[int, int]  # recorded storage -> its bytes


class ReplayError(ZeroError, RuntimeError):
    """The record cannot be replayed."""


class Replay:
    """The record run on real tensors, each rank keeping its pieces. See [Note: replayed construction]."""

    def __init__(self, record: Record,
                 wanted: dict[int, list[tuple[str, Ref, Optional[list[tuple[int, int, Tensor]]]]]],
                 device: torch.device, loads: Optional[dict[int, Callable[[Tensor], None]]] = None) -> None:
        """``wanted``: storage -> (name, the tensor's Ref, the flat [start, end) ranges to keep, each with the memory
        that takes it (a slice of a unit's shard); None: the whole tensor)."""
        self.record = record
        self.wanted = wanted
        self.device = device
        # storage -> fills a flat uint8 view of it with a checkpoint tensor: storages the files hold that the record
        # reads without writing (a resized embedding copies the loaded rows)
        self.loads = loads or {}
        self.whole: dict[str, Tensor] = {}

    @torch.no_grad()
    def run(self, state: Tensor) -> Tensor:
        """Replays from RNG ``state`` (the device's); returns the state eager construction ends in."""
        entries = self.record.entries
        ends, last_touch = _frees(entries)
        real: dict[int, torch.UntypedStorage] = {}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            _set_state(self.device, state)
            for i, e in enumerate(entries):
                if self._from_files(e):
                    self._free(ends.get(i, ()), i, last_touch, real)
                    continue
                for key in e.overwrites:  # a new version: fresh storage, the old one's values are not read
                    if key not in real:
                        real[key] = torch.empty(self.record.nbytes[key], dtype=torch.uint8,
                                                device=self.device).untyped_storage()
                for key in [k for k in e.reads if k not in real and k in self.loads]:
                    real[key] = torch.empty(self.record.nbytes[key], dtype=torch.uint8,
                                            device=self.device).untyped_storage()
                    self.loads[key](torch.empty(0, dtype=torch.uint8, device=self.device).set_(real[key]))
                missing = [k for k in (*e.reads, *e.writes) if k not in real]
                if missing:
                    raise ReplayError(f"an operation of the record (`{getattr(e.func, '__name__', e.func)}`, the"
                                      f" {i + 1}th of {len(entries)}) reads storage the record never wrote")
                args, kwargs = tree_map(lambda v: _real(v, real, self.device), (e.args, e.kwargs))
                out = e.func(*args, **kwargs)
                if e.creates:
                    for ref, t in zip(tree_flatten(e.outputs)[0], tree_flatten(out)[0]):
                        if isinstance(ref, Ref) and ref.storage in e.creates:
                            real[ref.storage] = t.untyped_storage()
                args = kwargs = out = t = None  # views of the storages: freeing below must free them
                self._free(ends.get(i, ()), i, last_touch, real)
            end_state = _get_state(self.device)
        return end_state

    def _from_files(self, e: Entry) -> bool:
        """``e`` only makes storages the files hold (a cast of a loaded tensor, [Note: a cast of pretrained tensors]
        in lzero/hf/pretrained.py), none wanted, and draws nothing: skipped, a later read of them reads the files."""
        return bool(e.creates) and not e.writes and all(k in self.loads and k not in self.wanted for k in e.creates) \
            and torch.Tag.nondeterministic_seeded not in getattr(e.func, "tags", ())

    def _free(self, keys: Any, i: int, last_touch: dict[int, int], real: dict[int, torch.UntypedStorage]) -> None:
        """After entry ``i``: the storages whose version ends there freed, a final version's wanted part kept."""
        for key in keys:
            if last_touch[key] == i and key in self.wanted:  # the final version: this rank's part of it
                self._keep(key, real[key])
            real.pop(key, None)

    def _keep(self, key: int, storage: torch.UntypedStorage) -> None:
        for name, ref, ranges in self.wanted[key]:
            t = ref.view(storage)
            if ranges is None:  # the storage itself where the tensor is all of it: no copy
                self.whole[name] = t if ref.whole(storage.nbytes()) else t.clone()
                continue
            flat = t.reshape(-1)
            for start, end, out in ranges:
                out.copy_(flat[start:end])


def _frees(entries: list[Entry]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Where each storage version ends: entry index -> the storages to free after it (a version runs from a create or
    a whole overwrite to its last touch before the next one), and each storage's last touch of all."""
    ends: dict[int, list[int]] = {}
    last_touch: dict[int, int] = {}
    for i, e in enumerate(entries):
        for key in dict.fromkeys((*e.creates, *e.writes, *e.reads)):
            starts_version = key in e.creates or key in e.overwrites
            if starts_version and key in last_touch:
                ends.setdefault(last_touch[key], []).append(key)
            last_touch[key] = i
    for key, i in last_touch.items():
        ends.setdefault(i, []).append(key)
    return ends, last_touch


def _real(value: Any, real: dict[int, torch.UntypedStorage], device: torch.device) -> Any:
    """An argument of a recorded entry on real memory: a :class:`Ref` on its replayed storage, and the meta device (what
    the record ran on, or an entry's placeholder for the replay's device) as the device the replay runs on."""
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    return value.view(real[value.storage]) if isinstance(value, Ref) else value


def rng_states() -> tuple[Tensor, Optional[Tensor]]:
    """The generators' states: the CPU's, and the current CUDA device's (None before CUDA starts)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def same_rng_states(a: tuple, b: tuple) -> bool:
    """Two :func:`rng_states` alike (a generator not yet started in both counts as alike)."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _set_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def start_state(recorded: tuple[Tensor, Optional[Tensor]], device: torch.device) -> Tensor:
    """The generator state eager construction on ``device`` would have started from: the one recorded when the model
    was built, or, for a CUDA device whose generator had not started then (CUDA not yet initialized, as in a script
    that builds its model before ``fit``), that generator as it is now: nothing has drawn from it since (it starts at
    its seed when CUDA initializes). Never the CPU generator's state, which is another generator (and size)."""
    cpu, cuda = recorded
    if device.type != "cuda":
        return cpu
    return cuda if cuda is not None else _get_state(device)


def _cuda_started_since(recorded: tuple[Tensor, Optional[Tensor]], device: torch.device) -> bool:
    """The replay ran on a CUDA generator that had not started when the model was built (see :func:`start_state`):
    it took that generator's current state, so continuing from the replay's end is what eager would do, provided
    the CPU generator did not draw either."""
    return device.type == "cuda" and recorded[1] is None and torch.equal(torch.get_rng_state(), recorded[0])


def _get_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def leave_rng_as_eager(recorded_end: tuple[Tensor, Optional[Tensor]], device: torch.device, end: Tensor) -> None:
    """After a replay that ended in RNG state ``end``: the generator of ``device`` continues from there, as after eager
    construction, when nothing drew since the recording closed (in ``recorded_end``, the states then)."""
    if same_rng_states(rng_states(), recorded_end) or _cuda_started_since(recorded_end, device):
        _set_state(device, end)
