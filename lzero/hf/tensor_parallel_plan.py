"""``tp_plan`` on Hugging Face models: ``"auto"`` read from each model's ``config.base_model_tp_plan``, and the
attention heads the tensor dimension must divide. See [Note: the tensor-parallel plan] in
lzero/engine/tensor_parallel_plan.py."""

from __future__ import annotations

import sys
from typing import Union

from torch import nn

from lzero.engine.tensor_parallel_plan import resolve_plan
from lzero.errors import ZeroConfigError


def hf_models(root: nn.Module) -> dict[str, nn.Module]:
    """The outermost Hugging Face ``PreTrainedModel``s inside ``root``, by module name (none if transformers was never
    imported)."""
    if "transformers" not in sys.modules:
        return {}
    from transformers import PreTrainedModel

    found: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        if isinstance(module, PreTrainedModel) and not any(_inside(name, outer) for outer in found):
            found[name] = module
    return found


def auto_plan(root: nn.Module) -> dict[str, str]:
    """Each Hugging Face model's ``config.base_model_tp_plan``, its patterns prefixed with the base model's path from
    ``root``; refused by name where a model has none, or where ``root`` holds no Hugging Face model."""
    models = hf_models(root)
    if not models:
        raise ZeroConfigError(f"`tp_plan='auto'` on {type(root).__name__}, which holds no Hugging Face PreTrainedModel:"
                              " 'auto' reads a model's `config.base_model_tp_plan`. HINT: give `tp_plan` as a dict of"
                              " module-name patterns to 'colwise'/'rowwise'.")
    plan: dict[str, str] = {}
    for name, model in models.items():
        base_plan = getattr(model.config, "base_model_tp_plan", None)
        if not base_plan:
            raise ZeroConfigError(f"`tp_plan='auto'`: {type(model).__name__} (`{name or 'the module'}`) has no"
                                  " `config.base_model_tp_plan`. HINT: give `tp_plan` as a dict of module-name patterns"
                                  " to 'colwise'/'rowwise', or parallelize in `configure_model` yourself.")
        base = _join(name, model.base_model_prefix if model.base_model is not model else "")
        plan.update({_join(base, pattern): style for pattern, style in base_plan.items()})
    return plan


def plan_for(root: nn.Module, tp_plan: Union[str, dict[str, str]], tensor_parallel_size: int) -> dict[str, str]:
    """The module names of ``root`` to parallelize and their styles: ``tp_plan`` (``"auto"`` or a dict) resolved and
    checked (see [Note: the tensor-parallel plan]), with the heads of every Hugging Face model it touches."""
    resolved = resolve_plan(root, auto_plan(root) if tp_plan == "auto" else tp_plan, tensor_parallel_size)
    for name, model in hf_models(root).items():
        if any(_inside(module, name) for module in resolved):
            _check_heads(model, tensor_parallel_size)
    return resolved


def _check_heads(model: nn.Module, size: int) -> None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % size:
            raise ZeroConfigError(f"`tp_plan` on {type(model).__name__}: tensor_parallel_size={size} does not divide its"
                                  f" {key}={heads}, so a rank would hold part of a head. HINT: a tensor_parallel_size"
                                  f" that divides {key} ({heads}).")


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def _join(prefix: str, name: str) -> str:
    return ".".join(part for part in (prefix, name) if part)

