"""The precision plugin a ZeRO strategy installs: compute dtype, masters, autocast and clipping.

Lightning routes clipping through the precision plugin; its generic plugin would clip the module's
``p.grad`` (None under stage 2, partial under stage 1). This plugin asks the engine for the
global norm over all shards instead.

[Note: precision modes]
- ``32-true``: fp32 everywhere; the master is the parameter shard itself.
- ``bf16-mixed`` (ZeRO semantics, the default): bf16 working parameters and gradients, fp32 master
  shards and optimizer state, reduction in ``reduce_dtype`` (fp32 by default); the forward runs
  under bf16 autocast so fp32 inputs and buffers mix with bf16 weights. Memory follows the
  mixed-precision formula.
- ``bf16-mixed`` with ``param_dtype=torch.float32`` (Lightning's own semantics): fp32 parameters,
  bf16 autocast in forward; the fp32 memory formula.
- ``bf16-true``: everything bf16, no masters.
``16-mixed`` needs dynamic loss scaling, which is not built yet, and is refused by name.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")
REFUSED = {
    "16-mixed": "fp16 needs dynamic loss scaling, which this lzero release does not have yet",
    "16-true": "pure fp16 training has no loss scaling or fp32 masters",
    "64-true": "ZeRO's flat buffers and masters are at most fp32",
    "transformer-engine": "Transformer Engine layers are not supported",
    "transformer-engine-float16": "Transformer Engine layers are not supported",
}


class ZeroPrecisionError(ValueError):
    """A precision setting lzero cannot run; the message says what to use."""


class ZeroPrecision(Precision):
    """See [Note: precision modes].

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"``.
        param_dtype: dtype of the working parameters under ``bf16-mixed`` (bf16 by default; fp32 for
            Lightning's autocast-only semantics).
        reduce_dtype: dtype of gradient reductions (default: fp32 under ``bf16-mixed``, the parameter
            dtype otherwise).
    """

    def __init__(self, precision: str = "32-true", param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        precision = str(precision)
        if precision in REFUSED:
            raise ZeroPrecisionError(
                f"precision={precision!r} is not supported by lzero: {REFUSED[precision]}."
                f" HINT: use one of {', '.join(SUPPORTED_PRECISION)}."
            )
        if precision not in SUPPORTED_PRECISION:
            raise ZeroPrecisionError(
                f"Unknown precision {precision!r}. HINT: use one of {', '.join(SUPPORTED_PRECISION)}."
            )
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
                raise ZeroPrecisionError(f"`{name}={dtype}` must be torch.float32 or torch.bfloat16.")
        if precision != "bf16-mixed" and param_dtype is not None:
            raise ZeroPrecisionError(
                f"`param_dtype` applies to precision='bf16-mixed' only, got precision={precision!r}."
                " HINT: drop `param_dtype`."
            )
        self.precision = precision
        self.param_dtype = param_dtype if param_dtype is not None else (
            torch.bfloat16 if precision == "bf16-mixed" else None)
        if self.param_dtype == torch.float32:
            self.param_dtype = None  # autocast mode: the parameters stay as they are
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else (
            torch.float32 if precision == "bf16-mixed" else None)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(torch.bfloat16)
        return module  # bf16-mixed: the engine casts the working parameters and keeps fp32 masters

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            with torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16):
                yield
        else:
            yield

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        zopt = _zero_optimizer(optimizer)
        zopt.engine.clip_grad_norm_(zopt.units, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        zopt = _zero_optimizer(optimizer)
        zopt.engine.clip_grad_value_(zopt.units, float(clip_val))


def _zero_optimizer(optimizer: Any) -> Any:
    from lzero.optimizer import ZeroOptimizer

    inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    if not isinstance(inner, ZeroOptimizer):
        raise ZeroPrecisionError(
            f"Gradient clipping under lzero needs the strategy's optimizer, got {type(inner).__name__}."
            " HINT: clip the optimizer returned by `self.optimizers()`."
        )
    return inner


def to_zero_precision(plugin: Any) -> ZeroPrecision:
    """The ZeRO plugin for what Lightning assigned, or an error naming what is not supported.
    An explicit ZeroPrecision (``plugins=[...]`` or ``ZeroStrategy(precision=...)``) is kept as is."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin if plugin is not None else ZeroPrecision()
    name = str(getattr(plugin, "precision", type(plugin).__name__))
    if type(plugin) is Precision:
        name = "32-true"
    if name in SUPPORTED_PRECISION or name in REFUSED:
        return ZeroPrecision(name)
    raise ZeroPrecisionError(
        f"precision plugin {type(plugin).__name__} ({name!r}) is not supported by lzero."
        f" HINT: use `Trainer(precision=...)` with one of {', '.join(SUPPORTED_PRECISION)}."
    )
