"""Dynamic loss scaling for fp16, with DeepSpeed's knobs and rules. Pure Python: no tensors here.

[Note: dynamic loss scaling]
fp16 gradients of small losses underflow, so the loss is multiplied by a scale S before backward
and the gradients are divided by S again (lzero folds the division into the reduction's 1/N).
Too large an S overflows: some gradient is inf/NaN. Then the step is skipped on every rank (the
engine all-reduces one flag) and the scaler reacts as DeepSpeed's ``DynamicLossScaler`` does:

- overflow, hysteresis left > 1 (and ``hysteresis`` > 1): only the hysteresis counter drops;
  S stays. Otherwise S halves (never below ``min_loss_scale``).
- no overflow: with ``consecutive_hysteresis`` the counter is refilled at once (only overflows in
  a row count); every ``loss_scale_window`` steps since the last overflow S doubles and (without
  ``consecutive_hysteresis``) the counter is refilled.

Steps are counted from 0 and the last overflow starts at -1, so a run without overflows doubles S
after steps ``window - 1``, ``2 * window - 1``, ... (DeepSpeed's arithmetic). A static scale
(``loss_scale > 0``) never changes but overflowing steps are still skipped. Overflowing again and
again at ``min_loss_scale`` (or at a static scale) means fp16 cannot represent this model's gradients: after
``max_overflows_at_min_scale`` such steps in a row training stops with :class:`LossScaleError`
instead of going on without learning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lzero.errors import ZeroError


class LossScaleError(ZeroError, RuntimeError):
    """fp16 training can no longer make progress; the message says what to change."""


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling, with DeepSpeed's names and defaults (its ``fp16`` config section)."""

    loss_scale: float = 0.0
    """0 for dynamic loss scaling; a positive number is a static scale."""

    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2 ** initial_scale_power``."""

    loss_scale_window: int = 1000
    """Steps without overflow after which the scale doubles."""

    hysteresis: int = 2
    """Overflows tolerated before the scale halves (the counter is refilled when the scale grows,
    or after every good step with ``consecutive_hysteresis``)."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis counter after every step without overflow."""

    min_loss_scale: float = 1.0
    """The scale never drops below this."""

    max_overflows_at_min_scale: int = 5
    """Consecutive overflowing steps at ``min_loss_scale`` after which training stops with an error."""

    report_every_n_skips: int = 100
    """Skipped steps are reported (one log line, with counts) at the first skip and then every N skips."""

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LossScaleConfig.{name}={value!r} must be a whole number >= 1.")

        for name in ("loss_scale_window", "hysteresis", "max_overflows_at_min_scale", "report_every_n_skips"):
            positive_int(name)
        if isinstance(self.initial_scale_power, bool) or not isinstance(self.initial_scale_power, int) or not (
                0 <= self.initial_scale_power <= 64):
            raise ValueError(f"LossScaleConfig.initial_scale_power={self.initial_scale_power!r} must be a whole"
                             " number in [0, 64] (the scale starts at 2**initial_scale_power).")
        if not isinstance(self.loss_scale, (int, float)) or self.loss_scale < 0:
            raise ValueError(f"LossScaleConfig.loss_scale={self.loss_scale!r} must be 0 (dynamic) or a positive"
                             " static scale.")
        if not isinstance(self.min_loss_scale, (int, float)) or self.min_loss_scale <= 0:
            raise ValueError(f"LossScaleConfig.min_loss_scale={self.min_loss_scale!r} must be > 0.")
        if self.loss_scale == 0 and 2.0 ** self.initial_scale_power < self.min_loss_scale:
            raise ValueError(f"The initial scale 2**{self.initial_scale_power} is below min_loss_scale="
                             f"{self.min_loss_scale}. HINT: raise initial_scale_power or lower min_loss_scale.")


class LossScaler:
    """The scale and its counters. See [Note: dynamic loss scaling]."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.dynamic = config.loss_scale == 0
        self.scale = 2.0 ** config.initial_scale_power if self.dynamic else float(config.loss_scale)
        self.iteration = 0  # optimizer steps seen, skipped ones included
        self.last_overflow_iteration = -1
        self.hysteresis_left = config.hysteresis
        self.overflows_at_min_scale = 0  # consecutive

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step; raises :class:`LossScaleError` when fp16 is stuck."""
        cfg = self.config
        if overflow:
            self._check_stuck()
        else:
            self.overflows_at_min_scale = 0
        if self.dynamic and overflow:
            if cfg.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, cfg.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        elif self.dynamic:
            if cfg.consecutive_hysteresis:
                self.hysteresis_left = cfg.hysteresis
            if (self.iteration - self.last_overflow_iteration) % cfg.loss_scale_window == 0:
                if not cfg.consecutive_hysteresis:
                    self.hysteresis_left = cfg.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def _check_stuck(self) -> None:
        if self.dynamic and self.scale > self.config.min_loss_scale:
            return  # a static scale that keeps overflowing is stuck at any value
        self.overflows_at_min_scale += 1
        if self.overflows_at_min_scale >= self.config.max_overflows_at_min_scale:
            raise LossScaleError(
                f"fp16 gradients overflowed in {self.overflows_at_min_scale} consecutive steps at the minimum loss"
                f" scale {self.scale:g} (min_loss_scale={self.config.min_loss_scale:g}): training cannot progress."
                " HINT: use precision='bf16-mixed', lower the learning rate, clip gradients, or lower"
                " `min_loss_scale`; `max_overflows_at_min_scale` sets how many such steps are tolerated."
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "hysteresis_left": self.hysteresis_left,
            "overflows_at_min_scale": self.overflows_at_min_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.state_dict()) - set(state)
        if missing:
            raise ValueError(f"Loss-scaler state lacks {sorted(missing)}. HINT: the checkpoint was not written by"
                             " lzero's fp16 precision; drop its precision state or resume with the same precision.")
        self.scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows_at_min_scale = int(state["overflows_at_min_scale"])
