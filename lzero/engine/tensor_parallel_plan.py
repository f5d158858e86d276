"""The tensor-parallel plan the strategy applies itself (``tp_plan``): patterns resolved to modules, checked, applied.

[Note: the tensor-parallel plan]
With ``tp_plan`` set, the strategy parallelizes the LightningModule over ``device_mesh["tensor_parallel"]`` after
``configure_model`` and before ZeRO wraps it, as the user's ``parallelize_module`` would (see [Note: tensor parallel
under ZeRO] in tensor_parallel.py). A plan maps module-name patterns to style names. A pattern is matched component by
component against the dotted module names, each component with ``fnmatch`` (so ``*`` matches one component, as in
torch's ``parallelize_module`` and in Hugging Face's plans, whose ``layers.*`` stands for the layer's index); a pattern
``re:<regex>`` is searched in each module's weight name instead (``model.layers.0.self_attn.o_proj.weight``), as
DeepSpeed AutoTP's ``partition_config.layer_specs`` patterns are (lzero/deepspeed/config.py reads them so). Each
pattern is resolved to the module names it matches (``resolve_plan``), and everything that would otherwise fail late
or silently is refused there, without a process group: a pattern that matches nothing, a style other than
``colwise``/``rowwise``, a matched module that is not ``nn.Linear``, a size the tensor dimension does not divide
(silently uneven shards otherwise). ``"auto"`` (a Hugging Face model's ``base_model_tp_plan``, and the attention
heads the tensor dimension must divide) is read in lzero/hf/tensor_parallel_plan.py. ``apply_plan`` then calls
torch's ``parallelize_module`` with the resolved names: the same styles on the same modules as a user-written plan,
so the same numbers, bit for bit.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from lzero.config.zero_plus_plus import TP_STYLES
from lzero.errors import ZeroConfigError

_HINT = ("HINT: parallelize with `parallelize_module(..., self.device_mesh['tensor_parallel'], plan)` in"
         " `configure_model` yourself, and leave `tp_plan` None.")


def matches(pattern: str, name: str) -> bool:
    """Whether the dotted module ``name`` matches ``pattern``: as many components, each matched with ``fnmatch``."""
    want, got = pattern.split("."), name.split(".")
    return len(want) == len(got) and all(fnmatchcase(g, w) for w, g in zip(want, got))


def resolve_plan(root: nn.Module, plan: dict[str, str], tensor_parallel_size: int) -> dict[str, str]:
    """``plan``'s patterns as the names of ``root``'s modules they match, each with its style; refused by name (see
    [Note: the tensor-parallel plan]) where a pattern matches nothing, a style is not built, a module is not a Linear
    or ``tensor_parallel_size`` does not divide the dimension the style splits."""
    modules = dict(root.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ZeroConfigError(f"`tp_plan` style {style!r} for {pattern!r} is not built: lzero applies"
                                  f" {list(TP_STYLES)} (torch's ColwiseParallel() and RowwiseParallel()). {_HINT}")
        if pattern.startswith("re:"):  # a regex over parameter names, as DeepSpeed AutoTP's layer_specs
            regex = re.compile(pattern[3:])
            names = [name for name, module in modules.items()
                     if name and "weight" in module._parameters and regex.search(f"{name}.weight")]
        else:
            names = [name for name in modules if name and matches(pattern, name)]
        if not names:
            raise ZeroConfigError(f"`tp_plan` pattern {pattern!r} matches no module of {type(root).__name__}. HINT:"
                                  " patterns are module names from the LightningModule (`model.layers.*.mlp.up_proj`,"
                                  " `*` one component); see `print(lightning_module)` for the names.")
        for name in names:
            _check_module(name, modules[name], style, tensor_parallel_size)
            resolved[name] = style
    return resolved


def _check_module(name: str, module: nn.Module, style: str, size: int) -> None:
    if type(module) is not nn.Linear:
        raise ZeroConfigError(f"`tp_plan` puts {style!r} on `{name}`, of type {type(module).__name__}: lzero's plans split"
                              f" nn.Linear only. {_HINT}")
    dim, features = ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
    if features % size:
        raise ZeroConfigError(f"`tp_plan` puts {style!r} on `{name}`, whose {dim}={features} is not divisible by"
                              f" tensor_parallel_size={size}. HINT: a tensor_parallel_size that divides {features}, or"
                              " leave that module out of the plan.")


def apply_plan(root: nn.Module, resolved: dict[str, str], tp_mesh: Any) -> None:
    """Parallelize ``root``'s modules named in ``resolved`` over ``tp_mesh`` with torch's styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(root, tp_mesh, {name: styles[style]() for name, style in resolved.items()})
