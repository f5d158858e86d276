"""The one typed configuration of a ZeRO run, validated in one place.

:class:`ZeroConfig` is made of sections, each a small frozen dataclass that checks its own fields in its own
``__post_init__``: :class:`ShardingConfig` (what is sharded, the buckets of its collectives),
:class:`ScheduleConfig` (when stage 3 gathers; the engine's ``GatherSchedule`` is this section with every knob
set), :class:`CheckpointConfig`, :class:`OffloadConfig` (DeepSpeed's offload and ``aio`` blocks),
:class:`ZeroPlusPlusConfig` (hybrid sharding and ZeRO++) and :class:`PipelineConfig` (pipeline parallel).
``ZeroConfig`` inherits their fields, so its keyword arguments, attributes and YAML keys are flat
(``ZeroConfig(stage=3, prefetch=2)``, ``config.prefetch``), and adds the run's own options and the checks that span
sections (the stage a knob needs, options that exclude each other).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, get_type_hints

from lzero.config.checkpoint import CheckpointConfig
from lzero.config.checks import did_you_mean, set_positive, true_or_false
from lzero.config.offload import OffloadConfig
from lzero.config.pipeline import PipelineConfig
from lzero.config.schedule import GATHER_KNOBS, ScheduleConfig
from lzero.config.sharding import ShardingConfig
from lzero.config.zero_plus_plus import ZeroPlusPlusConfig
from lzero.errors import ZeroConfigError


@dataclass(frozen=True)
class ZeroConfig(PipelineConfig, ZeroPlusPlusConfig, OffloadConfig, CheckpointConfig, ScheduleConfig, ShardingConfig):
    """What a ZeRO strategy shards, how it communicates and where it keeps state.

    Its fields are its sections' (the bases, listed in reverse so that ``fields()`` and ``--print_config`` start
    with ``ShardingConfig``'s ``stage``), then the run's own below. Each section checks its fields in its
    ``__post_init__``; this one adds the checks that span sections. A bad value raises :class:`ZeroConfigError`.
    """

    gather_after_fit: bool = False
    """Stage 3: at the end of ``fit`` (and of ``validate``/``test``/``predict``) gather every parameter back into a
    whole tensor on every rank, as DDP leaves the model: the whole model in each rank's memory (4 bytes per
    parameter in fp32). Off (the default): the model stays sharded, only this rank's shard resident, and a later
    ``validate``/``test``/``predict``, ``strategy.gathered_parameters()``, ``strategy.generation()`` and
    ``trainer.save_checkpoint`` work on the shards; ``lzero.unshard(model)`` gathers it for good. See [Note: the
    model stays sharded after fit] in lightning/trainer_kept.py."""

    broadcast_buffers: bool = True
    """Before every training step, overwrite module buffers (BatchNorm running statistics...) with
    rank 0's, as DDP does by default, so evaluation sees the same buffers on every rank."""

    train_batch_size: Optional[int] = None
    """The global batch you mean to train with. When set, the strategy checks at the start of
    training that it equals micro batch x ``accumulate_grad_batches`` x world size, and refuses the
    run otherwise. None: no check (``strategy.global_batch_size`` still reports the product)."""

    log_memory: bool = True
    """With a logger, add :class:`lzero.MemoryMonitor`: model-state bytes per rank, store and kind, beside what
    the ZeRO formula expects, the step's peak memory and its communication, every ``log_every_n_steps``.
    An explicit ``MemoryMonitor`` in the Trainer's callbacks wins."""

    allow_untested_optimizer: bool = False
    """Run an optimizer that is not on lzero's allow-list of elementwise optimizers. Such an optimizer
    may compute something other than it would on the whole model (e.g. a norm over a shard only)."""

    exact_init: bool = False
    """Stage 3, a model built in ``configure_model`` or ``init_module(empty_init=True)``: where lzero cannot replay
    its construction exactly as eager code runs it (and so would start from other random draws than DDP, with a
    warning naming the tensor and the reason), raise that as an error instead. See [Note: replayed construction] in
    lzero/engine/replay.py."""

    def __post_init__(self) -> None:
        for section in reversed(ZeroConfig.__bases__):  # each checks its own fields, ShardingConfig's stage first
            section.__post_init__(self)
        if self.train_batch_size is not None:
            set_positive(self, "train_batch_size")
        for name in ("gather_after_fit", "broadcast_buffers", "log_memory", "allow_untested_optimizer", "exact_init"):
            true_or_false(name, getattr(self, name))
        self._check_stage_3_only()
        self._check_combinations()

    def _check_stage_3_only(self) -> None:
        """Options that act on stage 3's gathered parameters, refused below stage 3."""
        if self.stage >= 3:
            return
        defaults = {f.name: f.default for f in fields(ScheduleConfig)}
        for name in (*GATHER_KNOBS, "schedule"):
            if getattr(self, name) != defaults[name]:
                raise ZeroConfigError(f"`{name}={getattr(self, name)!r}` at stage {self.stage}: it schedules stage 3's"
                                      f" parameter gathers, and stage {self.stage} keeps whole parameters. HINT: drop"
                                      f" `{name}`, or use `stage=3`.")
        if self.offload_param.device != "none":
            raise ZeroConfigError(
                f"`offload_param={{'device': {self.offload_param.device!r}}}` at stage {self.stage}: only stage 3 shards"
                " the parameters, so only stage 3 can keep them off the device. HINT: use `stage=3` (the"
                " 'zero3_offload' strategy), or offload the optimizer state alone with `offload_optimizer='cpu'`."
            )
        if self._hpz_on():
            raise ZeroConfigError(f"`hpz_partition_size={self.hpz_partition_size!r}` at stage {self.stage}: hpZ keeps a"
                                  " secondary copy of stage 3's gathered parameters, and stages 1-2 gather none. HINT:"
                                  " use `stage=3`.")
        if self.quantized_weights:
            raise ZeroConfigError(f"`quantized_weights=True` at stage {self.stage}: it quantizes stage 3's parameter"
                                  " all-gathers; at stages 1-2 every rank keeps exact full weights, which a quantized"
                                  " all-gather would make disagree. HINT: use `stage=3`, or drop it.")

    def _check_combinations(self) -> None:
        """Options of different sections that cannot run together."""
        nvme = "nvme" in (self.offload_optimizer.device, self.offload_param.device)
        if self._hpz_on() and self.offload_param.device != "none":
            raise ZeroConfigError(f"`hpz_partition_size={self.hpz_partition_size!r}` with `offload_param="
                                  f"{self.offload_param.device!r}`: hpZ's secondary copy lives in device memory, which"
                                  " offloading parameters frees. HINT: drop one of the two.")
        if self.quantized_weights and self.gather_bucket_size:
            raise ZeroConfigError(f"`gather_bucket_size={self.gather_bucket_size}` with `quantized_weights=True`: a run"
                                  " of blocks is gathered as one buffer of bytes, and qwZ quantizes each unit's values."
                                  " HINT: drop `gather_bucket_size` (qwZ already sends about a quarter of the bytes).")
        if self.shard_group_size is not None and nvme:
            raise ZeroConfigError(
                f"`shard_group_size={self.shard_group_size!r}` with NVMe offload: ranks of different shard groups would"
                " share swap file names on one node. HINT: offload to `cpu` with hybrid sharding, or drop"
                " `shard_group_size`.")
        if self.async_save and self.shard_group_size is not None:
            raise ZeroConfigError(
                f"`async_save=True` with `shard_group_size={self.shard_group_size!r}`: not built yet (the background"
                " save's group spans every rank, while one shard group writes). HINT: drop `async_save`.")
        if self.async_save and self.offload_optimizer.device == "nvme":
            raise ZeroConfigError(
                "`async_save=True` with `offload_optimizer: nvme`: an asynchronous save writes from a copy of the rank's"
                " whole state in host memory, which NVMe offload exists to avoid. HINT: drop `async_save` (NVMe runs"
                " save synchronously, one unit at a time, read from the swap files)."
            )

    def with_overrides(self, **overrides: Any) -> "ZeroConfig":
        """A copy with some fields changed; an unknown field name is refused with a suggestion."""
        _check_names(overrides, "lzero strategy option")
        return replace(self, **overrides)


