"""lzero: ZeRO (the Zero Redundancy Optimizer) as a PyTorch Lightning strategy, in pure PyTorch."""

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine import ZeroEngine, ZeroEngineError
from lzero.optimizer import ZeroOptimizer, ZeroOptimizerError
from lzero.partition import Partition, ParamSpec, UnitSpec, partition_by_size
from lzero.precision import ZeroPrecision, ZeroPrecisionError
from lzero.presets import register_presets
from lzero.strategy import ZeroStrategy

__version__ = "0.1.0"


def _register_with_lightning() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    register_presets(StrategyRegistry)


_register_with_lightning()

__all__ = [
    "ParamSpec",
    "Partition",
    "UnitSpec",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "ZeroEngineError",
    "ZeroOptimizer",
    "ZeroOptimizerError",
    "ZeroPrecision",
    "ZeroPrecisionError",
    "ZeroStrategy",
    "partition_by_size",
]
