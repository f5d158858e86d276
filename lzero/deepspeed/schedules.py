"""DeepSpeed's learning-rate schedulers (its ``scheduler`` block) as torch schedulers that set, before every
optimizer step, the rate DeepSpeed's own class sets.

[Note: DeepSpeed's scheduler timing]
DeepSpeed's schedulers (``deepspeed/runtime/lr_schedules.py``) count ``last_batch_iteration`` L: -1 at construction,
where they already write the rates for L = -1 into the optimizer, then one more after each optimizer step (the
engine steps them after the optimizer, and not after a step skipped on fp16 overflow). So optimizer step k (0 the
first) runs with the rates for L = k - 1: the first step with the rates for -1, which for the warmups is the
bottom of the warmup (``warmup_min_lr``; 0 for ``WarmupCosineLR``), and the second with those for 0, which is the
same bottom again (the warmup's progress is log(L + 1) / log(w) or L / w). A schedule resumed from a given L
leaves the optimizer's own rates for its first step. :class:`DeepSpeedScheduler` keeps that timing on top of
torch's ``LRScheduler`` (its ``last_epoch`` is k); Lightning steps it once per optimizer step, and lzero's fp16
guard skips it with a skipped step, as DeepSpeed does.

The warmups, with w = max(2, ``warmup_num_steps``) as DeepSpeed clamps it and g(L) the warmup's progress (log:
log(L + 1) / log(w); linear: L / w; 1 from L = w on):
- ``WarmupLR``: lr = min + (max - min) g(L); ``warmup_max_lr`` defaults to each group's own lr;
- ``WarmupDecayLR``: the same warmup (``warmup_max_lr`` default 0.001), then g(L) = max(0, (T - L) / max(1, T - w))
  for T = ``total_num_steps``, so the rate falls linearly to ``warmup_min_lr`` at T;
- ``WarmupCosineLR``: relative to each group's lr at construction: the ratio rises from ``warmup_min_ratio`` to 1
  as min + (1 - min) g(L), then with p = min(1, (L - w + 1) / max(1, T - w)) it is
  max(0, c + (1 - c)(1 + cos(pi p)) / 2) for c = ``cos_min_ratio``.
DeepSpeed's per-param-group lists for the bounds are not built: each bound is one number for every group; an
unknown ``warmup_type`` (DeepSpeed falls back to log with a warning) is refused.

[Note: DeepSpeed's OneCycle].

``LRRangeTest`` is not built: refused by name.

``"auto"`` (the Hugging Face integration's placeholder) is accepted for the keys of ``AUTO_SOURCES`` and filled when
training starts (:func:`fill_auto`, called by ``ZeroStrategy.setup_optimizers``) from the LightningModule's
``hparams`` (as Hugging Face fills it from its ``TrainingArguments``), the Trainer, or the optimizer; each filled
value is logged once. An ``"auto"`` with nothing to fill it from is refused then, naming the key.

[Note: DeepSpeed's OneCycle]
DeepSpeed (``deepspeed/runtime/lr_schedules.py``) counts ``last_batch_iteration`` L, -1 before the first step, one
more after each optimizer step. With ``first``/``second`` the two half cycles (``second`` None: ``first``) and
``total = first + second``, the position of batch b = L + 1 in its cycle is x = 1 + b / total - floor(1 + b / total);
the scale is x / r rising (x <= r, r = first / total) and (x - 1) / (r - 1) falling. A stair count n > 0 for that
half replaces the scale by floor(n * i / first) / n rising, floor(n * (total - i) / second) / n falling, with
i = b mod total. While L < total, lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale and momentum =
cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale: the momentum moves against the rate. After the cycle,
with d = (L - total + 1) / decay_step_size (not floored: the decay is smooth), lr = cycle_min_lr / (1 +
decay_lr_rate * d) and momentum = cycle_max_mom * (1 + decay_mom_rate * d); a zero ``decay_step_size`` or rate
holds cycle_min_lr / cycle_max_mom. DeepSpeed's quirks, kept so that a run equals DeepSpeed's:
- at construction (L = -1) it sets lr = cycle_min_lr and betas = (cycle_min_mom, 0.99), so the first step runs
  with cycle_min_mom although the formula would give cycle_max_mom; with L given (resuming) it leaves the
  optimizer's lr and betas for that first step;
- momentum is cycled only for an optimizer with ``betas`` (Adam, AdamW), as ``betas = (momentum, 0.99)``: the
  second beta becomes 0.99 whatever the optimizer had (lzero warns when it changes); SGD's momentum is left alone
  (DeepSpeed and lzero warn);
- the stair counts take effect as in DeepSpeed since July 2026 (before, DeepSpeed ignored them).
DeepSpeed's per-param-group lists for the bounds are not built: each bound is one number for every group.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch
from lightning.fabric.utilities import rank_zero_warn

from lzero.config import ZeroConfigError

WARMUP_TYPES = ("log", "linear")


class DeepSpeedScheduler(torch.optim.lr_scheduler.LRScheduler):
    """A DeepSpeed schedule as a torch scheduler stepped once per optimizer step: see [Note: DeepSpeed's scheduler
    timing]. Subclasses give :meth:`rates` for DeepSpeed's ``last_batch_iteration`` >= -1."""

    def __init__(self, optimizer: torch.optim.Optimizer, start: int) -> None:
        self.start = start  # DeepSpeed's last_batch_iteration at construction
        super().__init__(optimizer)

    def rates(self, last: int) -> list[float]:
        raise NotImplementedError

    def last(self) -> Optional[int]:
        """DeepSpeed's ``last_batch_iteration`` now; None before the first step of a resumed schedule (untouched)."""
        if self.last_epoch == 0:
            return -1 if self.start == -1 else None
        return self.start + self.last_epoch

    def get_lr(self) -> list[float]:
        last = self.last()
        if last is None:
            return [group["lr"] for group in self.optimizer.param_groups]
        return self.rates(last)


