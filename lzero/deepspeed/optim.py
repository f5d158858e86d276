"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks as the torch optimizer and LR scheduler they stand for.

[Note: DeepSpeed's optimizer and scheduler blocks]
Used when ``configure_optimizers`` returns nothing (both defining one is an error). ``Adam`` is DeepSpeed's
AdamW unless ``adam_w_mode`` (or ``torch_adam`` with ``adam_w_mode``) says otherwise, as in DeepSpeed, where
``Adam`` decouples weight decay by default; ``AdamW`` and ``SGD`` are torch's. The schedulers (``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``) set the rate DeepSpeed's would at every step, with its timing:
lzero/deepspeed/schedules.py. ``LRRangeTest`` is not built: refused by name.

``"auto"`` (the Hugging Face integration's placeholder) is accepted for the keys of ``AUTO_SOURCES`` and filled when
training starts (:func:`fill_auto`, called by ``ZeroStrategy.setup_optimizers``) from the LightningModule's
``hparams`` (as Hugging Face fills it from its ``TrainingArguments``), the Trainer, or the optimizer; each filled
value is logged once. An ``"auto"`` with nothing to fill it from is refused then, naming the key.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from lightning.fabric.utilities import rank_zero_info

from lzero.config import ZeroConfigError
from lzero.deepspeed.schedules import OneCycle, Warmup

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
    if kind == "optimizer" and str(name).lower() == "muon":  # DeepSpeed's MuonWithAuxAdam: one optimizer, two halves
        raise ZeroConfigError(
            f"`optimizer.type={name!r}` is DeepSpeed's MuonWithAuxAdam (Muon on the parameters tagged `use_muon`, Adam on"
            " the rest, in one optimizer), which lzero does not build from a config. HINT: drop the `optimizer` block"
            " and return `torch.optim.Muon(matrices)` and `torch.optim.AdamW(rest)` from `configure_optimizers` (manual"
            " optimization under the Trainer, or two optimizers under Fabric): lzero steps Muon whole tensor by whole"
            " tensor, each matrix on the rank owning it (docs/training.md, Matrix optimizers).")
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
    # the schedule's values checked now, with stand-ins for "auto" values (filled at setup)
    if name == "OneCycle":
        OneCycle.from_params({k: 0.0 if v == AUTO else v for k, v in params.items()})
    elif kind == "scheduler":
        Warmup.from_spec(name, {k: (1 if k in ("warmup_num_steps", "total_num_steps") else 0.0) if v == AUTO else v
                                for k, v in params.items()})
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
