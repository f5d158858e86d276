"""Activation checkpointing: chosen modules keep only their inputs in forward and recompute the rest in backward.

[Note: checkpointing inside the module's hooks]
A chosen module instance gets an instance attribute ``forward`` that runs its original (bound)
``forward`` under torch's non-reentrant ``torch.utils.checkpoint.checkpoint``. The module is not
wrapped, so parameter names, ``state_dict()`` keys and checkpoints are those of the plain model
(``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to every name below it).

``Module.__call__`` runs the hooks around ``self.forward``, so the checkpoint sits inside the
module's own hooks. At stage 3, with the chosen modules being the units (``activation_checkpointing=True``)
or modules inside them, the unit's forward pre-hook gathers it, the checkpointed forward runs,
the forward hook releases it and hooks its outputs. In backward the output hooks gather the unit
again before any of its backward nodes runs; the first of those nodes to unpack a saved tensor
makes autograd recompute the forward, which therefore reads whole parameters; the unit is
released once all its gradients are in (see [Note: stage-3 parameter lifecycle] in gather.py).
The recomputation calls the original ``forward`` directly, so the unit's own hooks do not run a
second time. A chosen module that strictly contains a unit would not work: recomputing it runs
the inner unit's forward hook, which releases that unit before its backward nodes read it. Such a
choice is refused at stage 3.

With ``cpu_checkpointing`` the checkpoint runs under ``torch.autograd.graph.save_on_cpu``. The
non-reentrant checkpoint saves the module's positional tensor inputs as ordinary saved tensors
(everything inside the module is recomputed), so those inputs, the activations at the checkpoint
boundaries, are what is copied to host memory (pinned when they are on CUDA) and copied back when
backward recomputes the module, as DeepSpeed's ``cpu_checkpointing`` does. Keyword tensor arguments
stay where they are.
"""

from __future__ import annotations

import difflib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine.units import find_blocks

ModuleChoice = Union[None, bool, Sequence[Union[str, type]]]

_ORIGINAL = "_lzero_checkpointed"  # attribute of our forward: the bound forward it replaced


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which modules recompute their forward in backward, and where their saved inputs live."""

    modules: ModuleChoice = None
    """None or False: off. True: the stage-3 unit classes (``lzero.engine.units.find_blocks`` with
    ``unit_modules``), at every stage. A list: module classes (``isinstance``) or class names,
    matched against ``type(m).__name__`` or ``module.qualname``. Only the outermost chosen instances
    are checkpointed (an inner one would be recomputed twice)."""

    cpu: bool = False
    """Keep the checkpointed modules' saved inputs in host memory (``save_on_cpu``, pinned on CUDA)."""

    def __post_init__(self) -> None:
        modules = self.modules
        if modules is not None and not isinstance(modules, bool):
            if isinstance(modules, (str, type)) or not isinstance(modules, Sequence) or \
                    not all(isinstance(m, (str, type)) for m in modules):
                raise ZeroConfigError(
                    f"`activation_checkpointing={modules!r}` must be True, False/None, or a list of module classes or"
                    " class names. HINT: e.g. `activation_checkpointing=True` (the transformer blocks) or"
                    " `activation_checkpointing=['Block']`."
                )
            if not modules:
                raise ZeroConfigError("`activation_checkpointing=[]` names no module. HINT: use None to turn it off,"
                                      " True for the transformer blocks, or e.g. `['Block']`.")
            object.__setattr__(self, "modules", tuple(modules))
        if not isinstance(self.cpu, bool):
            raise ZeroConfigError(f"`cpu_checkpointing={self.cpu!r}` must be True or False.")
        if self.cpu and not self.enabled:
            raise ZeroConfigError(
                "`cpu_checkpointing=True` moves the inputs of checkpointed modules to host memory, but"
                f" `activation_checkpointing={modules!r}` checkpoints no module. HINT: also set"
                " `activation_checkpointing=True` (the transformer blocks) or a list of module classes."
            )

    @property
    def enabled(self) -> bool:
        return self.modules is not None and self.modules is not False


