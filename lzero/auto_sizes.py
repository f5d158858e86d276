"""``"auto"`` sizes: ZeroConfig fields filled at setup from the model's hidden size.

[Note: sizes from the hidden size]
Configurations written for the Hugging Face integration of DeepSpeed say ``"auto"`` for three sizes that the
integration derives from the model's hidden size h; lzero's ZeroConfig takes the same ``"auto"`` and fills it the
same way when the strategy sets up (or the engine is built), before anything is partitioned:
``reduce_bucket_size`` = h*h, ``prefetch_bucket_size`` = int(0.9*h*h) (DeepSpeed's
``stage3_prefetch_bucket_size``), ``param_persistence_threshold`` = 10*h (``stage3_param_persistence_threshold``).
h is the first of :data:`HIDDEN_SIZE_NAMES` (or the largest of ``hidden_sizes``) on a ``config`` attribute of the
model or any submodule (a Hugging Face model's ``PretrainedConfig``, a nanoGPT-style ``GPTConfig``), else the
LightningModule's hyperparameter of one of those names. A model that says none is refused, naming the fields.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

from lzero.config import AUTO, BY_HIDDEN_SIZE, ZeroConfig, ZeroConfigError

HIDDEN_SIZE_NAMES = ("hidden_size", "n_embd", "d_model", "hidden_dim")
"""The names the hidden size is looked for under, in this order."""

FORMULAS: dict[str, tuple[str, Callable[[int], int]]] = {
    "reduce_bucket_size": ("h*h", lambda h: h * h),
    "prefetch_bucket_size": ("0.9*h*h", lambda h: int(0.9 * h * h)),
    "param_persistence_threshold": ("10*h", lambda h: 10 * h),
}
"""Each field of ``BY_HIDDEN_SIZE``: its formula, as the Hugging Face integration writes it, and its value."""
assert set(FORMULAS) == set(BY_HIDDEN_SIZE)


def hidden_size(module: Any) -> Optional[int]:
    """The model's hidden size, looked for as [Note: sizes from the hidden size] says; None if nothing says it."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        found = next((getattr(config, n) for n in HIDDEN_SIZE_NAMES if isinstance(getattr(config, n, None), int)),
                     None)
        if found is None and getattr(config, "hidden_sizes", None):
            found = max(config.hidden_sizes)
        if found is not None:
            return int(found)
    hparams = getattr(module, "hparams", {}) or {}
    return next((int(hparams[n]) for n in HIDDEN_SIZE_NAMES if isinstance(hparams.get(n), int)), None)


def sizes_for(fields: tuple[str, ...], h: int) -> dict[str, int]:
    """The values of ``fields`` for hidden size ``h``."""
    return {name: FORMULAS[name][1](h) for name in fields}


def fill(config: ZeroConfig, module: Any) -> tuple[ZeroConfig, dict[str, int]]:
    """``config`` with its ``"auto"`` sizes filled from ``module``'s hidden size, and what was filled; or
    :class:`ZeroConfigError` naming the fields when the model does not say its hidden size."""
    pending = tuple(name for name in BY_HIDDEN_SIZE if getattr(config, name) == AUTO)
    if not pending:
        return config, {}
    h = hidden_size(module)
    if h is None:
        raise ZeroConfigError(
            f"{', '.join(pending)} = \"auto\" is filled from the model's hidden size, but the model does not say it:"
            " no `config` with hidden_size (or hidden_sizes, n_embd, d_model, hidden_dim) on any module, and no"
            f" hyperparameter named {', '.join(HIDDEN_SIZE_NAMES)}. HINT: give these fields numbers, or"
            " `self.save_hyperparameters()` with a `hidden_size` argument.")
    filled = sizes_for(pending, h)
    return replace(config, **filled), filled
