"""A module set up by Fabric under lzero (fabric_strategy.py): what the strategy keeps for it, the parameters it is
given at setup (fresh objects, or placeholders for meta ones) and its state-dict methods, which work on the whole
sharded model. See [Note: the engine starts at first use] in fabric_strategy.py."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lzero.engine.engine import ZeroEngine
from lzero.engine.materialize import has_meta
from lzero.optimizer import ZeroOptimizer



@dataclass
class SetUpModel:
    """One set-up module and what the strategy keeps for it."""

    module: nn.Module
    zero: list[ZeroOptimizer] = field(default_factory=list)  # its set-up optimizers, in setup order
    engine: Optional[ZeroEngine] = None
    started: bool = False
    undo: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # hooks and shadows, until teardown
    inside: bool = False  # lzero itself is reading the module's state dict
    meta: dict[int, nn.Parameter] = field(default_factory=dict)  # id(placeholder) -> the meta parameter it holds for

    @property
    def on_meta(self) -> bool:
        """Not materialized yet (its meta parameters held by placeholders until the start)."""
        return not self.started and (bool(self.meta) or has_meta(self.module))

    def owns(self, optimizer: Optimizer) -> bool:
        mine = {id(p) for p in self.module.parameters()}
        return any(id(p) in mine for g in optimizer.param_groups for p in g["params"])


def fresh_parameters(module: nn.Module) -> None:
    """New ``Parameter`` objects over the same data (tied ones stay tied); quantized and other parameter classes are
    kept as they are."""
    made: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None or type(p) is not nn.Parameter:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.data, requires_grad=p.requires_grad)
            owner._parameters[name] = made[id(p)]


def placeholders(module: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Each meta parameter replaced by a placeholder of its shape, dtype and class over one element of memory (an
    expanded zero), so that an optimizer can be built from ``parameters()``. See [Note: the engine starts at first
    use]."""
    made: dict[int, nn.Parameter] = {}  # id(placeholder) -> the meta parameter
    by_meta: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in by_meta:
                data = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
                holder = nn.Parameter(data, requires_grad=p.requires_grad) if type(p) is nn.Parameter else \
                    torch.Tensor._make_subclass(type(p), data, p.requires_grad)
                by_meta[id(p)] = holder
                made[id(holder)] = p
            owner._parameters[name] = by_meta[id(p)]
    return made


def swap_parameters(module: nn.Module, optimizers: list[ZeroOptimizer], new: dict[int, nn.Parameter]) -> None:
    """Parameters ``id -> replacement`` in the module and in the optimizers' param groups (no state yet)."""
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is not None and id(p) in new:
                owner._parameters[name] = new[id(p)]
    for zopt in optimizers:
        for group in zopt.optimizer.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]


@contextlib.contextmanager
def state_dict_shadows(strategy: Any, model: SetUpModel) -> Iterator[None]:
    """``module.state_dict()`` and ``module.load_state_dict(...)`` on the set-up module (Fabric's wrapper sends both
    to it; ``strategy``: the ``ZeroFabricStrategy`` that set it up, not imported here: fabric_strategy.py imports
    this file)
    work on the whole model, as FSDP's full state dict: collectives, on every rank. lzero's own reads of the
    module's state dict (``model.inside``) see the module's own."""
    module = model.module
    own_state, own_load = type(module).state_dict, type(module).load_state_dict

    def state_dict(*args: Any, destination: Optional[dict] = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if model.inside or args:  # lzero's own reads (and torch's deprecated positional form)
            return own_state(module, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        strategy.all_ranks_at("`model.state_dict()`")
        full = strategy.full_state_dict(model)
        out = destination if destination is not None else {}
        out.update({prefix + k: v for k, v in full.items()})
        return out

    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if model.inside:
            return own_load(module, state_dict, strict=strict, assign=assign)
        strategy.load_full_state_dict(model, state_dict, strict)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    module.__dict__["state_dict"] = state_dict
    module.__dict__["load_state_dict"] = load_state_dict
    try:
        yield
    finally:
        module.__dict__.pop("state_dict", None)
        module.__dict__.pop("load_state_dict", None)
