"""Eager-exact initialization of a model built on the meta device: its construction recorded, then replayed.

[Note: replayed construction]
Built on the meta device (zero3's ``configure_model``, ``init_module(empty_init=True)``), a model draws no random
numbers: an initializer on a meta tensor computes nothing. Initializing it afterwards, block by block, draws other
numbers than the same code run eagerly under DDP from the same seed. So while lzero's meta context is open, a
:class:`Recorder` (a ``TorchDispatchMode``) builds the model on fake tensors ([Note: a fake device]) and writes down
every operation that creates or writes storage: factories
(``empty``), initializers (``uniform_``, ``normal_``, ``fill_``, ...), copies between tensors (tied or derived
weights), casts (``.to(dtype)``), with each tensor argument as (storage, dtype, size, stride, offset). View operations
are not recorded: a later use names the storage and the geometry it reads. The few ``torch.nn.init`` functions that
skip meta tensors in Python (``trunc_normal_``, ``orthogonal_``, ``dirac_``, ``sparse_``) are recorded as the call
itself on meta tensors; on fake tensors only ``trunc_normal_``'s value-reading loop is. The RNG state of the CPU
(and of the current CUDA device) is taken when the context opens.

At setup :class:`Replay` runs the record on real tensors, on every rank, from rank 0's RNG state: the same draws in
the same order as eager construction, so every parameter and buffer is bitwise what eager construction gives. Each
rank keeps only the pieces of its own shards (``owned``) and whole tensors outside the units (buffers), which the
engine then reads as it reads a pretrained checkpoint (``WeightSource``). Memory stays near one tensor at a time:
- a storage exists from the record's first write of a *version* (a ``create`` or an overwrite that reads nothing of
  it) to the last operation touching that version; a version overwritten later without being read (``nn.Linear``'s
  own ``reset_parameters`` draw, redrawn by Hugging Face's ``post_init``) is replayed into storage freed right after,
  so it costs its draws and no memory;
- the final version of a parameter's storage is cut into the rank's pieces at its last use, then freed.
After the replay the global RNG is left where eager construction would have left it (when nothing drew from it
since the context opened), so dropout and data order continue as under DDP.

[Note: a fake device]
The record runs the construction on fake tensors (torch's ``FakeTensorMode``): they hold no memory, yet report the
device the model will compute on (``cpu`` or ``cuda:<i>``) and ``is_meta`` False, so code inside cannot tell the
construction from an eager one and takes its eager branches. Libraries that skip their initializers on the meta
device (Hugging Face's ``post_init``, a module whose ``reset_parameters`` returns early for ``is_meta``) draw as they
do eagerly, whenever and wherever they were imported; no library is patched. While lzero's meta context is open
(``building_on``), every tensor a factory makes is fake; an operation reading a fake tensor gives fake tensors, an
operation on real tensors alone stays real (a constant computed in ``__init__`` keeps its value). After the context
closes, operations on the fake tensors are still recorded while the recording stays open (Fabric, until setup).

A value the construction reads (``bool(tensor)``, ``.item()``: a branch taken on it) has no memory behind it: the
record so far is then replayed on real memory (from the recorded RNG state, in a forked generator, with the files of
pretrained models for the tensors they hold) and the value read from it, so the construction takes eager's branch;
the replay at setup computes the same values again. A tensor whose shape depends on values (``nonzero``) is refused.

Two more things the fake tensors cannot do, handled where they arise: ``trunc_normal_`` resamples until no value lies
outside its bounds, a loop that reads the values, so the call is recorded whole (the module global
``torch.nn.init._no_grad_trunc_normal_``, which every reference to ``trunc_normal_`` reaches); and a
``Module.to()`` of a fake parameter swaps the tensor's contents (``torch.utils.swap_tensors``), which the fake mode's
memo of its outputs would forbid, so this mode keeps none (every output is fresh), and the record keeps storages, not
tensors, alive. Once the model is built, :func:`settle` swaps each fake parameter and buffer for a meta tensor over
the same storage, which the engine (and Lightning) read as "not materialized"; the replay then runs as below. A
pretrained model (``from_pretrained`` inside the context, hf/pretrained.py) is built unrecorded (:func:`unrecorded`:
eager ``from_pretrained`` builds on the meta device and draws nothing), its parameters then made fake over their
meta storages (:func:`as_fakes`), and what follows recorded.

What the replay cannot reproduce, lzero refuses to guess: a meta tensor the record did not see created (built
outside the context), or a read of storage never written. The engine then falls back to block-wise initialization
([Note: meta-device initialization] in materialize.py) with a warning that says the draws differ from eager.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lzero.engine.materialize import UninitializedModuleError
from lzero.engine.partition import UnitSpec

_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "geometric_",
               "log_normal_", "cauchy_", "copy_"}
"""In-place operations whose result does not depend on the written tensor's values (``copy_`` reads its source)."""

