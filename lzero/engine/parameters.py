"""The classes a parameter takes while an engine manages it: seeing a user clear gradients that live
in the shards, and refusing access to a stage-3 parameter whose full value is released.

[Note: clearing gradients]
Under DDP a gradient lives in ``p.grad``, so every way of clearing it (``optimizer.zero_grad()``,
``module.zero_grad()``, ``p.grad = None``) clears what the next step uses, and a parameter whose
``grad`` is None is not stepped. Under ZeRO the gradient the step uses lives in the unit's shard:
stages 2-3 set ``p.grad`` to None once a unit is reduced, and stage 1 keeps ``p.grad`` as a view of
the flat gradient while the reduced shard may be a separate tensor. So lzero has to be told:

- ``optimizer.zero_grad(set_to_none)`` is the strategy's optimizer: it clears the shards directly.
- ``p.grad = None``: while an engine manages a parameter, the parameter's class is swapped for
  ``ZeroParameter``, an ``nn.Parameter`` subclass whose ``grad`` setter reports a ``None`` assignment
  to the engine, which drops that parameter's part of the shard gradient. Autograd writes ``.grad``
  below Python and never goes through the property; the engine's own writes use
  :func:`set_grad_quietly`.
- ``module.zero_grad(set_to_none)`` on any module: torch's version skips a parameter whose ``grad``
  is already None, which is every parameter at stages 2-3, so it would never reach the setter.
  While an engine lives, ``nn.Module.zero_grad`` is wrapped to report the module afterwards, and
  the engine clears (or, with ``set_to_none=False``, zeroes but keeps stepping) the shard gradients
  of that module's parameters, unit by unit. The ``p.grad = None`` writes torch's version makes on
  the way (stage 1's ``p.grad`` views) are not reported one by one: the module report covers them.
  Modules whose parameters no engine manages are unaffected.

A parameter cleared alone, in a unit whose other parameters keep their gradients, gets a zero
gradient in the step (stateful optimizers still move it, see ``ZeroConfig.find_unused_parameters``).

[Note: released parameters are guarded]
A released stage-3 parameter's ``.data`` is a NaN placeholder (see [Note: released parameters] in
flat_unit.py). So that code reading or writing it outside forward/backward (a callback, a logging
hook, ``copy.deepcopy`` of the model) gets an error naming the parameter instead of NaN or torch's
"more than one element of the written-to tensor" error, a released parameter's class is
``ReleasedParameter``, whose ``__torch_function__`` refuses every operation except metadata
(shape, dtype, ``numel``, ``requires_grad``, hooks, hashing: what Lightning's summary, optimizers'
bookkeeping and autograd registration use). Gathering a unit swaps its parameters back to
``ZeroParameter``, which has no ``__torch_function__``: forward and backward pay nothing, and the
guard costs one class assignment per parameter per gather and release. Autograd and compiled graphs
work below Python and never see the guard.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from lzero.engine.tensor_parallel import is_dtensor
from lzero.errors import ZeroError

_RAW_GRAD = torch._C.TensorBase.grad  # the C-level descriptor autograd itself uses
_T = torch.Tensor
_ORIGINAL_ZERO_GRAD = nn.Module.zero_grad
_PARAM_LISTENERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> callback(parameter)
_MODULE_LISTENERS: list[Callable[[nn.Module, bool], None]] = []  # callback(module, set_to_none)
_EMPTY_GRAD_READERS: list[Callable[[nn.Parameter], None]] = []  # inside reporting_empty_grad_reads: callback(p)


class ZeroParameter(nn.Parameter):
    """A parameter managed by a ZeRO engine: ``p.grad = None`` is reported. See [Note: clearing gradients]."""

    @property
    def grad(self) -> Optional[Tensor]:  # type: ignore[override]
        value = _RAW_GRAD.__get__(self)
        if value is None and _EMPTY_GRAD_READERS:
            _EMPTY_GRAD_READERS[-1](self)
        return value

    @grad.setter
    def grad(self, value: Optional[Tensor]) -> None:
        _RAW_GRAD.__set__(self, value)
        if value is None and not _INSIDE_MODULE_ZERO_GRAD[0]:  # a module's zero_grad is reported once, whole
            listener = _PARAM_LISTENERS.get(self)
            if listener is not None:
                listener(self)


class ReleasedParameterError(ZeroError, RuntimeError):
    """Code touched a stage-3 parameter whose full value is released. See [Note: released parameters are guarded]."""


_METADATA = {
    _T.numel, _T.nelement, _T.size, _T.dim, _T.element_size, _T.is_floating_point, _T.is_complex, _T.__hash__,
    _T.requires_grad_, _T.register_hook, _T.register_post_accumulate_grad_hook, _T.untyped_storage, _T.data_ptr,
    _T.data.__set__, _T.grad.__get__, _T.grad.__set__, _T.requires_grad.__get__, _T.requires_grad.__set__,
    *(getattr(_T, name).__get__ for name in ("shape", "dtype", "device", "ndim", "is_leaf", "layout", "grad_fn",
                                               "is_sparse", "is_cuda", "is_meta", "is_quantized", "is_nested")),
}
"""What a released parameter still answers: nothing that reads or writes its values."""


class ReleasedParameter(ZeroParameter):
    """A stage-3 parameter between uses. See [Note: released parameters are guarded]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise _released_error(func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        raise _released_error("copy.deepcopy", (self,), None)

    def __reduce_ex__(self, protocol: int) -> None:
        raise _released_error("pickle", (self,), None)


def _released_error(func: object, args: tuple, kwargs: Optional[dict]) -> ReleasedParameterError:
    from torch.utils._pytree import tree_flatten

    names = [_NAMES.get(t, "?") for t in tree_flatten((args, kwargs or {}))[0] if released(t)]
    what = getattr(func, "__name__", str(func))
    return ReleasedParameterError(
        f"`{what}` on the ZeRO-3 parameter {', '.join(f'`{n}`' for n in dict.fromkeys(names))}, whose full value is"
        " released between uses (only this rank's shard is resident): it would read or write a placeholder."
        " HINT: wrap the access in `with trainer.strategy.gathered_parameters(module):` (a collective: enter it on"
        " every rank). After `fit` the model stays sharded: `trainer.save_checkpoint(path)` writes it (`lzero"
        " consolidate` turns that into one plain state_dict, `lzero export-hf` into a Hugging Face folder),"
        " `lzero.unshard(model)` gathers it back into whole tensors on every rank, and"
        " `ZeroConfig(gather_after_fit=True)` does so at the end of every fit. Or use `zero2`, which keeps full"
        " parameters."
    )


_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # released parameter -> its name, for errors


def name_param(p: nn.Parameter, name: str) -> None:
    """The name errors about ``p`` give, once released."""
    _NAMES[p] = name


_OWN_CLASSES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # released parameter -> its own subclass of Parameter


_RELEASED_DTENSOR: list[type] = []  # the guard's DTensor class, made once torch's DTensor is in use


def _released_dtensor() -> type:
    """The class of a released tensor-parallel parameter: torch's ``DTensor`` (whose ``__slots__`` rule out a
    ``Parameter`` class, so ``ReleasedParameter`` cannot take its place) with the same guard. Its local tensor is
    the placeholder (see [Note: tensor parallel under ZeRO] in tensor_parallel.py)."""
    if not _RELEASED_DTENSOR:
        from torch.distributed.tensor import DTensor

        class ReleasedDTensor(DTensor):
            """A stage-3 tensor-parallel parameter between uses. See [Note: released parameters are guarded]."""

            __slots__ = ()
            __torch_function__ = ReleasedParameter.__torch_function__
            __deepcopy__ = ReleasedParameter.__deepcopy__
            __reduce_ex__ = ReleasedParameter.__reduce_ex__

            # DTensor's own methods read the local tensor below ``__torch_function__``
            def to_local(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                raise _released_error("to_local", (self,), None)

            def full_tensor(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                raise _released_error("full_tensor", (self,), None)

            def redistribute(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                raise _released_error("redistribute", (self,), None)

        _RELEASED_DTENSOR.append(ReleasedDTensor)
    return _RELEASED_DTENSOR[0]


def released(p: torch.Tensor) -> bool:
    """Whether ``p`` is a released stage-3 parameter (guarded)."""
    return type(p) is ReleasedParameter or (bool(_RELEASED_DTENSOR) and type(p) is _RELEASED_DTENSOR[0])


def mark_released(p: nn.Parameter) -> None:
    """``p`` points at a placeholder now: refuse access to it. See [Note: released parameters are guarded].
    A parameter of a class of its own (bitsandbytes' ``Params4bit``, torch's ``DTensor``) gets that class back when
    gathered."""
    if released(p):
        return
    if type(p) not in (ZeroParameter, nn.Parameter):
        _OWN_CLASSES[p] = type(p)
    p.__class__ = _released_dtensor() if is_dtensor(p) else ReleasedParameter


def own_class(p: torch.Tensor) -> type:
    """``p``'s class, or while it is released, the class of its own it gets back when gathered."""
    return _OWN_CLASSES.get(p, type(p)) if released(p) else type(p)


def mark_gathered(p: nn.Parameter) -> None:
    """``p`` holds its full value again."""
    if released(p):
        p.__class__ = _OWN_CLASSES.pop(p, ZeroParameter)


def drop_released(module: nn.Module) -> None:
    """Every released parameter of ``module`` (tied ones alike) replaced by a meta parameter of its shape and dtype:
    for a setup that stopped part way, whose shards no collective may gather now (see [Note: a setup that stops part
    way] in engine.py). Lightning moves nothing of a meta model, so nothing touches the placeholders."""
    fresh: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if released(p):
                if id(p) not in fresh:
                    fresh[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                requires_grad=p.requires_grad)
                m._parameters[name] = fresh[id(p)]


_INSIDE_MODULE_ZERO_GRAD = [0]  # depth of wrapped ``nn.Module.zero_grad`` calls running now


def _zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    _INSIDE_MODULE_ZERO_GRAD[0] += 1
    try:
        _ORIGINAL_ZERO_GRAD(self, set_to_none)
    finally:
        _INSIDE_MODULE_ZERO_GRAD[0] -= 1
    for listener in list(_MODULE_LISTENERS):
        listener(self, set_to_none)


def watch(params: Iterable[nn.Parameter], on_param_cleared: Callable[[nn.Parameter], None],
          on_module_zero_grad: Callable[[nn.Module, bool], None]) -> None:
    """Report ``p.grad = None`` on ``params`` and every ``module.zero_grad()`` until :func:`unwatch`."""
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = ZeroParameter
        _PARAM_LISTENERS[p] = on_param_cleared
    _MODULE_LISTENERS.append(on_module_zero_grad)
    nn.Module.zero_grad = _zero_grad  # type: ignore[method-assign]


def unwatch(params: Iterable[nn.Parameter], on_module_zero_grad: Callable[[nn.Module, bool], None]) -> None:
    """Give ``params`` back their plain class; unwrap ``nn.Module.zero_grad`` once no engine watches."""
    for p in params:
        _PARAM_LISTENERS.pop(p, None)
        _NAMES.pop(p, None)  # no weak reference left: torch swaps a DTensor parameter moved by ``module.to``
        if type(p) is ZeroParameter or released(p):
            p.__class__ = _OWN_CLASSES.pop(p, nn.Parameter)
    if on_module_zero_grad in _MODULE_LISTENERS:
        _MODULE_LISTENERS.remove(on_module_zero_grad)
    if not _MODULE_LISTENERS:
        nn.Module.zero_grad = _ORIGINAL_ZERO_GRAD  # type: ignore[method-assign]


@contextmanager
def reporting_empty_grad_reads(callback: Callable[[nn.Parameter], None]) -> Iterator[None]:
    """Inside the block, reading ``p.grad`` of a managed parameter that has none calls ``callback(p)``: code that
    looks for gradients where ZeRO keeps none (they live in the shards), e.g. Lightning's ``grad_norm(self)``."""
    _EMPTY_GRAD_READERS.append(callback)
    try:
        yield
    finally:
        _EMPTY_GRAD_READERS.remove(callback)


def set_grad_quietly(p: Tensor, value: Optional[Tensor]) -> None:
    """Set ``p.grad`` without reporting it (the engine's own bookkeeping)."""
    _RAW_GRAD.__set__(p, value)


def raw_grad(p: Tensor) -> Optional[Tensor]:
    """``p.grad`` as autograd holds it, without the empty-read report of ``ZeroParameter.grad``."""
    return _RAW_GRAD.__get__(p)


def quiet_params():  # -> ContextManager[None]
    """Inside the block, the engine's own metadata reads and ``grad`` writes on its parameters skip the guard's
    ``__torch_function__`` (a Python call per access on a released parameter); nothing inside may touch values."""
    return torch._C.DisableTorchFunctionSubclass()
