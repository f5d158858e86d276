"""Stage 3 sharded initialization: a model built on the meta device is materialized one unit at a time.

[Note: meta-device initialization]
A model whose construction lzero recorded is not initialized here but replayed, bitwise as eager construction
([Note: replayed construction] in replay.py); what follows is the block-wise initialization used with ``init_fn``,
for what a pretrained checkpoint does not hold, and where the record cannot be replayed.

Built eagerly, a model is initialized in two passes: every module runs its own ``reset_parameters()``
as it is constructed (children before parents), then a model-wide initializer visits every module in
``Module.apply`` order (children before parents) and may write any parameter below the module it is
given: Hugging Face's ``post_init`` calls ``_init_weights`` on each module, and GPT-2's, given an
attention or MLP module, rescales its ``c_proj.weight`` by depth. Modules the initializer does not
know (a LoRA adapter added by the user) keep what their own ``reset_parameters()`` wrote.

lzero replays both passes for the modules of one unit at a time: storage for the unit's meta
tensors, every ``reset_parameters()`` of a module holding meta tensors of its own, then the
initializer on every module holding meta tensors anywhere below it (modules without parameters of
their own included), in ``Module.apply`` order. The initializer is ``ZeroStrategy(init_fn=...)`` or,
without one, for modules inside a Hugging Face ``PreTrainedModel``, that model's ``_init_weights``
(the innermost one, as Hugging Face dispatches for composite models). Block units come first and the
root unit last, so ancestors of blocks (the model itself) are visited after their blocks, as in
``apply``; an initializer that writes a block's parameters while visiting a module above the block is
not supported (the block is sharded by then).

New floating-point storage starts as NaN: once the unit is initialized, a tensor still holding NaN was
not (entirely) written by any initializer, and is named in an :class:`UninitializedModuleError`
rather than trained from uninitialized memory. Integer and boolean buffers start at zero (no such
check is possible for them). Every rank runs this with the same RNG state (``common_seed``), so the
ranks build one model; each keeps its shard and frees the rest before the next unit.

Tensors whose values come from a checkpoint (a pretrained model: lzero/hf/) are given unwritten storage and
no initializer runs for a module whose tensors, at and below it, all come from there; each rank reads its
pieces of them straight into its shards. peft's LoRA layers are initialized by peft's own
``reset_lora_parameters`` after Hugging Face's ``_init_weights`` (which would draw a nonzero ``lora_B``).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Protocol

import torch
from torch import nn

from lzero.engine.partition import UnitSpec
from lzero.errors import ZeroError

InitFn = Callable[[nn.Module], None]


class WeightSource(Protocol):
    """Values of some of a model's tensors, read by flat range: a pretrained checkpoint (lzero/hf/pretrained.py)."""

    def holds(self, name: str) -> bool:
        """Whether the tensor called ``name`` in the root module is read from the source."""

    def reading(self) -> ContextManager[Callable[[str, int, int, torch.Tensor], None]]:
        """``read(name, start, end, out)``: elements [start, end) of the flattened tensor ``name`` written into ``out``
        (1-D, converted to its dtype)."""

    def finish(self, root: nn.Module, all_reduce_max: Callable[[torch.Tensor], None], device: torch.device) -> None:
        """Every rank has read its shards; what the pieces alone cannot give (a quantized weight's whole scales) is
        completed. A collective."""


class UninitializedModuleError(ZeroError, RuntimeError):
    """A module built on the meta device that lzero cannot initialize."""


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _direct_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=False)) or any(
        t.is_meta for t in module.buffers(recurse=False)
    )


def apply_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) in the order ``root.apply`` visits them: children before parents, each module once."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", root)
    return order