@dataclass(frozen=True)
class Warmup:
    """DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR`` parameters, with its names and defaults
    (see [Note: DeepSpeed's scheduler timing])."""

    kind: str
    """"WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"."""

    warmup_num_steps: int = 1000
    """Steps of the warmup; a whole number >= 1 (DeepSpeed runs at least 2)."""

    warmup_type: str = "log"
    """The warmup's progress: "log" (log(L + 1) / log(w)) or "linear" (L / w)."""

    warmup_min_lr: float = 0.0
    """WarmupLR, WarmupDecayLR: the rate at the start of the warmup (and at the end of the decay)."""

    warmup_max_lr: Optional[float] = None
    """WarmupLR, WarmupDecayLR: the rate at the end of the warmup; None: each group's lr (WarmupLR) or 0.001
    (WarmupDecayLR), DeepSpeed's defaults."""

    total_num_steps: Optional[int] = None
    """WarmupDecayLR, WarmupCosineLR: the step at which the decay ends (required)."""

    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: the ratio to each group's lr at the start of the warmup."""

    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: the ratio at the end of the cosine."""

    last_batch_iteration: int = -1
    """DeepSpeed's step counter before the first step: -1 starts the schedule; L resumes it after step L."""

    def __post_init__(self) -> None:
        p = "scheduler.params"
        w = self.warmup_num_steps
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ZeroConfigError(f"`{p}.warmup_num_steps={w!r}` must be a whole number >= 1 (DeepSpeed refuses it"
                                  " too). HINT: e.g. 1000.")
        if self.warmup_type not in WARMUP_TYPES:
            raise ZeroConfigError(f"`{p}.warmup_type={self.warmup_type!r}` is not one of {', '.join(WARMUP_TYPES)}"
                                  " (DeepSpeed would fall back to log with a warning). HINT: write \"log\" or"
                                  " \"linear\".")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("kind", "warmup_type", "warmup_num_steps") or (value is None and f.default is None):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                hint = ("one number for every param group (DeepSpeed's per-group lists are not built in lzero)"
                        if isinstance(value, (list, tuple)) else "a number")
                raise ZeroConfigError(f"`{p}.{f.name}={value!r}` must be a number for {self.kind}. HINT: write {hint}.")
        if self.kind != "WarmupLR" and self.total_num_steps is None:
            raise ZeroConfigError(f"`{p}.total_num_steps` is needed by {self.kind}. HINT: set it to the run's number"
                                  " of optimizer steps, or to \"auto\" (the Trainer's estimate).")
        if self.last_batch_iteration < -1 or not float(self.last_batch_iteration).is_integer():
            raise ZeroConfigError(f"`{p}.last_batch_iteration={self.last_batch_iteration!r}` must be a whole number"
                                  " >= -1. HINT: -1 starts the schedule.")

    @classmethod
    def from_spec(cls, kind: str, params: Mapping[str, Any]) -> "Warmup":
        return cls(kind, **params)

    @property
    def steps(self) -> int:
        return max(2, int(self.warmup_num_steps))

    def progress(self, last: int) -> float:
        """The warmup's progress g(L), 1 once it is over (the decay of WarmupDecayLR aside)."""
        w = self.steps
        if last >= w:
            return 1.0
        # DeepSpeed's own order of operations (a reciprocal of log(w), then a product), so that rates agree bitwise
        return (1.0 / math.log(w)) * math.log(last + 1) if self.warmup_type == "log" else last / w

    def lr(self, last: int, group_lr: float) -> float:
        """WarmupLR / WarmupDecayLR: the rate DeepSpeed sets for ``last`` (>= -1)."""
        low = self.warmup_min_lr
        high = self.warmup_max_lr if self.warmup_max_lr is not None else (
            group_lr if self.kind == "WarmupLR" else 0.001)
        if last < 0:
            return low
        g = self.progress(last)
        if self.kind == "WarmupDecayLR" and last >= self.steps:
            total = self.total_num_steps
            g = max(0.0, (total - last) / max(1.0, total - self.steps))
        return low + (high - low) * g

    def ratio(self, last: int) -> float:
        """WarmupCosineLR: the ratio to the group's lr DeepSpeed sets for ``last`` (>= -1)."""
        if last < 0:
            return 0.0
        w, low = self.steps, self.warmup_min_ratio
        if last < w:
            return low + (1.0 - low) * self.progress(last)
        p = min(1.0, (last - w + 1) / max(1, self.total_num_steps - w))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * p)) / 2)


