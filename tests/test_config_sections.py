"""ZeroConfig's sections: each checks its own fields on its own, ZeroConfig is exactly their fields (flat) plus its
own, and the engine's GatherSchedule is the schedule section with its knobs filled."""

from __future__ import annotations

from dataclasses import fields

import pytest

from lzero.config import (AioConfig, CheckpointConfig, OffloadConfig, OffloadOptimizer, OffloadParam, PipelineConfig,
                          ScheduleConfig, ShardingConfig, ZeroConfig, ZeroConfigError, ZeroPlusPlusConfig, did_you_mean,
                          whole_number)
from lzero.engine.blocks import MEMORY_MINIMAL, GatherSchedule

SECTIONS = (ShardingConfig, ScheduleConfig, CheckpointConfig, OffloadConfig, ZeroPlusPlusConfig, PipelineConfig)


def test_zero_config_is_its_sections_fields_then_its_own_stage_first() -> None:
    names = [f.name for f in fields(ZeroConfig)]
    from_sections = [f.name for section in SECTIONS for f in fields(section)]
    assert names[:len(from_sections)] == from_sections and names[0] == "stage"
    assert len(set(names)) == len(names) == 43


@pytest.mark.parametrize("section, kwargs, match", [
    (ShardingConfig, {"stage": 0}, "`stage=0`: ZeRO stage 0 is not part of lzero"),
    (ShardingConfig, {"allgather_bucket_size": 0}, "`allgather_bucket_size=0` must be a positive whole number"),
    (ShardingConfig, {"optimizer_partition": "per_tensr"}, "`optimizer_partition='per_tensr'` is not an option.*did you"
                                                           " mean `per_tensor`"),
    (ScheduleConfig, {"max_reuse_distance": 1.5}, "`max_reuse_distance=1.5` must be a whole number of elements >= 0"),
    (ScheduleConfig, {"prefetch": 2, "prefetch_bucket_size": 10}, "both say how far to prefetch"),
    (CheckpointConfig, {"async_save": True, "checkpoint_format": "full"}, "needs `checkpoint_format='sharded'`"),
    (OffloadConfig, {"offload_optimizer": {"device": "cpu", "ratio": 2}}, r"`offload_optimizer.ratio=2` must be"),
    (ZeroPlusPlusConfig, {"quantized_gradients": 3}, "`quantized_gradients=3` is not one of None, 8, 4"),
    (OffloadOptimizer, {"host_threads": -1}, "`offload_optimizer.host_threads=-1` must be a whole number >= 0"),
    (OffloadParam, {"device": "nvme", "buffer_count": 1}, "`offload_param.buffer_count=1` must be a whole number >= 2"),
    (AioConfig, {"block_size": 1000}, "must be a multiple of 4096 bytes"),
    (PipelineConfig, {"pipeline_schedule": "interleaved_zero_bubble"}, "is refused: its split of the weight gradient"),
])
def test_a_section_checks_its_own_fields(section: type, kwargs: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        section(**kwargs)
    block = {OffloadOptimizer: "offload_optimizer", OffloadParam: "offload_param", AioConfig: "aio"}.get(section)
    with pytest.raises(ZeroConfigError, match=match):  # the same error through ZeroConfig
        ZeroConfig(**({"stage": 3, block: kwargs} if block else {"stage": 3, **kwargs}))


def test_what_spans_sections_is_checked_by_zero_config_only() -> None:
    assert ScheduleConfig(prefetch=2).prefetch == 2  # no stage in the section: stage 3's knob is fine there
    with pytest.raises(ZeroConfigError, match="`prefetch=2` at stage 2"):
        ZeroConfig(stage=2, prefetch=2)
    assert ZeroPlusPlusConfig(quantized_weights=True).quantized_weights
    with pytest.raises(ZeroConfigError, match="`gather_bucket_size=8` with `quantized_weights=True`"):
        ZeroConfig(stage=3, quantized_weights=True, gather_bucket_size=8)


def test_whole_numbers_from_integral_floats_only() -> None:
    assert whole_number("sub_group_size", 1e9, 1) == 1_000_000_000 and type(whole_number("x", 5.0)) is int
    assert ZeroConfig(stage=3, prefetch=2.0, sub_group_size=1e8).prefetch == 2
    assert AioConfig(block_size=1048576.0).block_size == 1048576
    for bad in (2.5, True, "8", -1):
        with pytest.raises(ZeroConfigError, match=f"`key={bad!r}` must be a whole number >= 0"):
            whole_number("key", bad)


def test_did_you_mean_names_the_closest_or_lists_all() -> None:
    assert did_you_mean("prefech", ["prefetch", "stage"], "options") == "did you mean `prefetch`?"
    assert did_you_mean("zzz", ["prefetch", "stage"], "keys") == "the keys are: prefetch, stage."


def test_gather_schedule_is_the_schedule_section_with_its_knobs_filled() -> None:
    config = ZeroConfig(stage=3, prefetch_bucket_size=100, max_live_parameters=7)
    schedule = GatherSchedule.of(config)
    assert isinstance(schedule, ScheduleConfig)
    assert {k: getattr(schedule, k) for k in MEMORY_MINIMAL} == MEMORY_MINIMAL
    assert (schedule.prefetch_bucket_size, schedule.max_live_parameters) == (100, 7)
    assert GatherSchedule.of(ZeroConfig(stage=3, max_reuse_distance=5)).max_reuse_distance == 5