def _hf_initializers(root: nn.Module) -> dict[int, InitFn]:
    """id(module) -> ``_init_weights`` of the innermost Hugging Face ``PreTrainedModel`` holding it."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if pretrained is None:  # a model built from transformers has imported it
        return {}
    found: dict[int, InitFn] = {}

    def visit(module: nn.Module, owner: Optional[InitFn]) -> None:
        if isinstance(module, pretrained):
            owner = module._init_weights
        if owner is not None:
            found.setdefault(id(module), owner)
        for child in module.children():
            if id(child) not in found:
                visit(child, owner)

    visit(root, None)
    return found


def _peft_initializers(root: nn.Module, others: dict[int, InitFn]) -> dict[int, InitFn]:
    """``others`` with peft's LoRA layers re-initialized as peft initializes them (``reset_lora_parameters`` with the
    adapter's ``init_lora_weights``) after any other initializer ran on them: Hugging Face's ``_init_weights`` would
    draw a nonzero ``lora_B``. Recognized by shape (a module with ``peft_config`` above layers with
    ``reset_lora_parameters``), so peft is never imported here."""
    found = dict(others)
    for top in root.modules():
        configs = getattr(top, "peft_config", None)
        if not isinstance(configs, dict):
            continue
        for module in top.modules():
            if not callable(getattr(module, "reset_lora_parameters", None)):
                continue
            adapters = [a for a in getattr(module, "lora_A", {}) if a in configs]
            found[id(module)] = partial(_reset_lora, adapters, configs, others.get(id(module)))
            for name in ("lora_A", "lora_B"):  # their own reset_parameters(), as peft leaves them before its reset
                for child in getattr(module, name, {}).values():
                    found.pop(id(child), None)
    return found


def _reset_lora(adapters: list[str], configs: dict[str, Any], before: Optional[InitFn], module: nn.Module) -> None:
    if before is not None:
        before(module)
    for adapter in adapters:
        init = getattr(configs[adapter], "init_lora_weights", True)
        if init not in (True, False, "gaussian"):
            raise UninitializedModuleError(
                f"The LoRA adapter `{adapter}` uses init_lora_weights={init!r}, which computes the adapter from the"
                " base weights; built on the meta device under zero3, the base weights are not there yet. HINT: use"
                " init_lora_weights=True or 'gaussian', or build the adapter outside `configure_model`.")
        module.reset_lora_parameters(adapter, init)


class Materializer:
    """Replaces meta tensors unit by unit and initializes them; see [Note: meta-device initialization].

    A meta Parameter cannot be given real storage in place, so each one is replaced by a new
    Parameter in every module that holds it (tied parameters stay tied); ``replaced`` maps old to new
    so that optimizers built on the meta model can be pointed at the real parameters.
    """

    def __init__(self, root: nn.Module, device: torch.device, init_fn: Optional[InitFn],
                 loaded: frozenset[int] = frozenset()) -> None:
        self.device = device
        self.replaced: dict[nn.Parameter, nn.Parameter] = {}
        self._holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in root.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self._holders.setdefault(id(p), []).append((module, name))
        self._holding_meta = {id(m) for m in root.modules() if has_meta(m)}
        self._init_fn = init_fn
        self._hf = {} if init_fn is not None else _peft_initializers(root, _hf_initializers(root))
        self._done: set[int] = set()
        self._loaded = loaded  # id of each meta tensor whose values come from a checkpoint: allocated, not initialized
        # modules with a meta tensor to initialize at or below them (without ``loaded``: every module holding meta)
        self._fresh_below = {id(m) for m in root.modules()
                             if any(t.is_meta and id(t) not in loaded for t in [*m.parameters(), *m.buffers()])}

    @torch.no_grad()
    def run(self, modules: Iterable[tuple[str, nn.Module]]) -> None:
        """Materialize and initialize ``modules`` (one unit's, in ``apply`` order); modules already run are
        skipped. Raises :class:`UninitializedModuleError` if a new tensor is left (partly) unwritten. Tensors
        in ``loaded`` get unwritten storage (``torch.empty``: pages nobody writes cost no memory), and a module
        whose new tensors are all loaded is not initialized."""
        todo = [(n, m) for n, m in modules if id(m) in self._holding_meta and id(m) not in self._done]
        self._done.update(id(m) for _, m in todo)
        created = []
        for n, m in todo:
            new = list(self._allocate(m))
            fresh = [(name, t) for name, t, old in new if id(old) not in self._loaded]
            if fresh or (not new and id(m) in self._fresh_below):  # nothing to initialize when all is loaded
                created.append((n, m, fresh))
        for name, module, tensors in created:
            if tensors and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        for name, module, _ in created:
            initializer = self._init_fn or self._hf.get(id(module))
            if initializer is not None:
                initializer(module)
        for name, module, tensors in created:
            unwritten = [t for t, value in tensors if value.is_floating_point() and bool(value.isnan().any())]
            if unwritten:
                raise self._error(name, module, unwritten)

    def _allocate(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """Real storage (NaN, or zero for integer/boolean tensors; unwritten for loaded ones) for ``module``'s own
        meta tensors: (name, new tensor, the meta tensor it replaces)."""
        def new_tensor(meta: torch.Tensor) -> torch.Tensor:
            if id(meta) in self._loaded:
                return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            return _placeholder(meta, self.device)

        for pname, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                new = _like(p, new_tensor(p))
                for holder, hname in self._holders[id(p)]:
                    holder._parameters[hname] = new
                self.replaced[p] = new
                yield pname, new, p
        for bname, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[bname] = new_tensor(b)
                yield bname, module._buffers[bname], b

    def _error(self, name: str, module: nn.Module, unwritten: list[str]) -> UninitializedModuleError:
        full = [f"`{name}.{t}`" if name else f"`{t}`" for t in unwritten]
        own = "its `reset_parameters()`" if callable(getattr(module, "reset_parameters", None)) else \
            "it has no `reset_parameters()`"
        by = "the `init_fn`" if self._init_fn is not None else (
            "Hugging Face's `_init_weights`" if id(module) in self._hf else "no `init_fn` was given")
        return UninitializedModuleError(
            f"Module `{name or '<root>'}` ({type(module).__name__}) was built on the meta device and nothing wrote"
            f" {', '.join(full)} ({own}; {by}), so lzero cannot initialize it. HINT: give the module a"
            " `reset_parameters()` that writes every parameter and buffer of its own, or pass"
            " `ZeroStrategy(init_fn=...)`, a function called on every module (children before parents) that"
            " writes them."
        )

    def retarget(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Point optimizers built on the meta model at the materialized parameters."""
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self.replaced.get(p, p) for p in group["params"]]