class WarmupScheduler(DeepSpeedScheduler):
    """WarmupLR, WarmupDecayLR and WarmupCosineLR with DeepSpeed's rates and timing."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: Warmup) -> None:
        self.warmup = warmup
        self.group_lrs = [group["lr"] for group in optimizer.param_groups]  # each group's lr at construction
        super().__init__(optimizer, int(warmup.last_batch_iteration))

    def rates(self, last: int) -> list[float]:
        if self.warmup.kind == "WarmupCosineLR":
            return [lr * self.warmup.ratio(last) for lr in self.group_lrs]
        return [self.warmup.lr(last, lr) for lr in self.group_lrs]

    def state_dict(self) -> dict[str, Any]:
        """torch's, without the parameters (they come from the configuration)."""
        return {k: v for k, v in super().state_dict().items() if k != "warmup"}


def build_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer) -> DeepSpeedScheduler:
    """The scheduler of a checked ``scheduler`` block (``"auto"`` values filled)."""
    if spec["type"] == "OneCycle":
        return OneCycleScheduler(optimizer, OneCycle.from_params(spec["params"]))
    return WarmupScheduler(optimizer, Warmup.from_spec(spec["type"], spec["params"]))


@dataclass(frozen=True)
class OneCycle:
    """DeepSpeed's ``OneCycle`` parameters, with its names and defaults (see [Note: DeepSpeed's OneCycle])."""

    cycle_min_lr: float
    """The learning rate at both ends of the cycle, and the base of the decay after it (DeepSpeed: no default)."""

    cycle_max_lr: float
    """The learning rate at the top of the cycle (DeepSpeed: no default)."""

    decay_lr_rate: float = 0.0
    """After the cycle: lr = cycle_min_lr / (1 + decay_lr_rate * steps since the cycle / decay_step_size)."""

    cycle_first_step_size: float = 2000
    """Optimizer steps of the rising half of the cycle; positive."""

    cycle_second_step_size: Optional[float] = None
    """Optimizer steps of the falling half; None: ``cycle_first_step_size``."""

    cycle_first_stair_count: int = 0
    """Stairs of the rising half (the rate held flat on each); 0: a straight line."""

    cycle_second_stair_count: Optional[int] = None
    """Stairs of the falling half; None: ``cycle_first_stair_count``."""

    decay_step_size: float = 0
    """The unit of the decay after the cycle, in optimizer steps; 0: no decay (lr and momentum held)."""

    cycle_momentum: bool = True
    """Cycle ``betas[0]`` against the rate (optimizers with ``betas`` only, as in DeepSpeed)."""

    cycle_min_mom: float = 0.8
    """The momentum at the top of the cycle (and at the very first step)."""

    cycle_max_mom: float = 0.9
    """The momentum at both ends of the cycle, and the base of its decay."""

    decay_mom_rate: float = 0.0
    """After the cycle: momentum = cycle_max_mom * (1 + decay_mom_rate * steps since the cycle / decay_step_size)."""

    last_batch_iteration: int = -1
    """DeepSpeed's step counter before the first step: -1 starts the schedule; L resumes it after step L."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value, integer = getattr(self, f.name), f.name in _INTEGERS
            if value is None and f.default is None:
                continue
            if f.name == "cycle_momentum":
                ok, want = isinstance(value, bool), "true or false"
            else:
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
                    not integer or float(value).is_integer())
                want = "an integer" if integer else "a number"
            if not ok:
                hint = ("one number for every param group (DeepSpeed's per-group lists are not built in lzero)"
                        if isinstance(value, (list, tuple)) else want)
                raise ZeroConfigError(f"`scheduler.params.{f.name}={value!r}` must be {want} for OneCycle. HINT:"
                                      f" write {hint}.")
        for name, (low, strict) in _LOWEST.items():
            value = getattr(self, name)
            if value is not None and (value <= low if strict else value < low):
                bound = f"{'>' if strict else '>='} {low}"
                raise ZeroConfigError(f"`scheduler.params.{name}={value!r}` must be {bound} for OneCycle. HINT: write"
                                      f" a value {bound}.")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "OneCycle":
        """From the block's ``params``; the two required bounds refused by name when missing."""
        for name in ("cycle_min_lr", "cycle_max_lr"):
            if name not in params:
                raise ZeroConfigError(f"`scheduler.params.{name}` is needed by OneCycle (DeepSpeed has no default)."
                                      f" HINT: write `{name}`, e.g. 1e-4 for the minimum and 1e-3 for the maximum.")
        return cls(**params)

    @property
    def halves(self) -> tuple[float, float]:
        """The rising and falling half cycles, in steps (floats, as DeepSpeed keeps them)."""
        first = float(self.cycle_first_step_size)
        return first, first if self.cycle_second_step_size is None else float(self.cycle_second_step_size)

    def scale(self, batch: int) -> float:
        """Batch ``batch``'s height in the cycle: 0 at its ends, 1 at the top, on stairs where a count says so."""
        first, second = self.halves
        total = first + second
        ratio = first / total
        x = 1.0 + batch / total - math.floor(1 + batch / total)  # the position in the cycle, in [0, 1)
        rising = x <= ratio
        stairs = self.cycle_first_stair_count if rising else self.cycle_second_stair_count
        if stairs is None:
            stairs = self.cycle_first_stair_count
        if stairs == 0:
            return x / ratio if rising else (x - 1) / (ratio - 1)
        i = batch % total  # stairs from the whole step count: a float x can fall an ulp short of a stair
        position = i * stairs / first if i <= first else (total - i) * stairs / second
        return math.floor(position) / stairs

    def lr(self, last: int) -> float:
        """The learning rate DeepSpeed sets when its ``last_batch_iteration`` is ``last`` (>= 0)."""
        total = sum(self.halves)
        if last < total:
            return self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self.scale(last + 1)
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return self.cycle_min_lr
        return self.cycle_min_lr / (1 + self.decay_lr_rate * ((last - total + 1) / self.decay_step_size))

    def momentum(self, last: int) -> float:
        """``betas[0]`` as DeepSpeed sets it when its ``last_batch_iteration`` is ``last`` (>= 0)."""
        total = sum(self.halves)
        if last < total:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * self.scale(last + 1)
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return self.cycle_max_mom
        return self.cycle_max_mom * (1 + self.decay_mom_rate * ((last - total + 1) / self.decay_step_size))


