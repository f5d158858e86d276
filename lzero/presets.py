"""The registered strategy names (``zero1``, ``zero2``, ...) and the configuration each stands for."""

from __future__ import annotations

from typing import Any

from _lzero_startup import PRESETS

PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
}
assert PRESET_CONFIGS.keys() == PRESETS.keys(), "every registered name needs a configuration"


def build_preset(name: str, **init_params: Any) -> Any:
    """The strategy a registered name stands for (Lightning builds it with no arguments)."""
    from lzero.strategy import ZeroStrategy

    return ZeroStrategy(**{**PRESET_CONFIGS[name], **init_params})


def register_presets(registry: Any) -> None:
    """Register every preset name with ``registry``; repeating it is harmless."""
    from lzero.strategy import ZeroStrategy

    for name, description in PRESETS.items():
        registry.register(name, ZeroStrategy, description=description, override=True, **PRESET_CONFIGS[name])
