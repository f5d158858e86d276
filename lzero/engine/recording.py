"""A model's construction on the meta device, recorded: the :class:`Recorder` and the fake tensors it builds on.
What it writes down, and how a replay runs it: replay.py.

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
pretrained models for the tensors they hold: :func:`read_values_from_files`) and the value read from it, so the
construction takes eager's branch; the replay at setup computes the same values again. A tensor whose shape depends
on values (``nonzero``) is refused.

Two more things the fake tensors cannot do, handled where they arise: ``trunc_normal_`` resamples until no value lies
outside its bounds, a loop that reads the values, so the call is recorded whole (the module global
``torch.nn.init._no_grad_trunc_normal_``, which every reference to ``trunc_normal_`` reaches); and a
``Module.to()`` of a fake parameter swaps the tensor's contents (``torch.utils.swap_tensors``), which the fake mode's
memo of its outputs would forbid, so this mode keeps none (every output is fresh), and the record keeps storages, not
tensors, alive. Once the model is built, :func:`settle` swaps each fake parameter and buffer for a meta tensor over
the same storage, which the engine (and Lightning) read as "not materialized"; the replay then runs ([Note:
replayed construction] in replay.py). A pretrained model (``from_pretrained`` inside the context, hf/pretrained.py)
is built unrecorded (:func:`unrecorded`: eager ``from_pretrained`` builds on the meta device and draws nothing), its
parameters then made fake over their meta storages (:func:`as_fakes`), and what follows recorded.

[Note: where recordings live]
A recording is found from the tensors it built, not from a list of recordings: each storage the recorder records
carries it (``_lzero_recordings`` on the storage object, which torch keeps as long as the storage lives), and the
recorder keeps its storages alive in turn, so a recording lives as long as a tensor over its storages does (a cycle
the garbage collector frees with the model). The engine at setup (:func:`recorder_for`) and a cast before setup
(:func:`recording_more`) ask the model's own tensors. The meta contexts open now are a ``ContextVar`` (``_OPEN``):
the dynamic extent of a ``with`` block (``building_on``), per context as torch keeps its dispatch modes per thread.
The recordings themselves are not kept in one: a model built in one context may be set up in another (some
ipykernel versions run each notebook cell in a fresh context).

[Note: the construction's default dtype]
Eager code builds a model under whatever default dtype is set around it: Lightning's bf16-true sets bf16 around
``configure_model`` (its precision plugin's ``module_init_context``), and what the model computes while built
depends on it, and not only its own tensors: bitsandbytes makes its 4-bit code table once per process, in the
default dtype of its first quantization, and every later quantization and dequantization of the process uses that
table (the midpoints of a bf16 table bucket other codes than fp32's). The record runs under the default dtype of
the build, but the replay and the pretrained reads run at setup, outside it; so a recording keeps the default dtype
its construction opened under (``Recorder.default_dtype``: the precision's context opens outside lzero's meta
context, at both doors, as Lightning's own strategies nest them) and the engine materializes the model under it
(:func:`as_built`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lzero.engine.materialize import UninitializedModuleError
from lzero.engine.replay import (Entry, Ref, Replay, ReplayError, rng_states, same_rng_states, start_state,
                                 storage_key)

_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "random_", "bernoulli_", "exponential_", "geometric_",
               "log_normal_", "cauchy_", "copy_"}
"""In-place operations whose result does not depend on the written tensor's values (``copy_`` reads its source)."""

_PYTHON_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
"""``torch.nn.init`` functions that return early on a meta tensor: recorded as calls."""


