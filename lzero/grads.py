"""Seeing a user clear gradients that live in the shards.

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
  of that module's parameters. Modules whose parameters no engine manages are unaffected.

A parameter cleared alone, in a unit whose other parameters keep their gradients, gets a zero
gradient in the step (stateful optimizers still move it, see ``ZeroConfig.find_unused_parameters``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

_RAW_GRAD = torch._C.TensorBase.grad  # the C-level descriptor autograd itself uses
_ORIGINAL_ZERO_GRAD = nn.Module.zero_grad
_PARAM_LISTENERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> callback(parameter)
_MODULE_LISTENERS: list[Callable[[nn.Module, bool], None]] = []  # callback(module, set_to_none)


class ZeroParameter(nn.Parameter):
    """A parameter managed by a ZeRO engine: ``p.grad = None`` is reported. See [Note: clearing gradients]."""

    @property
    def grad(self) -> Optional[Tensor]:  # type: ignore[override]
        return _RAW_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: Optional[Tensor]) -> None:
        _RAW_GRAD.__set__(self, value)
        if value is None:
            listener = _PARAM_LISTENERS.get(self)
            if listener is not None:
                listener(self)


def _zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    _ORIGINAL_ZERO_GRAD(self, set_to_none)
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
        if type(p) is ZeroParameter:
            p.__class__ = nn.Parameter
    if on_module_zero_grad in _MODULE_LISTENERS:
        _MODULE_LISTENERS.remove(on_module_zero_grad)
    if not _MODULE_LISTENERS:
        nn.Module.zero_grad = _ORIGINAL_ZERO_GRAD  # type: ignore[method-assign]


def set_grad_quietly(p: Tensor, value: Optional[Tensor]) -> None:
    """Set ``p.grad`` without reporting it (the engine's own bookkeeping)."""
    _RAW_GRAD.__set__(p, value)