_PYTHON_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
"""``torch.nn.init`` functions that return early on a meta tensor: recorded as calls."""


def _key(t: Tensor) -> int:
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
        return cls(_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

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


class Recorder(TorchDispatchMode):
    """Records the operations that build a model on the meta device. See [Note: replayed construction]."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Entry] = []
        self.nbytes: dict[int, int] = {}  # recorded storage -> its bytes
        self._alive: list[torch.UntypedStorage] = []  # every recorded storage, kept alive (and so its key)
        self.start_states = _states()  # (CPU, current CUDA device or None) when the context opened
        self.final_states = self.start_states  # when it closed
        self._seen = self.start_states  # at the last recorded draw (meta operations draw nothing)
        self.foreign: set[int] = set()  # meta storages read before the record wrote them
        self._written: set[int] = set()  # storages the record created or overwrote whole
        # the fake tensors' mode; ``building``: every operation runs on fake tensors (lzero's meta context is open)
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        # every op's output is a fresh fake tensor: not remembered by the converter, whose weak reference would stop
        # ``Module.to()`` from swapping a fake parameter for its converted self (``torch.utils.swap_tensors``)
        self.fake.fake_tensor_converter.set_tensor_memo = lambda t, v: None
        self.building = False
        self.device = torch.device("cpu")  # what the fake tensors report (``building_on``)
        self.paused = False  # nothing recorded (a pretrained base, built as eager ``from_pretrained`` builds it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        schema = func._schema
        draws = torch.Tag.nondeterministic_seeded in func.tags  # consumes a generator
        if draws:
            self._note_reseeding()  # before the draw: where it finds the generator
        inputs = _tensors((args, kwargs))
        if any(isinstance(t, FakeTensor) for t in inputs) or (self.building and not inputs):
            try:
                with self.fake:  # storage-less tensors that report the real device: [Note: a fake device]
                    out = func(*args, **kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException) as err:
                if isinstance(err, DataDependentOutputException) and not any(map(_is_tensor, func._schema.returns)):
                    return self._read_values(func, args, kwargs)  # a value steering the construction
                raise ReplayError(
                    f"The model's construction makes a tensor whose shape depends on values (`{func}`), but under zero3"
                    " `configure_model` builds it without memory (tensors on a fake device, see [Note: a fake device]"
                    " in lzero/engine/replay.py), so the shape is not known until setup."
                    " HINT: build that part in `__init__` (zero3 shards it at setup), or pass"
                    " `ZeroStrategy(init_fn=...)`."
                ) from err
        else:
            out = func(*args, **kwargs)
        if not _touches_recorded(args, kwargs, out):
            if draws and kwargs.get("generator") is None:  # a real draw: the replay draws it again, into scratch
                self._record_real_draw(func, args, kwargs)
            return out
        writes, overwrites = [], []
        for arg, value in zip(schema.arguments, [*args, *[kwargs.get(a.name) for a in schema.arguments[len(args):]]]):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, Tensor):
                writes.append(_key(value))
                self._remember(value)
                if func.__name__.split(".")[0] in _OVERWRITES and arg.name in ("self", "out") \
                        and Ref.of(value).whole(self.nbytes[_key(value)]):
                    overwrites.append(_key(value))
        viewing = all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) and schema.returns
        outputs = [_key(t) for t in _tensors(out) if _recorded(t)]
        aliasing = bool(outputs) and set(outputs) <= {_key(t) for t in inputs}  # _unsafe_view
        if (viewing or aliasing) and not writes:
            return out  # a view: a later use names its storage and geometry
        creates = tuple(_key(t) for t in _tensors(out) if _recorded(t) and _key(t) not in set(writes))
        for t in _tensors(out):
            self._remember(t)
        self._record(func, args, kwargs, creates, tuple(writes), tuple(overwrites), out)
        return out

    def _record(self, func: Callable, args: tuple, kwargs: dict, creates: tuple, writes: tuple, overwrites: tuple,
                out: Any) -> None:
        reads = []

        def ref(value: Any) -> Any:
            if isinstance(value, Tensor) and _recorded(value):
                self._remember(value)
                reads.append(_key(value))
                return Ref.of(value)
            return value

        args, kwargs = tree_map(ref, args), tree_map(ref, kwargs)
        if creates and kwargs.get("dtype") is None and _takes_dtype(func):
            first = next((t for t in _tensors(out) if _recorded(t)), None)
            if first is not None:  # a factory under a default dtype (bf16-true's build): the replay runs without it
                kwargs = {**kwargs, "dtype": first.dtype}
        outputs = tree_map(lambda t: Ref.of(t) if isinstance(t, Tensor) and _recorded(t) else None, out)
        reads = tuple(dict.fromkeys(k for k in reads if k not in overwrites))
        self.foreign.update(k for k in reads if k not in self._written)
        self._written.update((*creates, *overwrites))
        self.entries.append(Entry(func, args, kwargs, creates, writes, overwrites, reads, outputs))

    def _read_values(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """The construction reads values (``bool(tensor)``, ``.item()``: a branch taken on them, as transformers'
        ``resize_token_embeddings`` checks its covariance): the record so far is replayed on real memory, from the
        recorded RNG state and with the files of pretrained models for the tensors they hold, and ``func`` runs on the
        real values. The construction goes on as eagerly; the replay at setup computes the same values again."""
        fakes = [t for t in _tensors((args, kwargs)) if isinstance(t, FakeTensor)]
        wanted: dict[int, list] = {}
        for i, t in enumerate(fakes):
            wanted.setdefault(_key(t), []).append((f"value{i}", Ref.of(t), None))
        loads = {k: v for provide in _FILE_LOADS for k, v in provide().items()}
        replay = Replay(self, wanted, self.device, loads)
        replay.run(start_state(self.start_states, self.device).clone())
        real = {id(t): replay.whole[f"value{i}"] for i, t in enumerate(fakes)}
        args, kwargs = tree_map(lambda v: real.get(id(v), v) if isinstance(v, Tensor) else v, (args, kwargs))
        return func(*args, **kwargs)

    def _remember(self, t: Tensor) -> None:
        key = _key(t)
        if key not in self.nbytes:
            self.nbytes[key] = t.untyped_storage().nbytes()
            # the storage itself, not the tensor: a fake parameter converted by ``Module.to()`` swaps its contents
            self._alive.append(t.untyped_storage())

    def python_init(self, name: str, original: Callable, tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """A ``torch.nn.init`` function that skips meta tensors, or whose draws depend on the values it drew
        (``trunc_normal_``'s rejection loop): recorded as a call that overwrites ``tensor``."""
        if self.paused or not _recorded(tensor):
            return original(tensor, *args, **kwargs)
        key = _key(tensor)
        self._remember(tensor)
        self._note_reseeding()
        whole = Ref.of(tensor).whole(self.nbytes[key])
        self._record(original, (tensor, *args), kwargs, (), (key,), (key,) if whole else (), None)
        return tensor

    def _note_reseeding(self) -> None:
        """Before a draw: the generator was set since the last recorded draw (``torch.manual_seed`` inside
        ``configure_model``), so the replay sets it where this draw finds it. Real draws are recorded themselves
        (``_record_real_draw``), so a difference left here is a jump, not a sequence to reproduce."""
        now = _states()
        if not _same_states(now, self._seen):
            self.entries.append(Entry(_restore_states, now, {}, (), (), (), (), None))
            self._seen = now

    def _record_real_draw(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """A draw on real tensors (the CPU) between meta ones: replayed on copies of its inputs, for its draws alone
        (the user's tensors are never written again)."""
        args, kwargs = tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, (args, kwargs))
        self.entries.append(Entry(_draw_again, (func, args, kwargs), {}, (), (), (), (), None))
        self._seen = _states()

    @contextlib.contextmanager
    def recording(self) -> Iterator["Recorder"]:
        with contextlib.ExitStack() as stack:
            for name in _PYTHON_INITS:
                stack.enter_context(_patched(nn.init, name, functools.partial(self.python_init, name,
                                                                              getattr(nn.init, name))))
            # every caller of trunc_normal_ reaches its loop through this module global, references taken at any
            # import included (transformers' initializers): the loop reads values, so the call is recorded whole
            loop = nn.init._no_grad_trunc_normal_
            stack.enter_context(_patched(nn.init, "_no_grad_trunc_normal_",
                                         functools.partial(self.python_init, "_no_grad_trunc_normal_", loop)))
            stack.enter_context(self)
            yield self
        self.final_states = _states()

    @contextlib.contextmanager
    def building_on(self, device: torch.device) -> Iterator[None]:
        """Inside the block, every tensor created is a fake one on ``device`` (see [Note: a fake device])."""
        before, self.building = self.building, True
        self.device = torch.device(device)
        _BUILDING.append(self)
        try:
            with torch.device(device):
                yield
        finally:
            _BUILDING.remove(self)
            self.building = before

    def unwritten(self, named: list[tuple[str, Tensor]]) -> list[str]:
        """The names of tensors only ever allocated (``torch.empty``) by the record."""
        written = {key for e in self.entries if not e.func.__name__.startswith(("empty", "new_empty"))
                   for key in (*e.creates, *e.writes)}
        return [name for name, t in named if _key(t) not in written]

    def refuse_unwritten(self, named: list[tuple[str, Tensor]]) -> None:
        """A tensor only ever allocated (``torch.empty``) holds whatever memory held: eager construction would train
        from it too, but no replay can give the same bytes. Named, as block-wise initialization names it; every rank
        checks every tensor, so all of them raise together."""
        unwritten = self.unwritten(named)
        if unwritten:
            raise UninitializedModuleError(
                f"{', '.join(f'`{n}`' for n in unwritten[:5])} {'was' if len(unwritten) == 1 else 'were'} allocated on"
                " the meta device and nothing in the model's construction wrote it, so it has no value to start from."
                " HINT: initialize it in the module's `__init__` or `reset_parameters()`, or pass"
                " `ZeroStrategy(init_fn=...)`.")

    def covers(self, tensors: list[Tensor], names: Optional[list[str]] = None) -> Optional[str]:
        """None if every meta tensor of ``tensors`` can be replayed; else why not (naming it, from ``names``)."""
        for i, t in enumerate(tensors):
            key = _key(t)
            what = f"`{names[i]}`" if names is not None else "a tensor"
            if key not in self.nbytes:
                return f"{what} (shape {tuple(t.shape)}) was built outside lzero's meta context"
            if key in self.foreign:
                return f"{what} (shape {tuple(t.shape)}) was read before anything in the record wrote it"
        return None


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


def _takes_dtype(func: Callable) -> bool:
    """A factory with a ``dtype`` keyword (``empty``, ``zeros``, ``full``, ...): absent, it means the default dtype."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.name == "dtype" and a.kwarg_only for a in schema.arguments) \
        and not any(map(_is_tensor, schema.arguments))


def _is_tensor(argument: Any) -> bool:
    """A schema argument or return of tensor type."""
    return argument.type.isSubtypeOf(torch._C.TensorType.get())


def _recorded(t: Tensor) -> bool:
    """A tensor without values whose construction the record follows: fake (built inside lzero's meta context) or
    meta (a pretrained model's parameters, see hf/pretrained.py)."""
    return isinstance(t, FakeTensor) or t.is_meta


def _touches_recorded(args: tuple, kwargs: dict, out: Any) -> bool:
    return any(_recorded(t) for t in _tensors((args, kwargs, out)))


_FILE_LOADS: list[Callable[[], dict[int, Callable[[Tensor], None]]]] = []
"""Providers of ``storage -> fill`` for tensors that files hold (pretrained models, hf/pretrained.py registers one):
what a replay reads that the record never wrote."""

_BUILDING: list[Recorder] = []
"""The recorders whose meta context is open (``building_on``), the innermost last."""


def as_fakes(module: nn.Module, skip: set[int]) -> None:
    """Inside lzero's meta context: every plain meta parameter of ``module`` (but those whose ``id`` is in ``skip``)
    replaced by a fake one over the same storage, as the rest of the construction's tensors are, so code that mixes
    them (``old.weight.data = new.weight.data`` in transformers' ``resize_token_embeddings``) works as eagerly. A no-op
    outside the context."""
    recorder = _BUILDING[-1] if _BUILDING else None
    if recorder is None:
        return
    made: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None or type(p) is not nn.Parameter or not p.is_meta or id(p) in skip:
                continue
            if id(p) not in made:
                fake = recorder.fake.fake_tensor_converter.from_meta_and_device(recorder.fake, p.detach(), p.device)
                made[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
                made[id(p)].__dict__.update({k: v for k, v in p.__dict__.items() if k != "_is_param"})
            owner._parameters[name] = made[id(p)]


def unrecorded() -> ContextManager[None]:
    """Inside the block, the open recording records nothing: construction that eager code runs on the meta device
    too (transformers' ``from_pretrained`` builds its model there and draws nothing), whose tensors the files fill."""
    return _building_set("paused", True)


def real_construction() -> ContextManager[None]:
    """Inside the block, the open recording follows meta tensors only, and tensors are created as the code asks (a
    pretrained model built with meta parameters and real buffers: hf/pretrained.py)."""
    return _building_set("building", False)


@contextlib.contextmanager
def _building_set(flag: str, value: bool) -> Iterator[None]:
    """Inside the block, the innermost open meta context's recorder has ``flag`` set to ``value`` (none open: no-op)."""
    recorder = _BUILDING[-1] if _BUILDING else None
    if recorder is None:
        yield
        return
    before = getattr(recorder, flag)
    setattr(recorder, flag, value)
    try:
        yield
    finally:
        setattr(recorder, flag, before)


_RECORDERS: list[Recorder] = []
"""Every recording made in this process whose storages a model may still hold (the newest last)."""


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Inside the block, what builds fake and meta tensors is recorded (lzero's meta context opens it)."""
    recorder = Recorder()
    with recorder.recording():
        yield recorder
    _RECORDERS.append(recorder)
    del _RECORDERS[:-4]  # older recordings: models rebuilt since


@contextlib.contextmanager
def recording_more(module: nn.Module) -> Iterator[None]:
    """Inside the block, operations on ``module``'s meta tensors join the recording that built them (a cast of the
    whole module before setup: bf16-true's ``convert_module``); a no-op for a module no recording built. The newest
    recording that built any of them: a pretrained base's parameters are built unrecorded (their values come from the
    files), the adapters beside them are recorded."""
    keys = {_key(t) for t in [*module.parameters(), *module.buffers()] if _recorded(t)}
    recorder = next((r for r in reversed(_RECORDERS) if keys & r.nbytes.keys()), None)
    if recorder is None:
        yield
        return
    with recorder:
        yield


def settle(module: nn.Module) -> dict[int, Tensor]:
    """Every fake parameter and buffer of ``module`` replaced by a meta tensor over the same (recorded) storage, which
    lzero and Lightning read as "not materialized yet"; tied tensors stay tied. Returns ``id(fake) -> meta``. Called
    once the construction is over (the end of ``configure_model``, ``setup``), outside the recording."""
    made: dict[int, Tensor] = {}
    for owner in module.modules():
        for slots, as_parameter in ((owner._parameters, True), (owner._buffers, False)):
            for name, t in list(slots.items()):
                if not isinstance(t, FakeTensor):
                    continue
                if id(t) not in made:
                    made[id(t)] = _meta_parameter(t) if as_parameter else _meta_view(t)
                slots[name] = made[id(t)]
    return made


def _meta_view(t: Tensor) -> Tensor:
    return torch.empty(0, dtype=t.dtype, device="meta").set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


_FAKE_KEYS: set[str] = set()  # what a fake tensor keeps in its __dict__ for itself


def _meta_parameter(p: Tensor) -> nn.Parameter:
    """A meta ``nn.Parameter`` over ``p``'s storage, with the attributes code set on ``p`` (not the fake tensor's
    own)."""
    if not _FAKE_KEYS:
        with FakeTensorMode():
            _FAKE_KEYS.update(nn.Parameter(torch.empty(1)).__dict__)
        _FAKE_KEYS.add("_is_param")
    new = nn.Parameter(_meta_view(p), requires_grad=p.requires_grad)
    new.__dict__.update({k: v for k, v in p.__dict__.items() if k not in _FAKE_KEYS})
    return new


def recorder_for(tensors: list[Tensor], names: Optional[list[str]] = None) -> tuple[Optional[Recorder], str]:
    """The recording that built every one of ``tensors`` (named ``names``), or None and why not."""
    if not _RECORDERS:
        return None, "the model was built outside lzero's meta context"
    reasons = []
    for recorder in reversed(_RECORDERS):
        why = recorder.covers(tensors, names)
        if not why:
            return recorder, ""
        reasons.append(why)
    return None, reasons[0]  # the newest recording's: the model's own, when it has one


class Replay:
    """The record run on real tensors, each rank keeping its pieces. See [Note: replayed construction]."""

    def __init__(self, recorder: Recorder,
                 wanted: dict[int, list[tuple[str, Ref, Optional[list[tuple[int, int, Tensor]]]]]],
                 device: torch.device, loads: Optional[dict[int, Callable[[Tensor], None]]] = None) -> None:
        """``wanted``: storage -> (name, the tensor's Ref, the flat [start, end) ranges to keep, each with the memory
        that takes it (a slice of a unit's shard); None: the whole tensor)."""
        self.recorder = recorder
        self.wanted = wanted
        self.device = device
        # storage -> fills a flat uint8 view of it with a checkpoint tensor: storages the files hold that the record
        # reads without writing (a resized embedding copies the loaded rows)
        self.loads = loads or {}
        self.whole: dict[str, Tensor] = {}

    @torch.no_grad()
    def run(self, state: Tensor) -> Tensor:
        """Replays from RNG ``state`` (the device's); returns the state eager construction ends in."""
        entries = self.recorder.entries
        ends, last_touch = _frees(entries)
        real: dict[int, torch.UntypedStorage] = {}
        _REPLAY_DEVICE[0] = self.device
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            _set_state(self.device, state)
            for i, e in enumerate(entries):
                for key in e.overwrites:  # a new version: fresh storage, the old one's values are not read
                    if key not in real:
                        real[key] = torch.empty(self.recorder.nbytes[key], dtype=torch.uint8,
                                                device=self.device).untyped_storage()
                for key in [k for k in e.reads if k not in real and k in self.loads]:
                    real[key] = torch.empty(self.recorder.nbytes[key], dtype=torch.uint8,
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
                for key in ends.get(i, ()):
                    if last_touch[key] == i and key in self.wanted:  # the final version: this rank's part of it
                        self._keep(key, real[key])
                    real.pop(key, None)
            end_state = _get_state(self.device)
        return end_state

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
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    return value.view(real[value.storage]) if isinstance(value, Ref) else value


def _states() -> tuple[Tensor, Optional[Tensor]]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _same_states(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _draw_again(func: Callable, args: tuple, kwargs: dict) -> None:
    """A recorded real draw, made again on copies (in-place ones write only the copies)."""
    func(*tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v, args),
         **tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v, kwargs))


_REPLAY_DEVICE: list[torch.device] = [torch.device("cpu")]  # the device a replay runs on (for _restore_states)


def _restore_states(cpu: Tensor, cuda: Optional[Tensor]) -> None:
    """A recorded entry: the generator of the replay's device set where the recorded draw found it."""
    device = _REPLAY_DEVICE[0]
    if device.type == "cuda" and cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    elif device.type == "cpu":
        torch.set_rng_state(cpu)


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


class ReplayError(RuntimeError):
    """The record cannot be replayed."""


class ReplayedWeights:
    """A replayed construction as the engine reads a checkpoint (``WeightSource`` in materialize.py): each unit's
    shard built by the replay (``unit_values``), and the whole of every other tensor."""

    def __init__(self, replay: Replay, names: set[str], shards: dict[int, Tensor]) -> None:
        self._replay = replay
        self._names = names
        self._shards = shards  # unit index -> this rank's shard (1D)

    def holds(self, name: str) -> bool:
        return name in self._names

    def unit_values(self, spec: UnitSpec, rank: int) -> Optional[Tensor]:
        return self._shards.pop(spec.index, None)

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        def read(name: str, start: int, end: int, out: Tensor) -> None:
            out.copy_(self._replay.whole[name].reshape(-1)[start:end])

        yield read

    def finish(self, root: nn.Module, all_reduce_max: Callable[[Tensor], None], device: torch.device) -> None:
        self._replay.whole.clear()


def replayed_weights(root: nn.Module, units: Sequence[UnitSpec], rank: int, device: torch.device,
                     broadcast: Callable[[Tensor], None], provided: Any = None) -> tuple[Optional[Any], str]:
    """``root``'s meta tensors replayed from their recording (rank 0's RNG state, shared with ``broadcast``), this
    rank keeping its shard of every unit and the whole of the other tensors; or None and why not. A collective (the
    broadcast) when a recording covers the model. ``provided``: a source (a state dict being loaded) whose tensors
    win over the replay's; the replay gives only the others (non-persistent buffers, say), and what neither wrote is
    left to the modules' ``reset_parameters()`` (materialize.py), as FSDP materializes a meta model."""
    named = [(n, t) for n, t in [*root.named_parameters(), *root.named_buffers()] if t.is_meta]
    if provided is not None:  # the tensors the load gives are not the record's to cover
        named = [(n, t) for n, t in named if not provided.holds(n)]
    recorder, why = recorder_for([t for _, t in named], [n for n, _ in named])
    if recorder is None:
        return None, why
    if provided is not None:  # what neither the load nor the record wrote: the modules' reset_parameters(), as FSDP
        unwritten = set(recorder.unwritten(named))
        named = [(n, t) for n, t in named if n not in unwritten]
    else:
        recorder.refuse_unwritten(named)
    # every shard allocated before the replay: its short-lived whole tensors then reuse the same freed memory
    shards, pieces = {}, {}
    for spec in units:
        dtype = root.get_parameter(spec.params[0].name).dtype
        shard = shards[spec.index] = torch.empty(spec.shard_numel, dtype=dtype, device=device)
        lo, hi = spec.shard_range(rank)
        if spec.numel < hi:
            shard[max(spec.numel - lo, 0):].zero_()  # the padding
        for param, start, end, at in spec.owned_pieces(rank):
            pieces.setdefault(param.name, []).append((start, end, shard[at : at + end - start]))
    in_units = {p.name for spec in units for p in spec.params}
    wanted: dict[int, list[tuple[str, Ref, Optional[list[tuple[int, int, Tensor]]]]]] = {}
    for name, t in named:
        ranges = pieces.get(name, []) if name in in_units else None
        if ranges == []:
            continue  # this rank owns nothing of it
        wanted.setdefault(_key(t), []).append((name, Ref.of(t), ranges))
    state = start_state(recorder.start_states, device).clone()
    broadcast(state)
    loads = provided.storage_loads() if hasattr(provided, "storage_loads") else None
    replay = Replay(recorder, wanted, device, loads)
    end = replay.run(state)
    if _same_states(_states(), recorder.final_states) or _cuda_started_since(recorder.final_states, device):
        _set_state(device, end)  # nothing drew since the build: continue as eager would
    replayed = ReplayedWeights(replay, {name for name, _ in named}, shards)
    return (replayed if provided is None else LoadedOverReplay(provided, replayed, units)), ""


class LoadedOverReplay:
    """A state being loaded into a meta model, over its replayed construction for what that state does not hold
    (``WeightSource`` in materialize.py): each unit's shard from the replay with the loaded pieces written over it."""

    def __init__(self, loaded: Any, replayed: ReplayedWeights, units: Sequence[UnitSpec]) -> None:
        self._loaded, self._replayed = loaded, replayed
        self._units = {spec.index: spec for spec in units}

    def holds(self, name: str) -> bool:
        return self._loaded.holds(name) or self._replayed.holds(name)

    def unit_values(self, spec: UnitSpec, rank: int) -> Optional[Tensor]:
        shard = self._replayed.unit_values(spec, rank)
        with self._loaded.reading() as read, torch.no_grad():
            for param, start, end, at in spec.owned_pieces(rank):
                if self._loaded.holds(param.name):
                    read(param.name, start, end, shard[at: at + end - start])
        return shard

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        with self._loaded.reading() as loaded, self._replayed.reading() as replayed:
            yield lambda name, a, b, out: (loaded if self._loaded.holds(name) else replayed)(name, a, b, out)

    def finish(self, root: nn.Module, all_reduce_max: Callable[[Tensor], None], device: torch.device) -> None:
        self._loaded.finish(root, all_reduce_max, device)
        self._replayed.finish(root, all_reduce_max, device)
