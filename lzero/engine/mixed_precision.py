"""The precision policy the engine and its units follow: which dtype parameters compute in, which
dtype gradients are reduced in, and which modules keep their parameters in fp32.

``ZeroPrecision`` (lightning/precision.py, the Lightning plugin) builds one from the user's precision choice;
the engine reads it to form units, and each unit gets its compute and reduction dtypes from it.
See [Note: precision modes] in lightning/precision.py for what each mode means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lzero.engine import packed_weights
from lzero.errors import ZeroEngineError


@dataclass(frozen=True)
class PrecisionPolicy:
    """What the engine computes and reduces in (the defaults: everything in the parameters' own dtype)."""

    param_dtype: Optional[torch.dtype] = None
    """dtype of the working parameters that forward and backward use; the fp32 parameters become fp32
    master shards. None: the parameters' own dtype, and the master is the parameter shard itself."""

    reduce_dtype: Optional[torch.dtype] = None
    """dtype in which gradients are reduce-scattered. None: the parameters' dtype."""

    keep_fp32_modules: tuple[str, ...] = ()
    """With a 16-bit ``param_dtype``: class names of modules whose own parameters keep their dtype, in
    units of their own (a unit never mixes compute dtypes)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_fp32_modules", tuple(self.keep_fp32_modules))

    @property
    def casts(self) -> bool:
        """Working parameters in another dtype than the masters (mixed precision)."""
        return self.param_dtype is not None

    def unit_dtypes(self, keep_fp32: bool) -> dict[str, Optional[torch.dtype]]:
        """``param_dtype``/``reduce_dtype`` of a unit; a unit of kept-fp32 modules reduces in fp32."""
        if keep_fp32:
            return {"param_dtype": None, "reduce_dtype": torch.float32}
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype}

    def kept_parameters(self, module: nn.Module) -> set[str]:
        """Names of the parameters owned directly by modules of a ``keep_fp32_modules`` class."""
        wanted = set(self.keep_fp32_modules) if self.casts else set()
        if not wanted:
            return set()
        found = {type(m).__name__ for m in module.modules()}
        missing = wanted - found
        if missing:
            raise ZeroEngineError(
                f"keep_fp32_modules names {sorted(missing)}, which no module of the model is. HINT: use class names"
                f" from the model, e.g. {sorted(found)[:8]}."
            )
        return {f"{prefix}.{n}" if prefix else n for prefix, m in module.named_modules() if type(m).__name__ in wanted
                for n, _ in m.named_parameters(recurse=False)}

    def check_module(self, module: nn.Module) -> None:
        """BatchNorm needs its weights in the dtype of its fp32 running statistics."""
        if not self.casts:
            return
        for name, m in module.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and type(m).__name__ not in self.keep_fp32_modules:
                raise ZeroEngineError(
                    f"`{name}` ({type(m).__name__}) cannot run with bf16 working parameters and fp32 running"
                    f" statistics. HINT: keep it in fp32 with `ZeroPrecision('bf16-mixed', keep_fp32_modules=['{type(m).__name__}'])`,"
                    " or use `ZeroPrecision('bf16-mixed', param_dtype=torch.float32)` (fp32"
                    " parameters under bf16 autocast), or replace BatchNorm with LayerNorm/GroupNorm."
                )

    @torch.no_grad()
    def cast_outside_units(self, module: nn.Module, managed: set[nn.Parameter], kept: set[str]
                           ) -> list[tuple[nn.Parameter, torch.dtype]]:
        """Parameters outside every unit (frozen ones) compute in ``param_dtype`` too; returns each cast
        parameter with its dtype before, to cast back at the end of fit."""
        cast = []
        if not self.casts:
            return cast
        for name, p in module.named_parameters():
            if p not in managed and name not in kept and p.is_floating_point() and p.dtype != self.param_dtype \
                    and not packed_weights.is_packed(p):  # codes in a float view: never cast (packed_weights.py)
                cast.append((p, p.dtype))
                p.data = p.data.to(self.param_dtype)
        return cast
