"""What the constructors of both lzero strategies (the Trainer's ``ZeroStrategy`` and Fabric's
``ZeroFabricStrategy``) accept beyond Lightning's own arguments, resolved in one place: a
:class:`lzero.ZeroConfig` or a DeepSpeed JSON configuration, the shortcuts over it, and the precision."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

from lzero.config import ZeroConfig, ZeroConfigError, optional_config
from lzero.deepspeed import config as deepspeed_config
from lzero.engine.loss_scale import LossScaleConfig
from lzero.lightning.precision import ZeroFabricPrecision


class StrategyArgs(NamedTuple):
    config: ZeroConfig
    auto: bool  # stage="auto": chosen at setup (see [Note: choosing a stage] in auto.py)
    deepspeed: Optional[deepspeed_config.Translated]  # what a DeepSpeed JSON said beyond the config
    precision: Optional[ZeroFabricPrecision]  # the strategy's own precision, which wins over the front door's
    cpu_checkpointing: bool


def resolve(config: Optional[Union[ZeroConfig, dict, str]], stage: Any, allow_untested_optimizer: Optional[bool],
            precision: Optional[str], loss_scaling: Optional[Union[dict, LossScaleConfig]], cpu_checkpointing: bool,
            blocks: dict[str, dict], options: dict[str, Any],
            precision_type: type[ZeroFabricPrecision] = ZeroFabricPrecision) -> StrategyArgs:
    """``blocks``: DeepSpeed ``optimizer``/``scheduler`` blocks given beside ``config``; they win over the file's.
    ``precision_type``: the door's precision plugin class."""
    deepspeed = deepspeed_config.blocks_only(blocks) if blocks else None
    if config is not None and not isinstance(config, ZeroConfig):  # a DeepSpeed JSON (a path or a dict)
        deepspeed = deepspeed_config.translate({**deepspeed_config.load(config), **blocks})
        overridden = {k for k, v in [*options.items(), ("stage", stage)] if v is not None}  # lzero's names again
        deepspeed.origins = {k: key for k, key in deepspeed.origins.items() if k not in overridden}
        options = {**deepspeed.options, **options}
        stage = stage if stage is not None else options.pop("stage", None)
        options.pop("stage", None)
        config = None
        precision = precision if precision is not None else deepspeed.precision
        loss_scaling = loss_scaling if loss_scaling is not None else (deepspeed.loss_scaling or None)
        cpu_checkpointing = cpu_checkpointing or deepspeed.cpu_checkpointing
    auto = stage == "auto"
    with deepspeed_config.as_written(deepspeed):  # see [Note: errors name the key as written]
        resolved = optional_config(config, stage=None if auto else stage,
                                   allow_untested_optimizer=allow_untested_optimizer, **options)
    if loss_scaling is not None and precision != "16-mixed":
        raise ZeroConfigError(f"`loss_scaling` applies to precision='16-mixed' only, got precision={precision!r}."
                              " HINT: drop `loss_scaling` or use `precision='16-mixed'`.")
    if isinstance(loss_scaling, dict):
        loss_scaling = LossScaleConfig(**loss_scaling)
    plugin = precision_type(precision, loss_scaling=loss_scaling) if precision is not None else None
    return StrategyArgs(resolved, auto, deepspeed, plugin, cpu_checkpointing)
