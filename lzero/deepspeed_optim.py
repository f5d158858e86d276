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

``OneCycle`` and ``LRRangeTest`` are not built: refused by name.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable

import torch

from lzero.config import ZeroConfigError

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
}
NOT_BUILT = ("OneCycle", "LRRangeTest")


def check(kind: str, block: Any) -> dict[str, Any]:
    """``block`` (``{"type": ..., "params": {...}}``) checked: a known type, known parameters, no ``"auto"``."""
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
        if value == "auto":
            raise ZeroConfigError(f"`{kind}.params.{key}=\"auto\"`: lzero has no Trainer value to fill it from."
                                  f" HINT: write the value, or drop the `{kind}` block and build it in"
                                  " `configure_optimizers`.")
    if kind == "scheduler" and name != "WarmupLR" and "total_num_steps" not in params:
        raise ZeroConfigError(f"`scheduler.params.total_num_steps` is needed by {name}. HINT: set it to the run's"
                              " number of optimizer steps.")
    return {"type": name, "params": dict(params)}


def build_optimizer(spec: dict[str, Any], params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    p = dict(spec["params"])
    p.pop("torch_adam", None)
    if spec["type"] == "SGD":
        return torch.optim.SGD(params, **p)
    decoupled = p.pop("adam_w_mode", True) if spec["type"] == "Adam" else True
    if "betas" in p:
        p["betas"] = tuple(p["betas"])
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **p)


def build_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor makes each group's learning rate the value DeepSpeed's scheduler sets."""
    name, p = spec["type"], spec["params"]
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
