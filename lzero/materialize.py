"""Stage 3 sharded initialization: a model built on the meta device is materialized one unit at a time.

Every rank materializes the same block with the same RNG state, initializes it with the module's
``reset_parameters()`` (or the user's ``init_fn``), keeps its shard and frees the rest before the
next block, so no rank ever holds more than one block of full parameters beyond its shards.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


class UninitializedModuleError(RuntimeError):
    """A module built on the meta device that lzero cannot initialize."""


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _direct_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=False)) or any(
        t.is_meta for t in module.buffers(recurse=False)
    )


class Materializer:
    """Replaces meta tensors module by module, keeping shared (tied) parameters shared.

    A meta Parameter cannot be given real storage in place, so each one is replaced by a new
    Parameter in every module that holds it; ``replaced`` maps old to new so that optimizers built
    on the meta model can be pointed at the real parameters.
    """

    def __init__(self, root: nn.Module, device: torch.device, init_fn: Optional[InitFn]) -> None:
        self.device = device
        self.init_fn = init_fn
        self.replaced: dict[nn.Parameter, nn.Parameter] = {}
        self._holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in root.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self._holders.setdefault(id(p), []).append((module, name))

    @torch.no_grad()
    def run(self, modules: Iterable[tuple[str, nn.Module]]) -> None:
        """Real storage for every module that still has meta tensors of its own, then its init."""
        for name, module in modules:
            if not _direct_meta(module):
                continue
            for pname, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                       requires_grad=p.requires_grad)
                    for holder, hname in self._holders[id(p)]:
                        holder._parameters[hname] = new
                    self.replaced[p] = new
            for bname, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=self.device)
            self._initialize(name, module)

    def _initialize(self, name: str, module: nn.Module) -> None:
        if self.init_fn is not None:
            self.init_fn(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        else:
            raise UninitializedModuleError(
                f"Module `{name or '<root>'}` ({type(module).__name__}) was built on the meta device and has no"
                " `reset_parameters()`, so lzero cannot initialize its parameters/buffers. HINT: give it a"
                " `reset_parameters()` method, or pass `ZeroStrategy(init_fn=...)` (a function called on every"
                " module; note that Hugging Face models initialize in `_init_weights`, e.g."
                " `init_fn=model._init_weights`)."
            )

    def retarget(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Point optimizers built on the meta model at the materialized parameters."""
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self.replaced.get(p, p) for p in group["params"]]


def common_seed(broadcast: Callable[[torch.Tensor], None]) -> int:
    """A seed drawn on rank 0 and shared, so every rank initializes a block identically."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    broadcast(seed)
    return int(seed.item())
