"""The one typed configuration of a ZeRO run, validated in one place."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Optional

BUILT_STAGES = (1, 2, 3)
"""Stages this release implements; the others are refused with a clear error."""

OffloadDevice = Literal["none", "cpu", "nvme"]


class ZeroConfigError(ValueError):
    """A configuration value that lzero cannot run with; the message names the value and the fix."""


@dataclass(frozen=True)
class ZeroConfig:
    """What a ZeRO strategy shards, how it communicates and where it keeps state.

    Every field is checked in ``__post_init__``; a bad value raises :class:`ZeroConfigError`.
    """

    stage: int = 2
    """ZeRO stage. 1: optimizer state sharded. 2: also gradients. 3: also parameters."""

    reduce_bucket_size: int = 5_000_000
    """Elements per gradient reduce-scatter. At stages 1 and 2 this is also the size limit of a unit:
    parameters are packed, in backward order, into flat units of at most this many elements (a larger
    parameter forms a unit of its own). Counted in elements, as DeepSpeed counts them."""

    allgather_bucket_size: int = 5_000_000
    """Elements per parameter all-gather after the optimizer step. Consecutive units are coalesced into
    one collective up to this many elements, so small units do not each pay a collective's latency
    (and very large gathers cost more per element: benchmarks/results_collectives.md)."""

    overlap_comm: bool = True
    """Launch each unit's gradient reduce-scatter asynchronously as soon as its gradients are ready, so
    communication overlaps the rest of backward. False runs every collective synchronously."""

    max_inflight_reductions: int = 2
    """With ``overlap_comm``, how many reduce-scatters may be outstanding at once. Each holds one unit
    of gradients, so this bounds the extra memory that overlapping costs."""

    unit_modules: Optional[tuple[str, ...]] = None
    """Stage 3: class names of the modules whose instances form units (e.g. ``("Block",)``). None
    finds them: the outermost module classes that repeat (transformer blocks)."""

    prefetch: int = 1
    """Stage 3: how many units ahead to all-gather while the current one computes (0: none)."""

    unit_order_timeout_s: float = 120.0
    """Stage 3: before each unit's all-gather the ranks check that they gather the same unit; a rank
    that does not arrive within this many seconds raises an error naming the unit (0 disables the
    check). This turns a unit run on only some ranks into a clear error instead of a silent mix."""

    exception_checkpoint_timeout_s: float = 30.0
    """After an exception, a checkpoint asked for by an ``on_exception`` hook (``OnExceptionCheckpoint``)
    is written only if every rank reaches it within this many seconds; otherwise it is skipped with a
    warning and the ranks go on to exit (under DDP such a save waits in Lightning's barrier for the
    process group timeout). A checkpoint needs every rank, so an exception on one rank only skips it."""

    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Stage 3, ``strategy.lightning_module_state_dict()``: "sharded" values expose this rank's piece
    and ``full_tensor()``; "full" gathers plain tensors onto rank 0, one unit at a time."""

    checkpoint_format: Literal["sharded", "full"] = "sharded"
    """What ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write while fitting: "sharded", a
    directory in which every rank writes its own pieces (resumable at any world size and stage;
    ``lzero consolidate`` turns it into one file), or "full", one DDP-format file gathered onto rank 0
    one unit at a time (readable by plain Lightning)."""

    async_save: bool = False
    """Sharded checkpoints only: copy this rank's pieces to CPU memory and write them on a background
    thread (its collectives on a process group of their own) while training continues. At most one
    save is in flight; the checkpoint a save replaces is deleted only after the new one commits."""

    broadcast_buffers: bool = True
    """Before every training step, overwrite module buffers (BatchNorm running statistics...) with
    rank 0's, as DDP does by default, so evaluation sees the same buffers on every rank."""

    offload_optimizer: OffloadDevice = "none"
    """Where the fp32 master shards and optimizer state live: "none" (the device), "cpu" or "nvme".
    Only "none" is built in this release."""

    offload_param: OffloadDevice = "none"
    """Where stage-3 parameter shards live between uses. Only "none" is built in this release."""

    train_batch_size: Optional[int] = None
    """The global batch you mean to train with. When set, the strategy checks at the start of
    training that it equals micro batch x ``accumulate_grad_batches`` x world size, and refuses the
    run otherwise. None: no check (``strategy.global_batch_size`` still reports the product)."""

    find_unused_parameters: bool = False
    """DDP's semantics for parameters that get no gradient: a parameter that no rank used in a step is
    not stepped (its optimizer state untouched), as under ``DDPStrategy(find_unused_parameters=True)``.
    Every parameter then forms a unit of its own, so each is reduce-scattered (and, at stage 3, sharded)
    separately: more, smaller collectives. False (the default, DeepSpeed's behaviour): units are
    bucketed, and an unused parameter in a unit whose other parameters got gradients is stepped with a
    zero gradient, which stateful optimizers (Adam's momentum) still move. A unit that no rank used at
    all is skipped either way."""

    allow_untested_optimizer: bool = False
    """Run an optimizer that is not on lzero's allow-list of elementwise optimizers. Such an optimizer
    may compute something other than it would on the whole model (e.g. a norm over a shard only)."""

    def __post_init__(self) -> None:
        _check_stage(self.stage)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "max_inflight_reductions"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():  # DeepSpeed configs write 5e8
                object.__setattr__(self, name, int(value))
            _check_positive_int(name, getattr(self, name))
        if self.train_batch_size is not None:
            _check_positive_int("train_batch_size", self.train_batch_size)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ZeroConfigError(f"`prefetch={self.prefetch!r}` must be a whole number >= 0. HINT: e.g. `prefetch=1`.")
        if isinstance(self.unit_order_timeout_s, bool) or not isinstance(self.unit_order_timeout_s, (int, float)) \
                or self.unit_order_timeout_s < 0:
            raise ZeroConfigError(
                f"`unit_order_timeout_s={self.unit_order_timeout_s!r}` must be a number of seconds >= 0."
                " HINT: e.g. 120, or 0 to disable the check."
            )
        timeout = self.exception_checkpoint_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ZeroConfigError(
                f"`exception_checkpoint_timeout_s={timeout!r}` must be a number of seconds > 0. HINT: e.g. 30."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ZeroConfigError(
                f"`state_dict_type={self.state_dict_type!r}` is not one of 'sharded', 'full'. HINT: use 'sharded'."
            )
        if not isinstance(self.async_save, bool):
            raise ZeroConfigError(f"`async_save={self.async_save!r}` must be true or false.")
        if self.async_save and self.checkpoint_format != "sharded":
            raise ZeroConfigError("`async_save=True` needs `checkpoint_format='sharded'`: a full checkpoint is gathered"
                                  " onto rank 0. HINT: drop one of the two.")
        if self.checkpoint_format not in ("sharded", "full"):
            raise ZeroConfigError(
                f"`checkpoint_format={self.checkpoint_format!r}` is not one of 'sharded', 'full'."
                " HINT: 'sharded' (a directory per checkpoint) or 'full' (one DDP-format file)."
            )
        if self.unit_modules is not None:
            if isinstance(self.unit_modules, str) or not all(isinstance(n, str) for n in self.unit_modules):
                raise ZeroConfigError(
                    f"`unit_modules={self.unit_modules!r}` must be a list of class names. HINT: `unit_modules=['Block']`."
                )
            object.__setattr__(self, "unit_modules", tuple(self.unit_modules))
        for name in ("offload_optimizer", "offload_param"):
            value = getattr(self, name)
            if value not in ("none", "cpu", "nvme"):
                raise ZeroConfigError(
                    f"`{name}={value!r}` is not a store. HINT: use one of 'none', 'cpu', 'nvme'."
                )
            if value != "none":
                raise ZeroConfigError(
                    f"`{name}={value!r}`: offload is not built in this lzero release."
                    f" HINT: use `{name}='none'`."
                )
        for name in ("overlap_comm", "broadcast_buffers", "find_unused_parameters", "allow_untested_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise ZeroConfigError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")

    def with_overrides(self, **overrides: Any) -> "ZeroConfig":
        """A copy with some fields changed; an unknown field name is refused with a suggestion."""
        _check_names(overrides, "lzero strategy option")
        return replace(self, **overrides)


def _check_names(kwargs: dict[str, Any], what: str) -> None:
    """Refuse a keyword that is not a ZeroConfig field, naming the closest one."""
    known = [f.name for f in fields(ZeroConfig)]
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"the options are: {', '.join(known)}."
            raise ZeroConfigError(f"Unknown {what} `{name}`. HINT: {hint}")


def _checked_init(init: Any) -> Any:
    """The dataclass's ``__init__``, refusing unknown keywords with a suggestion instead of a bare TypeError."""

    @functools.wraps(init)  # keeps the signature that jsonargparse and help() read
    def __init__(self: ZeroConfig, *args: Any, **kwargs: Any) -> None:
        _check_names(kwargs, "ZeroConfig field")
        init(self, *args, **kwargs)

    return __init__


ZeroConfig.__init__ = _checked_init(ZeroConfig.__init__)  # type: ignore[method-assign]


def _check_stage(stage: Any) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ZeroConfigError(
            f"Unknown ZeRO stage {stage!r}. HINT: use stage 1 (optimizer state), 2 (+ gradients)"
            " or 3 (+ parameters); for plain data parallel use `strategy='ddp'`."
        )
    if stage not in BUILT_STAGES:
        raise ZeroConfigError(
            f"ZeRO stage {stage} is not part of lzero (stages: {BUILT_STAGES})."
            " HINT: stage 0 is plain data parallel: use `strategy='ddp'`."
        )


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ZeroConfigError(
            f"`{name}={value!r}` must be a positive whole number of elements."
            f" HINT: e.g. `{name}={ZeroConfig.__dataclass_fields__[name].default or 32}`."
        )


def optional_config(config: Optional[ZeroConfig], **overrides: Any) -> ZeroConfig:
    """The config a strategy runs with: ``config`` (or the defaults) with ``overrides`` applied."""
    base = config if config is not None else ZeroConfig()
    if not isinstance(base, ZeroConfig):
        raise ZeroConfigError(
            f"`config` must be an lzero.ZeroConfig, got {type(base).__name__}. HINT: `ZeroConfig(stage=2)`."
        )
    return base.with_overrides(**{k: v for k, v in overrides.items() if v is not None})