class Recorder(TorchDispatchMode):
    """Records the operations that build a model on the meta device. See [Note: replayed construction] in
    replay.py."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Entry] = []
        self.nbytes: dict[int, int] = {}  # recorded storage -> its bytes
        self._alive: list[torch.UntypedStorage] = []  # every recorded storage, kept alive (and so its key)
        self.start_states = rng_states()  # (CPU, current CUDA device or None) when the context opened
        self.default_dtype = torch.get_default_dtype()  # [Note: the construction's default dtype]
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
        self.closed: Optional[int] = None  # when the recording closed (monotonic ns): the newest is asked first
        # providers of ``storage -> fill`` for tensors files hold (read_values_from_files): what reading a value
        # replays that the record never wrote
        self.file_loads: list[Callable[[], dict[int, Callable[[Tensor], None]]]] = []

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
                    " in lzero/engine/recording.py), so the shape is not known until setup."
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
                writes.append(storage_key(value))
                self._remember(value)
                if func.__name__.split(".")[0] in _OVERWRITES and arg.name in ("self", "out") \
                        and Ref.of(value).whole(self.nbytes[storage_key(value)]):
                    overwrites.append(storage_key(value))
        viewing = all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) and schema.returns
        outputs = [storage_key(t) for t in _tensors(out) if _recorded(t)]
        aliasing = bool(outputs) and set(outputs) <= {storage_key(t) for t in inputs}  # _unsafe_view
        if (viewing or aliasing) and not writes:
            return out  # a view: a later use names its storage and geometry
        creates = tuple(storage_key(t) for t in _tensors(out) if _recorded(t) and storage_key(t) not in set(writes))
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
                reads.append(storage_key(value))
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
            wanted.setdefault(storage_key(t), []).append((f"value{i}", Ref.of(t), None))
        loads = {k: v for provide in self.file_loads for k, v in provide().items()}
        replay = Replay(self, wanted, self.device, loads)
        replay.run(start_state(self.start_states, self.device).clone())
        real = {id(t): replay.whole[f"value{i}"] for i, t in enumerate(fakes)}
        args, kwargs = tree_map(lambda v: real.get(id(v), v) if isinstance(v, Tensor) else v, (args, kwargs))
        return func(*args, **kwargs)

    def _remember(self, t: Tensor) -> None:
        key = storage_key(t)
        if key not in self.nbytes:
            storage = t.untyped_storage()
            self.nbytes[key] = storage.nbytes()
            # the storage itself, not the tensor: a fake parameter converted by ``Module.to()`` swaps its contents
            self._alive.append(storage)
            _mark(storage, self)

    def python_init(self, name: str, original: Callable, tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """A ``torch.nn.init`` function that skips meta tensors, or whose draws depend on the values it drew
        (``trunc_normal_``'s rejection loop): recorded as a call that overwrites ``tensor``."""
        if self.paused or not _recorded(tensor):
            return original(tensor, *args, **kwargs)
        key = storage_key(tensor)
        self._remember(tensor)
        self._note_reseeding()
        whole = Ref.of(tensor).whole(self.nbytes[key])
        self._record(original, (tensor, *args), kwargs, (), (key,), (key,) if whole else (), None)
        return tensor

    def _note_reseeding(self) -> None:
        """Before a draw: the generator was set since the last recorded draw (``torch.manual_seed`` inside
        ``configure_model``), so the replay sets it where this draw finds it. Real draws are recorded themselves
        (``_record_real_draw``), so a difference left here is a jump, not a sequence to reproduce."""
        now = rng_states()
        if not same_rng_states(now, self._seen):  # the meta device: the replay's own (replay._real)
            self.entries.append(Entry(_restore_states, (*now, torch.device("meta")), {}, (), (), (), (), None))
            self._seen = now

    def _record_real_draw(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """A draw on real tensors (the CPU) between meta ones: replayed on copies of its inputs, for its draws alone
        (the user's tensors are never written again)."""
        args, kwargs = tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, (args, kwargs))
        self.entries.append(Entry(_draw_again, (func, args, kwargs), {}, (), (), (), (), None))
        self._seen = rng_states()

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
        self.final_states = rng_states()
        self.closed = time.monotonic_ns()

    @contextlib.contextmanager
    def building_on(self, device: torch.device) -> Iterator[None]:
        """Inside the block, every tensor created is a fake one on ``device`` (see [Note: a fake device])."""
        before, self.building = self.building, True
        self.device = torch.device(device)
        token = _OPEN.set((*_OPEN.get(), self))
        try:
            with torch.device(device):
                yield
        finally:
            _OPEN.reset(token)
            self.building = before

    def unwritten(self, named: list[tuple[str, Tensor]]) -> list[str]:
        """The names of tensors only ever allocated (``torch.empty``) by the record."""
        written = {key for e in self.entries if not e.func.__name__.startswith(("empty", "new_empty"))
                   for key in (*e.creates, *e.writes)}
        return [name for name, t in named if storage_key(t) not in written]

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
            key = storage_key(t)
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


_OPEN: contextvars.ContextVar[tuple[Recorder, ...]] = contextvars.ContextVar("lzero_open_meta_contexts", default=())
"""The recorders whose meta context is open (``building_on``), the innermost last: per context, see [Note: where
recordings live]."""


def _innermost() -> Optional[Recorder]:
    """The recorder of the innermost open meta context, or None."""
    open_now = _OPEN.get()
    return open_now[-1] if open_now else None


def _mark(storage: torch.UntypedStorage, recorder: Recorder) -> None:
    """``storage`` carries ``recorder``: see [Note: where recordings live]."""
    marks = getattr(storage, "_lzero_recordings", None)
    if marks is None:
        marks = storage._lzero_recordings = []
    if not any(r is recorder for r in marks):
        marks.append(recorder)


def _recordings_of(tensors: list[Tensor]) -> list[Recorder]:
    """The closed recordings the storages of ``tensors`` carry, the last closed first (one still open records what
    runs anyway)."""
    found = {id(r): r for t in tensors for r in getattr(t.untyped_storage(), "_lzero_recordings", ())}
    return sorted((r for r in found.values() if r.closed is not None), key=lambda r: r.closed, reverse=True)


@contextlib.contextmanager
def as_built(module: nn.Module) -> Iterator[None]:
    """Inside the block, the default dtype is the one ``module``'s construction ran under (the newest recording that
    built any of its tensors; unchanged for a module no recording built): [Note: the construction's default dtype]."""
    recordings = _recordings_of([*module.parameters(), *module.buffers()])
    if not recordings:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(recordings[0].default_dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def read_values_from_files(provide: Callable[[], dict[int, Callable[[Tensor], None]]]) -> None:
    """The innermost open meta context's recording reads the tensors files hold from the files when the construction
    reads their values (``provide()``: storage -> fills a flat uint8 view of it; hf/pretrained.py gives one): see
    [Note: a fake device]. A no-op outside the context."""
    recorder = _innermost()
    if recorder is not None and provide not in recorder.file_loads:
        recorder.file_loads.append(provide)


def as_fakes(module: nn.Module, skip: set[int]) -> None:
    """Inside lzero's meta context: every plain meta parameter of ``module`` (but those whose ``id`` is in ``skip``)
    replaced by a fake one over the same storage, as the rest of the construction's tensors are, so code that mixes
    them (``old.weight.data = new.weight.data`` in transformers' ``resize_token_embeddings``) works as eagerly. A no-op
    outside the context."""
    recorder = _innermost()
    if recorder is None:
        return
    made: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None or type(p) is not nn.Parameter or not p.is_meta or id(p) in skip:
                continue
            if id(p) not in made:
                fake = recorder.fake.fake_tensor_converter.from_meta_and_device(recorder.fake, p.detach(), p.device)
                _mark(fake.untyped_storage(), recorder)  # the recording the model joins, though it recorded none of it
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
    recorder = _innermost()
    if recorder is None:
        yield
        return
    with _patched(recorder, flag, value):
        yield


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Inside the block, what builds fake and meta tensors is recorded (lzero's meta context opens it)."""
    recorder = Recorder()
    with recorder.recording():
        yield recorder


@contextlib.contextmanager
def recording_more(module: nn.Module) -> Iterator[None]:
    """Inside the block, operations on ``module``'s meta tensors join the recording that built them (a cast of the
    whole module before setup: bf16-true's ``convert_module``); a no-op for a module no recording built. The newest
    recording that built any of them: a pretrained base's parameters are built unrecorded (their values come from the
    files), the adapters beside them are recorded. Else the newest recording they joined (:func:`as_fakes`): a
    pretrained model with nothing recorded beside it, whose cast storages the engine then reads from the files
    ([Note: a cast of pretrained tensors] in hf/pretrained.py)."""
    tensors = [t for t in [*module.parameters(), *module.buffers()] if _recorded(t)]
    keys = {storage_key(t) for t in tensors}
    recordings = _recordings_of(tensors)
    recorder = next((r for r in recordings if keys & r.nbytes.keys()), recordings[0] if recordings else None)
    if recorder is None:
        yield
        return
    with recorder:
        yield


def casts_of(tensors: list[Tensor], sources: set[int]) -> dict[int, tuple[int, torch.dtype]]:
    """Storage -> (the storage of ``sources`` it is a recorded whole cast of, its dtype): ``.to(dtype)``, chains
    followed, in the recordings that ``tensors`` carry. [Note: a cast of pretrained tensors] in hf/pretrained.py."""
    found: dict[int, tuple[int, torch.dtype]] = {}
    for recorder in reversed(_recordings_of(tensors)):  # the oldest first: a later one may cast an earlier's output
        for e in recorder.entries:
            if e.func is not torch.ops.aten._to_copy.default or len(e.creates) != 1 or not isinstance(e.args[0], Ref):
                continue
            source, out = e.args[0], e.outputs
            origin = found.get(source.storage, (source.storage,))[0]
            if origin in sources and source.whole(recorder.nbytes[source.storage]) \
                    and out.whole(recorder.nbytes[out.storage]):
                found[out.storage] = (origin, out.dtype)
    return found


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


@functools.cache
def _fake_keys() -> frozenset[str]:
    """What a fake parameter keeps in its ``__dict__`` for itself."""
    with FakeTensorMode():
        return frozenset({*nn.Parameter(torch.empty(1)).__dict__, "_is_param"})


def _meta_parameter(p: Tensor) -> nn.Parameter:
    """A meta ``nn.Parameter`` over ``p``'s storage, with the attributes code set on ``p`` (not the fake tensor's
    own)."""
    fake_keys = _fake_keys()
    new = nn.Parameter(_meta_view(p), requires_grad=p.requires_grad)
    new.__dict__.update({k: v for k, v in p.__dict__.items() if k not in fake_keys})
    return new


def recorder_for(tensors: list[Tensor], names: Optional[list[str]] = None,
                 among: Optional[list[Tensor]] = None) -> tuple[Optional[Recorder], str]:
    """The recording that built every one of ``tensors`` (named ``names``), or None and why not: the newest of those
    that the storages of ``among`` (default: ``tensors``; the whole model, when the rest is loaded) carry."""
    recordings = _recordings_of(tensors if among is None else among)
    if not recordings:
        return None, "the model was built outside lzero's meta context"
    reasons = []
    for recorder in recordings:
        why = recorder.covers(tensors, names)
        if not why:
            return recorder, ""
        reasons.append(why)
    return None, reasons[0]  # the newest recording's: the model's own, when it has one


def _draw_again(func: Callable, args: tuple, kwargs: dict) -> None:
    """A recorded entry: a real draw made again on copies (in-place ones write only the copies)."""
    func(*tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v, args),
         **tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v, kwargs))


def _restore_states(cpu: Tensor, cuda: Optional[Tensor], device: torch.device) -> None:
    """A recorded entry: the generator of the replay's ``device`` (recorded as the meta device, which the replay reads
    as its own) set where the recorded draw found it."""
    if device.type == "cuda" and cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    elif device.type == "cpu":
        torch.set_rng_state(cpu)