def _check_names(kwargs: dict[str, Any], what: str) -> None:
    """Refuse a keyword that is not a ZeroConfig field, naming the closest one."""
    known = [f.name for f in fields(ZeroConfig)]
    for name in kwargs:
        if name not in known:
            raise ZeroConfigError(f"Unknown {what} `{name}`. HINT: {did_you_mean(name, known, 'options')}")


def _checked_init(init: Any) -> Any:
    """The dataclass's ``__init__``, refusing unknown keywords with a suggestion instead of a bare TypeError. Its
    annotations become the fields' types resolved where each section declares them: as strings they would be read
    in this module, which does not import every section's types, and jsonargparse could not check the values."""
    hints = get_type_hints(ZeroConfig)
    init.__annotations__.update({f.name: hints[f.name] for f in fields(ZeroConfig)})

    @functools.wraps(init)  # keeps the signature that jsonargparse and help() read
    def __init__(self: ZeroConfig, *args: Any, **kwargs: Any) -> None:
        _check_names(kwargs, "ZeroConfig field")
        init(self, *args, **kwargs)

    return __init__


ZeroConfig.__init__ = _checked_init(ZeroConfig.__init__)  # type: ignore[method-assign]


def optional_config(config: Optional[ZeroConfig], **overrides: Any) -> ZeroConfig:
    """The config a strategy runs with: ``config`` (or the defaults) with ``overrides`` applied."""
    base = config if config is not None else ZeroConfig()
    if not isinstance(base, ZeroConfig):
        raise ZeroConfigError(
            f"`config` must be an lzero.ZeroConfig, got {type(base).__name__}. HINT: `ZeroConfig(stage=2)`."
        )
    return base.with_overrides(**{k: v for k, v in overrides.items() if v is not None})
