"""The precision plugin a ZeRO strategy installs: it owns gradient clipping over the shards.

Lightning routes clipping through the precision plugin; its generic plugin would clip the module's
``p.grad`` (None under stage 2, partial under stage 1). This plugin asks the engine for the
global norm over all shards instead. Mixed precision lands here in a later release.
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

SUPPORTED_PRECISION = ("32-true",)


class ZeroPrecisionError(ValueError):
    """A precision setting this lzero release cannot run; the message says what to use."""


class ZeroPrecision(Precision):
    """Full fp32 training under ZeRO; clipping by global norm or by value over the shards."""

    def __init__(self, precision: str = "32-true") -> None:
        if str(precision) not in SUPPORTED_PRECISION:
            raise ZeroPrecisionError(
                f"precision={precision!r} is not supported by this lzero release (supported:"
                f" {', '.join(SUPPORTED_PRECISION)}). HINT: use `Trainer(precision='32-true')`."
            )
        self.precision = str(precision)

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
    """The ZeRO plugin for what Lightning assigned, or an error naming what is not supported."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin if plugin is not None else ZeroPrecision()
    if type(plugin) is Precision:
        return ZeroPrecision("32-true")
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ZeroPrecisionError(
        f"precision={name!r} ({type(plugin).__name__}) is not supported by this lzero release (supported:"
        f" {', '.join(SUPPORTED_PRECISION)}). HINT: use `Trainer(precision='32-true')`."
    )
