"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks as the torch optimizer and LR scheduler they stand for.

[Note: DeepSpeed's optimizer and scheduler blocks]
Used when ``configure_optimizers`` returns nothing (both defining one is an error). ``Adam`` is DeepSpeed's
AdamW unless ``adam_w_mode`` (or ``torch_adam`` with ``adam_w_mode``) says otherwise, as in DeepSpeed, where
``Adam`` decouples weight decay by default; ``AdamW`` and ``SGD`` are torch's. DeepSpeed's schedulers set the
learning rate itself, step by step (one optimizer step each):

- ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` (``warmup_type`` "log":
  by log(step + 1) / log(warmup_num_steps); "linear": by step / warmup_num_steps), then ``warmup_max_lr``.
- ``WarmupDecayLR``: the same warmup, then linearly down to 0 at ``total_num_steps``.
- ``WarmupCosineLR``: relative to the optimizer's learning rate: from ``warmup_min_ratio`` to 1 over the warmup,
  then a cosine down to ``cos_min_ratio`` at ``total_num_steps``.
- ``OneCycle``: see [Note: DeepSpeed's OneCycle].

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

import difflib
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lzero.config import ZeroConfigError

AUTO = "auto"
OPTIMIZERS = {
    "Adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad"),
    "AdamW": ("lr", "betas", "eps", "weight_decay", "torch_adam", "amsgrad"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}
SCHEDULERS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps",
                       "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"),
}
NOT_BUILT = ("LRRangeTest",)
HPARAMS = {
    "lr": (("lr",), ("learning_rate",)),
    "weight_decay": (("weight_decay",),),
    "betas": (("betas",), ("adam_beta1", "adam_beta2")),
    "eps": (("eps",), ("adam_epsilon",)),
    "momentum": (("momentum",),),
    "warmup_num_steps": (("warmup_steps",), ("warmup_num_steps",)),
}
"""``"auto"`` keys filled from the LightningModule's ``hparams``: the names looked for, the first one set (not None)
wins (a pair is one value: Hugging Face's ``adam_beta1`` and ``adam_beta2``)."""
AUTO_SOURCES = {
    "optimizer": {key: "the LightningModule's hparams " + " or ".join(" and ".join(f"`{n}`" for n in names)
                                                                      for names in HPARAMS[key])
                  for key in ("lr", "weight_decay", "betas", "eps", "momentum")},
    "scheduler": {"total_num_steps": "the Trainer's `estimated_stepping_batches`",
                  "warmup_min_lr": "0 (Hugging Face's value)",
                  "warmup_max_lr": "the optimizer's learning rate",
                  "cycle_max_lr": "the optimizer's learning rate",
                  "warmup_num_steps": "the LightningModule's hparams `warmup_steps` or `warmup_num_steps`"},
}
"""Per block, the keys whose ``"auto"`` lzero fills when training starts, and where the value comes from."""


def check(kind: str, block: Any) -> dict[str, Any]:
    """``block`` (``{"type": ..., "params": {...}}``) checked: a known type, known parameters, ``"auto"`` only where
    :data:`AUTO_SOURCES` fills it."""
    table = OPTIMIZERS if kind == "optimizer" else SCHEDULERS
    if not isinstance(block, dict) or set(block) - {"type", "params"} or "type" not in block:
        raise ZeroConfigError(f"`{kind}` must be {{\"type\": ..., \"params\": {{...}}}}, got {block!r}.")
    name, params = block["type"], block.get("params", {})
    if name in NOT_BUILT:
        raise ZeroConfigError(f"`{kind}.type={name!r}` is not built in lzero. HINT: use one of {', '.join(table)}, or"
                              " return the scheduler from `configure_optimizers`.")
    if name not in table:
        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(table)}."
        raise ZeroConfigError(f"`{kind}.type={name!r}` is not a type lzero builds. HINT: {hint}")
    for key, value in params.items():
        if key not in table[name]:
            close = difflib.get_close_matches(str(key), table[name], n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"the keys are: {', '.join(table[name])}."
            raise ZeroConfigError(f"Unknown key `{kind}.params.{key}` for {name}. HINT: {hint}")
        if value == AUTO and key not in AUTO_SOURCES[kind]:
            raise ZeroConfigError(f"`{kind}.params.{key}=\"auto\"`: lzero fills \"auto\" in `{kind}` only for"
                                  f" {', '.join(AUTO_SOURCES[kind])}. HINT: write the value of `{key}`.")
    if name in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in params:
        raise ZeroConfigError(f"`scheduler.params.total_num_steps` is needed by {name}. HINT: set it to the run's"
                              " number of optimizer steps, or to \"auto\" (the Trainer's estimate).")
    if name == "OneCycle":  # checked now with a stand-in for an "auto" cycle_max_lr, which is filled at setup
        OneCycle.from_params({k: 0.0 if v == AUTO else v for k, v in params.items()})
    return {"type": name, "params": dict(params)}


