"""The one typed configuration of a ZeRO run: :class:`ZeroConfig` (zero_config.py), made of its sections, each a
module beside it that checks its own fields (sharding.py, schedule.py, checkpoint.py, offload.py,
zero_plus_plus.py, pipeline.py), with the checks they share in checks.py. The names are handed on from here."""

from lzero.config.checkpoint import CheckpointConfig
from lzero.config.checks import AUTO, BY_HIDDEN_SIZE, did_you_mean, true_or_false, whole_number
from lzero.config.offload import NVME_KEYS, AioConfig, OffloadConfig, OffloadDevice, OffloadOptimizer, OffloadParam
from lzero.config.pipeline import PIPELINE_SCHEDULES, PipelineConfig
from lzero.config.schedule import GATHER_KNOBS, ScheduleConfig
from lzero.config.sharding import BUILT_STAGES, ShardingConfig
from lzero.config.zero_config import ZeroConfig, optional_config
from lzero.config.zero_plus_plus import ZeroPlusPlusConfig
from lzero.errors import ZeroConfigError

__all__ = [
    "AUTO", "BUILT_STAGES", "BY_HIDDEN_SIZE", "GATHER_KNOBS", "NVME_KEYS", "AioConfig", "CheckpointConfig",
    "OffloadConfig", "OffloadDevice", "OffloadOptimizer", "OffloadParam", "PIPELINE_SCHEDULES", "PipelineConfig",
    "ScheduleConfig", "ShardingConfig",
    "ZeroConfig", "ZeroConfigError", "ZeroPlusPlusConfig", "did_you_mean", "optional_config", "true_or_false",
    "whole_number",
]
