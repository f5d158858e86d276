"""lzero: ZeRO (the Zero Redundancy Optimizer) as a PyTorch Lightning strategy, in pure PyTorch.

The engine (partition, collectives, optimizer) needs only torch; the Lightning glue
(``ZeroStrategy``, ``ZeroPrecision``) is imported on first access, so engine code and tests do
not pay for importing Lightning. Importing lzero makes the strategy names known to Lightning:
at once if Lightning's strategies are already loaded, otherwise the moment they load.
"""

from typing import Any

import _lzero_startup
from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine.engine import ZeroEngine, ZeroEngineError
from lzero.engine.loss_scale import LossScaleConfig, LossScaleError, LossScaler
from lzero.optimizer import ZeroOptimizer, ZeroOptimizerError
from lzero.engine.partition import ParamSpec, Partition, UnitSpec, partition_by_size
from lzero.errors import ZeroError

__version__ = "0.1.0"

_LIGHTNING_EXPORTS = {
    "ZeroStrategy": "lzero.lightning.trainer_strategy",
    "ZeroFabricStrategy": "lzero.lightning.fabric_strategy",
    "ZeroPrecision": "lzero.lightning.trainer_precision",
    "ZeroFabricPrecision": "lzero.lightning.precision",
    "ZeroPrecisionError": "lzero.lightning.precision",
    "MemoryMonitor": "lzero.memory.monitor",
    "grad_norm": "lzero.grad_norms",
    "unshard": "lzero.lightning.trainer_kept",
}


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_LIGHTNING_EXPORTS[name]), name)
    raise AttributeError(f"module 'lzero' has no attribute {name!r}")


_lzero_startup.install()

__all__ = [
    "LossScaleConfig",
    "MemoryMonitor",
    "LossScaleError",
    "LossScaler",
    "ParamSpec",
    "Partition",
    "UnitSpec",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "ZeroEngineError",
    "ZeroError",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroOptimizer",
    "ZeroOptimizerError",
    "ZeroPrecision",
    "ZeroPrecisionError",
    "ZeroStrategy",
    "grad_norm",
    "partition_by_size",
    "unshard",
]