def fill_auto(spec: dict[str, Any], hparams: Mapping[str, Any], trainer_steps: Callable[[], float],
              lrs: Sequence[float]) -> dict[str, Any]:
    """``spec`` (from :func:`check`) with each ``"auto"`` filled as :data:`AUTO_SOURCES` says, each logged once.
    ``trainer_steps`` gives the Trainer's ``estimated_stepping_batches`` (asked only when needed); ``lrs`` are the
    optimizer's group learning rates (for a scheduler block)."""
    kind = "optimizer" if spec["type"] in OPTIMIZERS else "scheduler"
    params = dict(spec["params"])
    for key in [k for k, v in params.items() if v == AUTO]:
        params[key], source = _auto_value(kind, key, hparams, trainer_steps, lrs)
        rank_zero_info(f"DeepSpeed configuration: `{kind}.params.{key}` \"auto\" -> {params[key]!r} ({source})")
    return {"type": spec["type"], "params": params}


def _auto_value(kind: str, key: str, hparams: Mapping[str, Any], trainer_steps: Callable[[], float],
                lrs: Sequence[float]) -> tuple[Any, str]:
    """The value for an ``"auto"`` ``key`` and where it came from."""
    if key in HPARAMS:
        for names in HPARAMS[key]:
            if all(hparams.get(n) is not None for n in names):
                value = [hparams[n] for n in names] if len(names) > 1 else hparams[names[0]]
                return (int(value) if key == "warmup_num_steps" else value), "hparams " + " and ".join(names)
        looked = ", ".join(" and ".join(f"`{n}`" for n in names) for names in HPARAMS[key])
        raise ZeroConfigError(
            f"`{kind}.params.{key}` is \"auto\" but the LightningModule's hparams set none of {looked} (hparams:"
            f" {sorted(hparams)}). HINT: write the value of `{key}` in the configuration, or save it with"
            f" `self.save_hyperparameters()` under the name `{HPARAMS[key][0][0]}`.")
    if key == "warmup_min_lr":
        return 0.0, "Hugging Face's value"
    if key == "total_num_steps":
        steps = trainer_steps()
        if not math.isfinite(steps):
            raise ZeroConfigError(
                f"`scheduler.params.total_num_steps` is \"auto\" but the Trainer's `estimated_stepping_batches` is"
                f" {steps}. HINT: give the Trainer `max_steps` or `max_epochs`, or write `total_num_steps`.")
        return int(steps), "the Trainer's estimated_stepping_batches"
    if len(set(lrs)) != 1:
        raise ZeroConfigError(
            f"`scheduler.params.{key}` is \"auto\" but the optimizer's param groups have the learning rates"
            f" {list(lrs)}, not one. HINT: write the value of `{key}` in the configuration.")
    return lrs[0], "the optimizer's lr"


def build_optimizer(spec: dict[str, Any], params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    p = dict(spec["params"])
    p.pop("torch_adam", None)
    if spec["type"] == "SGD":
        return torch.optim.SGD(params, **p)
    decoupled = p.pop("adam_w_mode", True) if spec["type"] == "Adam" else True
    if "betas" in p:
        p["betas"] = tuple(p["betas"])
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **p)


def build_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A scheduler that makes each group's learning rate the value DeepSpeed's scheduler sets: OneCycle's own class,
    the others a LambdaLR."""
    name, p = spec["type"], spec["params"]
    if name == "OneCycle":
        return OneCycleScheduler(optimizer, OneCycle.from_params(p))
    warmup = max(1, int(p.get("warmup_num_steps", 1000)))
    log = p.get("warmup_type", "log") == "log"

    def gamma(step: int) -> float:  # the warmup's progress in [0, 1]
        if step >= warmup:
            return 1.0
        return math.log(step + 1) / math.log(warmup) if log and warmup > 1 else step / warmup

    bases = [group["lr"] for group in optimizer.param_groups]
    if name == "WarmupCosineLR":
        low, floor = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 0.0001)
        total = int(p["total_num_steps"])

        def ratio(step: int) -> float:
            if step < warmup:
                return low + (1 - low) * gamma(step)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, [ratio] * len(bases))
    low, high = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", 0.001)

    def absolute(step: int) -> float:
        lr = low + (high - low) * gamma(step)
        if name == "WarmupDecayLR" and step >= warmup:
            total = int(p["total_num_steps"])
            lr = high * max(0.0, (total - step) / max(1.0, total - warmup))
        return lr

    for group in optimizer.param_groups:  # DeepSpeed sets the rate itself: factors over a base of 1
        group["lr"] = group["initial_lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, absolute)


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


class OneCycleScheduler(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's OneCycle as a torch scheduler stepped once per optimizer step: before optimizer step k
    (``last_epoch``, 0 the first) each group holds the lr and betas DeepSpeed's holds after k steps."""

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
        super().__init__(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """torch's, without the parameters (they come from the configuration)."""
        return {k: v for k, v in super().state_dict().items() if k != "cycle"}

    def _last(self) -> Optional[int]:
        """DeepSpeed's ``last_batch_iteration`` now; None before the first step of a resumed schedule (untouched)."""
        start = self.cycle.last_batch_iteration
        if self.last_epoch == 0:
            return -1 if start == -1 else None
        return start + self.last_epoch

    def get_lr(self) -> list[float]:
        last = self._last()
        if last is None:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [self.cycle.cycle_min_lr if last == -1 else self.cycle.lr(last)] * len(self.optimizer.param_groups)

    def step(self, epoch: Optional[int] = None) -> None:
        super().step(epoch)
        last = self._last()
        if self.cycles_momentum and last is not None:
            momentum = self.cycle.cycle_min_mom if last == -1 else self.cycle.momentum(last)
            for group in self.optimizer.param_groups:
                group["betas"] = (momentum, DEEPSPEED_BETA2)
