"""The registered strategy names (``zero1``, ``zero2``, ..., ``zero3_offload_nvme``) and the configuration
each stands for.

Names are registered in one place, ``_lzero_startup.register`` (the start-up hook, and ``import lzero``):
each entry is a lazy factory that calls :func:`lzero.lightning.wiring.build_preset` on first use, with the
Trainer's or Fabric's strategy class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "zero3_offload_nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
    "zero_auto": {"stage": "auto"},
}
"""Each registered name (``_lzero_startup.PRESETS``; tests/lightning/test_registration.py checks they agree) -> its config."""

def strategy_file(name: str) -> Path:
    """The LightningCLI YAML of a preset (``trainer.strategy: <this path>``), wherever lzero is installed:
    ``lzero/strategies/`` in a wheel, ``strategies/`` at the top of a source checkout."""
    if name not in PRESET_CONFIGS:
        raise KeyError(f"No preset {name!r}. HINT: use one of {', '.join(PRESET_CONFIGS)}.")
    package = Path(__file__).resolve().parent
    for folder in (package / "strategies", package.parent / "strategies"):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    raise FileNotFoundError(f"`{name}.yaml` is in neither `{package / 'strategies'}` nor"
                            f" `{package.parent / 'strategies'}`. HINT: reinstall lzero, or use the name:"
                            f" `trainer.strategy: {name}`.")