class Checkpointed:
    """The modules whose ``forward`` runs under checkpoint; :meth:`remove` gives them their own back."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules  # path -> module

    def remove(self) -> None:
        for module in self.modules.values():
            if _original_forward(module) is not None:
                del module.__dict__["forward"]
        self.modules = {}


def apply(model: nn.Module, policy: CheckpointPolicy, config: ZeroConfig) -> Optional[Checkpointed]:
    """Checkpoint the modules ``policy`` chooses in ``model``; None when it is off. Refuses a choice that
    matches nothing, a module with a ``forward`` of its own instance (other than lzero's), and, at stage 3, a module around a
    unit (see [Note: checkpointing inside the module's hooks])."""
    if not policy.enabled:
        return None
    chosen = _outermost(_choose(model, policy.modules, config))
    chosen = _skip_wrapped(model, chosen)
    if config.stage >= 3:
        _refuse_around_units(chosen, find_blocks(model, config.unit_modules))
    for path, module in chosen.items():
        if "forward" in module.__dict__ and _original_forward(module) is None:
            raise ZeroConfigError(
                f"activation_checkpointing: module `{path or '<root>'}` ({type(module).__name__}) already has a"
                f" `forward` of its own instance ({module.__dict__['forward']!r}), set by another wrapper or patch;"
                " lzero replaces `forward` on the instance to checkpoint it. HINT: remove that patch, or leave this"
                " module out of `activation_checkpointing`."
            )
    for module in chosen.values():  # ours from an earlier fit is replaced, not stacked
        original = _original_forward(module) or module.forward
        module.__dict__["forward"] = _checkpointed_forward(original, policy.cpu)
    return Checkpointed(chosen)


def _checkpointed_forward(original: Callable[..., Any], cpu: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # no backward to recompute for (validation, no_grad)
            return original(*args, **kwargs)
        fn = functools.partial(original, **kwargs) if kwargs else original  # kwargs never reach checkpoint's own
        if not cpu:
            return checkpoint(fn, *args, use_reentrant=False)
        on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten(args)[0])
        with save_on_cpu(pin_memory=on_cuda):
            return checkpoint(fn, *args, use_reentrant=False)

    setattr(forward, _ORIGINAL, original)
    return forward


def _original_forward(module: nn.Module) -> Optional[Callable[..., Any]]:
    return getattr(module.__dict__.get("forward"), _ORIGINAL, None)


# --- choosing the modules --------------------------------------------------------------------


def _choose(model: nn.Module, modules: Any, config: ZeroConfig) -> dict[str, nn.Module]:
    if modules is True:
        try:
            found = find_blocks(model, config.unit_modules)
        except ValueError as err:
            raise ZeroConfigError(f"activation_checkpointing=True checkpoints the units: {err}") from err
        if not found:
            raise ZeroConfigError(
                f"`activation_checkpointing=True` checkpoints the repeated blocks, but {type(model).__name__} has no"
                " module class with two or more instances holding parameters. HINT: name the modules,"
                f" e.g. `activation_checkpointing=['{_classes(model)[-1]}']`; present: {_classes(model)}."
            )
        return found
    for entry in modules:
        if not any(_matches(m, entry) for m in model.modules()):
            raise ZeroConfigError(_unknown(model, entry))
    return {path: m for path, m in model.named_modules() if any(_matches(m, e) for e in modules)}


def _matches(module: nn.Module, entry: Union[str, type]) -> bool:
    if isinstance(entry, type):
        return isinstance(module, entry)
    cls = type(module)
    return entry in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _unknown(model: nn.Module, entry: Union[str, type]) -> str:
    name = entry.__name__ if isinstance(entry, type) else entry.rsplit(".", 1)[-1]
    present = _classes(model)
    close = difflib.get_close_matches(name, present, n=1)
    guess = f"did you mean '{close[0]}'? " if close else ""
    return (f"`activation_checkpointing` names {entry!r}, which {type(model).__name__} does not contain."
            f" HINT: {guess}the model's module classes are {present}.")


def _classes(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def _outermost(chosen: dict[str, nn.Module]) -> dict[str, nn.Module]:
    def inside(path: str, other: str) -> bool:
        return other != path and (other == "" or path.startswith(other + "."))

    return {p: m for p, m in chosen.items() if not any(inside(p, q) for q in chosen)}


def _skip_wrapped(model: nn.Module, chosen: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Leave out modules that torch's ``checkpoint_wrapper`` already checkpoints (or that are one), with a warning."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    wrappers = [p for p, m in model.named_modules() if isinstance(m, ActivationWrapper)]
    wrapped = [p for p in chosen if any(p == w or p.startswith(w + ".") or w == "" for w in wrappers)]
    if wrapped:
        warnings.warn(
            f"lzero activation_checkpointing: skips {wrapped}: already inside torch's checkpoint_wrapper, which"
            " checkpoints them (checkpointing twice would recompute twice).", stacklevel=3)
    return {p: m for p, m in chosen.items() if p not in wrapped}


def _refuse_around_units(chosen: dict[str, nn.Module], units: dict[str, nn.Module]) -> None:
    for path, module in chosen.items():
        inner = [u for u in units if u != path and (path == "" or u.startswith(path + "."))]
        if inner:
            raise ZeroConfigError(
                f"activation_checkpointing: module `{path or '<root>'}` ({type(module).__name__}) contains the stage-3"
                f" units {inner[:4]}{' ...' if len(inner) > 4 else ''}; recomputing it in backward would release"
                " them before their backward runs. HINT: checkpoint the units themselves"
                " (`activation_checkpointing=True`) or modules inside them."
            )


# --- DeepSpeed's block -----------------------------------------------------------------------

_DEEPSPEED_REFUSED = {
    "partition_activations": "splits every checkpointed input across the tensor (model) parallel group; lzero is"
                             " data parallel only, so there is no such group",
    "contiguous_memory_optimization": "copies the checkpointed inputs into one preallocated contiguous buffer;"
                                      " lzero leaves them to torch's caching allocator",
    "synchronize_checkpoint_boundary": "synchronizes the device at every checkpoint boundary (a profiling aid);"
                                       " lzero does not",
    "profile": "times the forward and recomputation of every checkpointed function; use torch.profiler instead",
}


def from_deepspeed(block: dict) -> dict:
    """The ``ZeroStrategy`` arguments for DeepSpeed's ``activation_checkpointing`` config block.

    DeepSpeed checkpoints what the model wraps in ``deepspeed.checkpointing.checkpoint``; the block only
    configures how. So it maps to ``cpu_checkpointing`` alone, and ``activation_checkpointing`` (which
    modules) is for the caller to set. Options lzero does not have are refused by name when turned on:
    ``partition_activations``, ``contiguous_memory_optimization``, ``synchronize_checkpoint_boundary``,
    ``profile``, and ``number_checkpoints`` (it only sizes the contiguous buffer); unknown keys too.
    """
    if not isinstance(block, dict):
        raise ZeroConfigError(f"DeepSpeed `activation_checkpointing` must be a JSON object, got {block!r}.")
    known = ["cpu_checkpointing", "number_checkpoints", *_DEEPSPEED_REFUSED]
    for key, value in block.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"the keys are: {', '.join(known)}."
            raise ZeroConfigError(f"Unknown DeepSpeed activation_checkpointing key `{key}`. HINT: {hint}")
        if key == "number_checkpoints":
            if value is not None:
                raise ZeroConfigError(
                    f"DeepSpeed activation_checkpointing `number_checkpoints={value!r}` sizes the buffer of"
                    " `contiguous_memory_optimization`, which lzero does not have. HINT: remove it."
                )
            continue
        if not isinstance(value, bool):
            raise ZeroConfigError(f"DeepSpeed activation_checkpointing `{key}={value!r}` must be true or false.")
        if key in _DEEPSPEED_REFUSED and value:
            raise ZeroConfigError(
                f"DeepSpeed activation_checkpointing `{key}: true` is not supported: it {_DEEPSPEED_REFUSED[key]}."
                f" HINT: set `{key}: false` or remove it."
            )
    return {"cpu_checkpointing": block.get("cpu_checkpointing", False)}