_INTEGERS = ("cycle_first_stair_count", "cycle_second_stair_count", "last_batch_iteration")
_LOWEST = {"cycle_first_step_size": (0, True), "cycle_second_step_size": (0, False), "decay_step_size": (0, False),
           "cycle_first_stair_count": (0, False), "cycle_second_stair_count": (0, False),
           "last_batch_iteration": (-1, False)}
"""OneCycle's bounds: (lowest value, whether it is excluded), as DeepSpeed checks or its formulas need."""
DEEPSPEED_BETA2 = 0.99
"""The second beta DeepSpeed's OneCycle writes beside the cycled momentum."""


class OneCycleScheduler(DeepSpeedScheduler):
    """DeepSpeed's OneCycle: the rate, and ``betas[0]`` for optimizers with betas, as DeepSpeed sets them."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle: OneCycle) -> None:
        self.cycle = cycle
        self.cycles_momentum = cycle.cycle_momentum and "betas" in optimizer.defaults
        if cycle.cycle_momentum and not self.cycles_momentum:
            rank_zero_warn(f"OneCycle: `cycle_momentum` is true but {type(optimizer).__name__} has no `betas`;"
                           " DeepSpeed then leaves the momentum alone, and so does lzero. HINT: set"
                           " `cycle_momentum: false` to silence this.")
        betas2 = {g["betas"][1] for g in optimizer.param_groups} if self.cycles_momentum else set()
        if betas2 - {DEEPSPEED_BETA2}:
            rank_zero_warn(f"OneCycle with `cycle_momentum` sets betas to (momentum, {DEEPSPEED_BETA2}), as DeepSpeed"
                           f" does: the optimizer's second beta {sorted(betas2)} is replaced. HINT: set"
                           " `cycle_momentum: false` to keep it.")
        super().__init__(optimizer, int(cycle.last_batch_iteration))

    def state_dict(self) -> dict[str, Any]:
        """torch's, without the parameters (they come from the configuration)."""
        return {k: v for k, v in super().state_dict().items() if k != "cycle"}

    def rates(self, last: int) -> list[float]:
        return [self.cycle.cycle_min_lr if last == -1 else self.cycle.lr(last)] * len(self.optimizer.param_groups)

    def step(self, epoch: Optional[int] = None) -> None:
        super().step(epoch)
        last = self.last()
        if self.cycles_momentum and last is not None:
            momentum = self.cycle.cycle_min_mom if last == -1 else self.cycle.momentum(last)
            for group in self.optimizer.param_groups:
                group["betas"] = (momentum, DEEPSPEED_BETA2)