def _like(meta: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``data`` of the meta parameter's own class and attributes (bitsandbytes' ``Params4bit``
    keeps its quantization settings and module)."""
    if type(meta) is nn.Parameter:
        return nn.Parameter(data, requires_grad=meta.requires_grad)
    new = torch.Tensor._make_subclass(type(meta), data, meta.requires_grad)
    new.__dict__.update(meta.__dict__)
    return new


def shard_values(spec: UnitSpec, rank: int, params: list[nn.Parameter], device: torch.device,
                 weights: WeightSource) -> torch.Tensor:
    """``rank``'s shard of unit ``spec``'s values (1D, shard_numel): the pieces ``weights`` holds read straight into
    it, the others taken from the materialized ``params``; the padding is zero. See [Note: reading a pretrained
    checkpoint into shards] in hf/weights.py."""
    built = getattr(weights, "unit_values", None)  # a source that builds whole shards (a replay: replayed_weights.py)
    values = built(spec, rank) if built is not None else None
    index = {p.name: i for i, p in enumerate(spec.params)}
    if values is not None:  # its pieces of tensors it does not hold: from the materialized parameters
        with torch.no_grad():
            for param, start, end, at in spec.owned_pieces(rank):
                if not weights.holds(param.name):
                    values[at: at + end - start].copy_(params[index[param.name]].detach().reshape(-1)[start:end])
        return values
    values = torch.empty(spec.shard_numel, dtype=params[0].dtype, device=device)
    for a, b in spec.padding(rank):
        values[a:b].zero_()
    with weights.reading() as read, torch.no_grad():
        for param, start, end, at in spec.owned_pieces(rank):
            piece = values[at: at + end - start]
            if weights.holds(param.name):
                read(param.name, start, end, piece)
            else:
                piece.copy_(params[index[param.name]].detach().reshape(-1)[start:end])
    return values


@torch.no_grad()
def read_whole(module: nn.Module, weights: WeightSource, wanted: Callable[[torch.Tensor], bool]) -> None:
    """The ``wanted`` tensors of ``module`` that ``weights`` holds, read whole over their current values."""
    named = [*module.named_parameters(), *module.named_buffers()]
    with weights.reading() as read:
        for name, t in named:
            if weights.holds(name) and not t.is_meta and wanted(t):
                whole = t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)
                read(name, 0, t.numel(), whole)
                if whole.data_ptr() != t.data_ptr():
                    t.copy_(whole.view(t.shape))


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Real buffers not on ``device`` moved there (a pretrained model's buffers are built on the CPU)."""
    for sub in module.modules():
        for name, b in sub._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                sub._buffers[name] = b.to(device)


def _placeholder(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    if meta.is_floating_point() or meta.is_complex():
        return torch.full(meta.shape, float("nan"), dtype=meta.dtype, device=device)
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)


def common_seed(broadcast: Callable[[torch.Tensor], None]) -> int:
    """A seed drawn on rank 0 and shared, so every rank initializes a block identically."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    broadcast(seed)
    return int(seed.item())
