"""A DeepSpeed JSON configuration as lzero's own arguments: every key honoured, or refused by name.

[Note: reading a DeepSpeed configuration]
Each key of the configuration has one fate, and :func:`translate` records it:
- honoured: it becomes a :class:`lzero.ZeroConfig` field (the stage-3 scheduling knobs included), the strategy's
  precision (with DeepSpeed's loss-scaling knobs), ``cpu_checkpointing``, the ``optimizer``/``scheduler`` blocks
  built at setup (deepspeed_optim.py, deepspeed_schedules.py), or a Trainer setting (``gradient_clip_val``,
  ``accumulate_grad_batches``);
- filled / renamed: an ``"auto"`` value (from the caller's numbers, the Trainer at setup, or the model's hidden
  size: auto_sizes.py) or a deprecated spelling, honoured with a note saying what it became;
- notice: accepted although lzero does it its own way or it concerns only DeepSpeed's own tooling (logging
  knobs, ``save_16bit_model``'s switch, DeepSpeed-internal bucketing), with a note naming the key;
- refused: an unknown key (with a did-you-mean), a feature lzero does not have (ZeRO++, MiCS, the
  ``LRRangeTest`` scheduler), a value lzero cannot honour, or a contradiction. All refusals of one
  configuration are raised together in one :class:`DeepSpeedConfigError`.
The keys and their fates: deepspeed_keys.py.

[Note: errors name the key as written]
lzero's checks of a value (``ZeroConfig``'s, and those at setup that need the world size: an hpZ partition or a
shard group that must divide it) name lzero's field. A value that came from a DeepSpeed configuration is named as
the user wrote it: the translation records each option's key (``Translated.origins``), and ``as_written`` rewrites
an error raised for it, ``zero_optimization.zero_hpz_partition_size=8`` where lzero says ``hpz_partition_size=8``
(lzero's name follows in parentheses). It wraps the translation's own check, the strategy's resolution of its
arguments (the options a constructor argument overrode are lzero's again) and the engine's start at both doors.
"""

from __future__ import annotations

import difflib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from lzero.auto_sizes import FORMULAS
from lzero.config import BY_HIDDEN_SIZE, ZeroConfig, ZeroConfigError
from lzero.deepspeed.keys import (ZERO_PLUS_PLUS_READ, FP16_KEYS, LOGGING_KEYS, LOSS_SCALE_KEYS, NOT_BUILT_TOP, ONLY_DEFAULT_TOP, STAGE3_SCHEDULE,
                                   PIPELINE_KEYS, TENSOR_PARALLEL_KEYS, TOP_KEYS, ZERO_KEYS, ZERO_NOTICE, ZERO_ONLY_VALUE, ZERO_PLUS_PLUS, ZERO_RENAMED,
                                   ZERO_SIZES)

AUTO = "auto"


class DeepSpeedConfigError(ZeroConfigError):
    """One or more keys of a DeepSpeed configuration that lzero refuses; ``errors`` holds one line per key."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors) if len(errors) == 1 else
                         f"{len(errors)} keys of the DeepSpeed configuration are refused:\n- " + "\n- ".join(errors))


@dataclass(frozen=True)
class Note:
    """What became of one key that is not simply honoured."""

    key: str
    """Its dotted path, e.g. ``zero_optimization.reduce_bucket_size``."""

    kind: str
    """"filled" (an ``auto`` value), "renamed" (a deprecated spelling) or "notice" (accepted, done lzero's way)."""

    text: str


@dataclass(frozen=True)
class BatchTriple:
    """DeepSpeed's three batch keys as written (None: absent or ``auto``)."""

    train_batch_size: Optional[int] = None
    micro: Optional[int] = None
    accumulate: Optional[int] = None


@dataclass
class Translated:
    """A DeepSpeed configuration as lzero arguments (see [Note: reading a DeepSpeed configuration])."""

    options: dict[str, Any] = field(default_factory=dict)
    """:class:`lzero.ZeroConfig` fields."""

    origins: dict[str, str] = field(default_factory=dict)
    """The key each of ``options`` was written as (``hpz_partition_size`` -> ``zero_optimization.zero_hpz_partition_size``):
    see [Note: errors name the key as written]."""

    precision: Optional[str] = None
    """The strategy's precision, from the ``fp16``/``bf16`` blocks; None when neither block says."""

    loss_scaling: dict[str, Any] = field(default_factory=dict)
    """``16-mixed``: :class:`lzero.LossScaleConfig` fields given in the ``fp16`` block."""

    loss_scaling_if_fp16: dict[str, Any] = field(default_factory=dict)
    """``fp16.enabled: "auto"`` before the Trainer is known: the block's loss-scaling fields, applied if the
    Trainer's precision turns out to be ``16-mixed``."""

    cpu_checkpointing: bool = False
    """From the ``activation_checkpointing`` block."""

    gradient_clip_val: Optional[float] = None
    """For the Trainer; None: no clipping."""

    batch: BatchTriple = BatchTriple()
    """The batch keys after DeepSpeed's rule, as far as the known numbers allow."""

    notes: list[Note] = field(default_factory=list)

    optimizer: Optional[dict[str, Any]] = None
    """The ``optimizer`` block, checked (lzero/deepspeed/optim.py); built when ``configure_optimizers`` returns none."""

    scheduler: Optional[dict[str, Any]] = None
    """The ``scheduler`` block, checked; stepped every optimizer step."""


    def strategy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ZeroStrategy``."""
        kwargs = dict(self.options)
        if self.precision is not None:
            kwargs["precision"] = self.precision
        if self.loss_scaling:
            kwargs["loss_scaling"] = dict(self.loss_scaling)
        if self.cpu_checkpointing:
            kwargs["cpu_checkpointing"] = True
        for kind in ("optimizer", "scheduler"):
            if getattr(self, kind) is not None:
                kwargs[f"deepspeed_{kind}"] = getattr(self, kind)
        return kwargs

    def trainer_kwargs(self) -> dict[str, Any]:
        """Trainer settings the configuration implies (clipping, accumulation)."""
        kwargs: dict[str, Any] = {}
        if self.gradient_clip_val is not None:
            kwargs["gradient_clip_val"] = self.gradient_clip_val
        if self.batch.accumulate is not None:
            kwargs["accumulate_grad_batches"] = self.batch.accumulate
        return kwargs


def load(ds: Union[dict, str, Path]) -> dict:
    """The configuration as a dict: ``ds`` itself, or the JSON file it names."""
    if isinstance(ds, dict):
        return ds
    path = Path(ds)
    if not path.is_file():
        raise ZeroConfigError(f"DeepSpeed configuration {str(ds)!r} is not a file. HINT: pass a path to a JSON"
                              " file or a dict.")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ZeroConfigError(f"{path} is not valid JSON: {err}. HINT: DeepSpeed configurations are JSON.") from err
    if not isinstance(loaded, dict):
        raise ZeroConfigError(f"{path} holds {type(loaded).__name__}, not a JSON object.")
    return loaded


def translate(ds: Union[dict, str, Path], *, world_size: Optional[int] = None, micro_batch: Optional[int] = None,
              accumulate: Optional[int] = None, trainer_precision: Optional[str] = None) -> Translated:
    """lzero's arguments for DeepSpeed configuration ``ds``; the other arguments are what the caller knows (the
    world size, the DataLoader's batch size, ``accumulate_grad_batches``, ``Trainer(precision=...)``), used to fill
    ``"auto"`` values and to check the batch rule. Raises :class:`DeepSpeedConfigError` naming every refused key."""
    reader = _Reader(load(ds))
    reader.run(world_size, micro_batch, accumulate, trainer_precision)
    if reader.errors:
        raise DeepSpeedConfigError(reader.errors)
    return reader.out


def blocks_only(blocks: dict[str, Any]) -> Translated:
    """``ZeroStrategy(deepspeed_optimizer=..., deepspeed_scheduler=...)`` without a configuration: the blocks checked."""
    from lzero.deepspeed import optim as deepspeed_optim

    return Translated(**{kind: deepspeed_optim.check(kind, block) for kind, block in blocks.items()})


class _Reader:
    """One pass over a configuration, collecting the result and every refusal."""

    def __init__(self, ds: dict) -> None:
        self.ds, self.out, self.errors = ds, Translated(), []
        self.pipeline_micro: Optional[int] = None  # the `pipeline` block's micro_batch_size

    def _zero_plus_plus(self, block: dict, opts: dict, p: str) -> None:
        """ZeRO++'s hpZ, qwZ and qgZ, read as lzero's fields ([Note: hpZ], [Note: quantized collectives])."""
        hpz = block.get("zero_hpz_partition_size", 1)
        if hpz not in (1, None):
            self.option("hpz_partition_size", int(hpz) if isinstance(hpz, float) and hpz.is_integer() else hpz,
                        p + "zero_hpz_partition_size")
            self.note(p + "zero_hpz_partition_size", "notice", f"-> `hpz_partition_size: {hpz}` (hpZ)")
        if block.get("zero_quantized_weights", False):
            self.option("quantized_weights", block["zero_quantized_weights"], p + "zero_quantized_weights")
            self.note(p + "zero_quantized_weights", "notice", "-> `quantized_weights: true` (qwZ, blockwise int8)")
        if block.get("zero_quantized_gradients", False):
            value = block["zero_quantized_gradients"]
            self.option("quantized_gradients", 4 if value is True else value, p + "zero_quantized_gradients")
            self.note(p + "zero_quantized_gradients", "notice",
                      f"-> `quantized_gradients: {opts['quantized_gradients']}` (qgZ; DeepSpeed's is int4)")

    def refuse(self, message: str) -> None:
        self.errors.append(message)

    def option(self, name: str, value: Any, key: str) -> None:
        """lzero's option ``name`` is ``value``, written as DeepSpeed's ``key``."""
        self.out.options[name] = value
        self.out.origins[name] = key

    def note(self, key: str, kind: str, text: str) -> None:
        self.out.notes.append(Note(key, kind, text))

    def guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except (ZeroConfigError, ValueError) as err:
            self.refuse(str(err))

    def run(self, world: Optional[int], micro: Optional[int], acc: Optional[int], precision: Optional[str]) -> None:
        self.check_keys(self.ds, TOP_KEYS, "")
        logging = [k for k in LOGGING_KEYS if k in self.ds]
        if logging:
            self.note(", ".join(logging), "notice", "keys of DeepSpeed's own logging and tooling (its logger,"
                      " dataloader and checkpoint engine); lzero logs through the Trainer's logger (and"
                      " MemoryMonitor), trains on your DataLoaders and writes its own sharded checkpoints, so these"
                      " are not used")
        for key, why in NOT_BUILT_TOP.items():
            off = isinstance(self.ds.get(key), dict) and self.ds[key].get("enabled") is False
            if key in self.ds and not off:
                self.refuse(f"`{key}`: {why}. HINT: remove `{key}` from the configuration.")
        for key, values in ONLY_DEFAULT_TOP.items():
            if key in self.ds and self.ds[key] not in values:
                runs = " or ".join(map(json.dumps, values))
                self.refuse(f"`{key}={self.ds[key]!r}` is not built in lzero (it runs {runs}). HINT: remove `{key}`.")
        if self.ds.get("fp32_allreduce") is False:
            self.note("fp32_allreduce", "notice", "false accepted: lzero reduces gradients in fp32 under every precision"
                                                  " a DeepSpeed configuration asks for")
        for kind in ("optimizer", "scheduler"):
            if kind in self.ds:
                self.guarded(self.optim_block, kind)
        self.guarded(self.zero, self.ds.get("zero_optimization", {}))
        if "tensor_parallel" in self.ds:
            self.guarded(self.tensor_parallel, self.ds["tensor_parallel"])
        if "pipeline" in self.ds:
            self.guarded(self.pipeline, self.ds["pipeline"])
        self.guarded(self.precision, precision)
        self.guarded(self.batch, world, micro, acc)
        self.guarded(self.misc)

    def optim_block(self, kind: str) -> None:
        from lzero.deepspeed import optim as deepspeed_optim

        spec = deepspeed_optim.check(kind, self.ds[kind])
        setattr(self.out, kind, spec)
        for key in [k for k, v in spec["params"].items() if v == AUTO]:
            self.note(f"{kind}.params.{key}", "filled", f"auto -> {deepspeed_optim.AUTO_SOURCES[kind][key]}, when"
                      " training starts")

    def check_keys(self, block: Any, known: tuple, prefix: str) -> bool:
        if not isinstance(block, dict):
            self.refuse(f"`{prefix.rstrip('.')}` must be a JSON object, got {block!r}.")
            return False
        for key in block:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean `{prefix}{close[0]}`?" if close else "DeepSpeed has no such key either."
                self.refuse(f"Unknown DeepSpeed key `{prefix}{key}`. HINT: {hint}")
        return True

    # --- pipeline ------------------------------------------------------------------------------------------------

    def pipeline(self, block: Any) -> None:
        """The ``pipeline`` block: the stage count (``stages``, or the seeds' ``pp_size`` with a notice: DeepSpeed
        takes it from ``PipelineModule(num_stages=...)``) becomes ``pipeline_parallel_size``; ``micro_batch_size`` is
        ``train_micro_batch_size_per_gpu``; ``gradient_accumulation_steps`` becomes the micro-batches per step
        (``pipeline_microbatches``, the Trainer accumulating nothing: the DataLoader's batch is micro x accumulation);
        ``partition: parameters`` is lzero's balance; what lzero does not run is refused by name. See [Note: pipeline
        parallel under ZeRO] in lzero/engine/pipeline.py."""
        p = "pipeline."
        if not self.check_keys(block, PIPELINE_KEYS, p):
            return
        size, key = None, None
        if "pp_size" in block:
            size, key = block["pp_size"], p + "pp_size"
            self.note(key, "renamed", "read as the stage count, `pipeline.stages` (DeepSpeed takes it from"
                                      " `PipelineModule(num_stages=...)`, not from the configuration)")
        stages = block.get("stages", AUTO)
        if stages != AUTO:
            if size is not None and stages != size:
                raise ZeroConfigError(f"`{p}stages={stages!r}` and `{p}pp_size={size!r}` disagree. HINT: keep"
                                      f" `{p}stages` alone (DeepSpeed's key).")
            size, key = stages, p + "stages"
        if size is None:
            raise ZeroConfigError(f"`pipeline` without a stage count (`{p}stages` is 'auto'): DeepSpeed takes it from"
                                  " `PipelineModule(num_stages=...)`, which lzero has not. HINT: set `pipeline.stages`"
                                  " to the pipeline's ranks, e.g. 2.")
        self.option("pipeline_parallel_size", size, key)
        partition = block.get("partition", "parameters")
        if partition != "parameters":
            self.refuse(f"`{p}partition={partition!r}`: lzero balances stages by parameter count (DeepSpeed's"
                        " 'parameters'). HINT: remove it, or cut where you want with `pipeline_split_points` (the"
                        " layers where stages 1, 2, ... begin).")
        interval = block.get("activation_checkpoint_interval", 0)
        if interval not in (0, None):
            self.refuse(f"`{p}activation_checkpoint_interval={interval!r}`: checkpointing every n-th layer is not"
                        " built. HINT: remove it and pass `ZeroStrategy(activation_checkpointing=True)`, which"
                        " checkpoints every layer.")
        for name, why in (("seed_layers", "each layer drawn from a seed of its own"),
                          ("pipe_partitioned", "activations sent between stages cut over the tensor ranks"),
                          ("grad_partitioned", "gradients sent between stages cut over the tensor ranks")):
            if block.get(name, False) is not False:
                self.refuse(f"`{p}{name}={block[name]!r}`: {why} is not built (each tensor rank sends its whole"
                            f" activation). HINT: remove it or set it to false.")
        if "use_reentrant" in block:
            self.note(p + "use_reentrant", "notice", "accepted, not used: it concerns "
                                                     "`activation_checkpoint_interval`, which is 0")
        micro = block.get("micro_batch_size")
        if micro is not None:
            given = self.ds.get("train_micro_batch_size_per_gpu")
            if given not in (None, AUTO) and given != micro:
                raise ZeroConfigError(f"`{p}micro_batch_size={micro!r}` and `train_micro_batch_size_per_gpu={given!r}`"
                                      " disagree. HINT: keep one of them.")
            self.pipeline_micro = micro
            self.note(p + "micro_batch_size", "renamed", "read as `train_micro_batch_size_per_gpu`")
        accumulation = self.ds.get("gradient_accumulation_steps")
        if accumulation not in (None, AUTO):
            self.option("pipeline_microbatches", accumulation, "gradient_accumulation_steps")
            self.note("gradient_accumulation_steps", "notice", "-> `pipeline_microbatches`: the schedule runs that"
                      " many micro-batches per step; the DataLoader's batch is micro x accumulation, the Trainer"
                      " accumulates nothing")

    # --- tensor_parallel -----------------------------------------------------------------------------------------

    def tensor_parallel(self, block: Any) -> None:
        """DeepSpeed's AutoTP training block: ``autotp_size`` (the seeds' ``tp_size`` read as it, with a notice: DeepSpeed
        itself refuses that key) becomes ``tensor_parallel_size``, and the plan ``partition_config``'s ``layer_specs``
        (regexes over parameter names), else ``tp_plan: auto`` (the Hugging Face model's ``base_model_tp_plan``, as
        AutoTP reads it), which steps aside where ``configure_model`` parallelized the model itself. See [Note: tensor
        parallel under ZeRO] in lzero/engine/tensor_parallel.py."""
        p = "tensor_parallel."
        if not self.check_keys(block, TENSOR_PARALLEL_KEYS, p):
            return
        why = {"dtype": "the model's dtype comes from the `bf16`/`fp16` blocks and the Trainer's precision",
               "tp": "the inference-time `tp` sub-block is not read; give the size as `autotp_size`",
               "preset_model": "DeepSpeed's built-in presets are not read; give `partition_config` or let the Hugging"
                               " Face model's own plan apply (no `partition_config`)",
               "injection_policy_tuple": "inference kernel injection is not part of lzero",
               "keep_module_on_host": "checkpoint loading on the host is DeepSpeed's inference engine's",
               "replace_with_kernel_inject": "inference kernel injection is not part of lzero",
               "kernel_inject": "inference kernel injection is not part of lzero"}
        for key in [k for k in block if k in why]:
            self.refuse(f"`{p}{key}`: {why[key]}. HINT: remove `{p}{key}`.")
        if block.get("tp_overlap_comm", False) is not False:
            self.refuse(f"`{p}tp_overlap_comm={block['tp_overlap_comm']!r}`: overlapping the tensor-parallel all-reduce"
                        " is not built (torch's styles run it in line). HINT: remove it or set it to false.")
        size, key = block.get("autotp_size", 0), p + "autotp_size"
        if "tp_size" in block:
            if "autotp_size" in block and block["tp_size"] != size:
                raise ZeroConfigError(f"`{p}tp_size={block['tp_size']!r}` and `{p}autotp_size={size!r}` disagree."
                                      " HINT: keep `autotp_size` alone (DeepSpeed's key).")
            size, key = block["tp_size"], p + "tp_size"
            self.note(key, "renamed", "read as `tensor_parallel.autotp_size` (DeepSpeed's AutoTP key; DeepSpeed itself"
                                      " refuses `tp_size` there)")
        if size in (0, 1):  # AutoTP off
            if "partition_config" in block:
                raise ZeroConfigError(f"`{p}partition_config` without a tensor-parallel size (`{key}={size!r}`)."
                                      f" HINT: set `{p}autotp_size` to the tensor ranks, e.g. 2.")
            return
        self.option("tensor_parallel_size", size, key)
        if "partition_config" in block:
            self.option("tp_plan", _partition_plan(block["partition_config"], p + "partition_config"),
                        p + "partition_config")
            self.note(p + "partition_config", "notice", "-> `tp_plan`: each layer_specs pattern a regex over parameter"
                                                        " names (`re:` keys), row -> rowwise, column -> colwise")
        else:
            self.option("tp_plan", "auto", key)
            self.note(key, "notice", "-> `tp_plan: auto`: the Hugging Face model's `base_model_tp_plan`, unless"
                                     " `configure_model` parallelizes the model itself")

    # --- zero_optimization ---------------------------------------------------------------------------------------

    def zero(self, block: Any) -> None:
        if not self.check_keys(block, ZERO_KEYS, "zero_optimization."):
            return
        opts, p = self.out.options, "zero_optimization."
        stage = block.get("stage", 0)
        if stage != 0:
            self.option("stage", stage, p + "stage")
        else:
            self.refuse("`zero_optimization.stage` is 0 (DeepSpeed's default when absent): plain data parallel."
                        " HINT: set `stage` to 1, 2 or 3, or use `strategy='ddp'`.")
        for key, name in [*ZERO_SIZES.items(), *STAGE3_SCHEDULE.items()]:
            if key in STAGE3_SCHEDULE and key in block and stage != 3:
                self.refuse(f"`{p}{key}={block[key]!r}` at stage {stage}: it schedules stage 3's parameter gathers"
                            f" (lzero's `{name}`). HINT: remove it, or use stage 3.")
            elif block.get(key) == AUTO and name in BY_HIDDEN_SIZE:
                self.option(name, AUTO, p + key)
                self.note(p + key, "filled", f"auto -> `{name}: auto`, filled from the model's hidden size h at"
                                             f" setup ({FORMULAS[name][0]}, as the Hugging Face integration fills it)")
            elif block.get(key) == AUTO:
                self.refuse(f"`{p}{key}=\"auto\"`: nothing fills it (the Hugging Face integration does not either)."
                            f" HINT: write a number, or remove it for lzero's default.")
            elif key in block:
                value = block[key]
                self.option(name, int(value) if isinstance(value, float) and value.is_integer() else value, p + key)
        if block.get("overlap_comm") is not None:
            self.option("overlap_comm", block["overlap_comm"], p + "overlap_comm")
        mics = block.get("mics_shard_size", -1)
        if mics not in (-1, None):  # MiCS: shard within groups of this many ranks, replicate across them
            if isinstance(mics, bool) or not isinstance(mics, int) or mics < 1:
                self.refuse(f"`{p}mics_shard_size={mics!r}` must be a number of ranks >= 1 (or -1: off).")
            else:
                self.option("shard_group_size", mics, p + "mics_shard_size")
                self.note(p + "mics_shard_size", "notice", f"-> `shard_group_size: {mics}` (hybrid sharding)")
        hierarchical = block.get("mics_hierarchical_params_gather", False)
        if hierarchical and mics in (-1, None):
            self.refuse(f"`{p}mics_hierarchical_params_gather=true` without `mics_shard_size`: it stages MiCS's"
                        " all-gather. HINT: set `mics_shard_size` (the ranks per node), or remove it.")
        elif hierarchical:  # the gather never leaves the group: nothing left to stage
            self.note(p + "mics_hierarchical_params_gather", "notice",
                      "the all-gather already stays within the shard group (one node)")
        self._zero_plus_plus(block, opts, p)
        for key, off in ZERO_PLUS_PLUS.items():
            if key in ("mics_shard_size", "mics_hierarchical_params_gather", *ZERO_PLUS_PLUS_READ):
                continue
            if key in block and block[key] != off:
                self.refuse(f"`{p}{key}={block[key]!r}`: not built in lzero (ZeRO++'s hpZ, qwZ and qgZ are). HINT:"
                            f" remove `{key}`{'' if off is None else f' or set it to {json.dumps(off)}'}.")
        for key, (only, why) in ZERO_ONLY_VALUE.items():
            if key in block and block[key] != only:
                self.refuse(f"`{p}{key}={block[key]!r}`: {why}. HINT: remove it or set it to {json.dumps(only)}.")
        for old, new in ZERO_RENAMED.items():
            if old in block:
                self.note(p + old, "renamed", f"read as `{new}` (DeepSpeed's current name)")
                if new in block and block[new] != block[old]:
                    self.refuse(f"`{p}{old}` and `{p}{new}` differ; the first is the older name of the second."
                                f" HINT: keep `{new}`.")
        for key, what in ZERO_NOTICE.items():
            value = block.get(key, next((block[o] for o, n in ZERO_RENAMED.items() if n == key and o in block), None))
            if value is not None:
                self.note(p + key, "notice", f"{json.dumps(value)} accepted: {what}")
        self.offload(block)

    def offload(self, block: dict) -> None:
        p = "zero_optimization."
        pin = block.get("cpu_offload_use_pin_memory")
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
            if old not in block:
                continue
            if new in block:
                self.refuse(f"`{p}{old}` and `{p}{new}` both given; the first is the deprecated form of the second."
                            f" HINT: keep `{new}`.")
                continue
            self.note(p + old, "renamed", f"{json.dumps(block[old])} -> `{new}: {{device: "
                                          f"{'cpu' if block[old] else 'none'}}}`")
            if block[old]:
                self.option(new, {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}, p + old)
        if pin is not None:
            self.note(p + "cpu_offload_use_pin_memory", "renamed", f"-> `pin_memory: {json.dumps(pin)}` in the"
                                                                   " offload blocks made from `cpu_offload*`")
        for key in ("offload_optimizer", "offload_param"):
            if isinstance(block.get(key), dict):
                sub = dict(block[key])
                if "fast_init" in sub:
                    self.note(f"{p}{key}.fast_init", "notice", f"{json.dumps(sub.pop('fast_init'))} accepted: lzero"
                              " creates swap files as it writes them")
                self.option(key, sub, p + key)
            elif key in block and block[key] is not None:
                self.option(key, block[key], p + key)

    # --- precision, batch, the rest ------------------------------------------------------------------------------

    def precision(self, trainer_precision: Optional[str]) -> None:
        ds = dict(self.ds)
        if "bfloat16" in ds:
            self.note("bfloat16", "renamed", "read as `bf16`")
            ds.setdefault("bf16", ds["bfloat16"])
        fp16, bf16 = ds.get("fp16", {}), ds.get("bf16", {})
        if not (self.check_keys(fp16, FP16_KEYS, "fp16.") and self.check_keys(bf16, ("enabled",), "bf16.")):
            return
        said = {name: block.get("enabled") for name, block in (("16-mixed", fp16), ("bf16-mixed", bf16))
                if "enabled" in block}
        for name, enabled in list(said.items()):
            key = "fp16.enabled" if name == "16-mixed" else "bf16.enabled"
            if enabled == AUTO and trainer_precision is None:
                del said[name]
                knobs = {k: fp16[k] for k in LOSS_SCALE_KEYS if k in fp16} if name == "16-mixed" else {}
                self.note(key, "filled", "auto -> the Trainer's precision" + (
                    f"; if it is 16-mixed, with loss_scaling {json.dumps(knobs)}" if knobs else ""))
            elif enabled == AUTO:
                said[name] = _normal(trainer_precision) == name
                self.note(key, "filled", f"auto -> {json.dumps(said[name])} (Trainer precision {trainer_precision!r})")
        on = [name for name, enabled in said.items() if enabled]
        if len(on) == 2:
            raise ZeroConfigError("`fp16.enabled` and `bf16.enabled` are both true. HINT: enable one of them.")
        chosen = on[0] if on else ("32-true" if said else None)
        if chosen is not None and trainer_precision is not None and _normal(trainer_precision) != chosen:
            raise ZeroConfigError(
                f"The DeepSpeed configuration asks for precision {chosen!r} (its fp16/bf16 blocks) but the Trainer for"
                f" {trainer_precision!r}. HINT: make them agree, or drop one (the Trainer's `precision` or the"
                " configuration's block).")
        self.out.precision = chosen
        knobs = {k: fp16[k] for k in LOSS_SCALE_KEYS if k in fp16}
        if chosen is None and fp16.get("enabled") == AUTO:
            self.out.loss_scaling_if_fp16 = knobs
            from lzero.engine.loss_scale import LossScaleConfig

            LossScaleConfig(**knobs)  # refuse bad values now, by name
        elif chosen == "16-mixed":
            self.out.loss_scaling = knobs
            if "auto_cast" in fp16:
                self.note("fp16.auto_cast", "notice", f"{json.dumps(fp16['auto_cast'])} accepted: lzero's 16-mixed"
                                                      " always runs forward under fp16 autocast")
            from lzero.engine.loss_scale import LossScaleConfig

            LossScaleConfig(**self.out.loss_scaling)  # refuse bad values now, by name
        elif any(k in fp16 for k in LOSS_SCALE_KEYS):
            self.note("fp16", "notice", "loss-scaling keys accepted, not used: fp16 is not enabled")

    def batch(self, world: Optional[int], micro: Optional[int], acc: Optional[int]) -> None:
        names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        if "pipeline" in self.ds:  # the DataLoader's batch is micro x accumulation: checked when training starts
            micro = acc = None
        caller = (None, micro, acc)
        given: list[Optional[int]] = []
        for name, known in zip(names, caller):
            value = self.ds.get(name)
            if value is None and name == "train_micro_batch_size_per_gpu":
                value = self.pipeline_micro
            if value == AUTO:
                value = known
                self.note(name, "filled", f"auto -> {value}" if value is not None else
                          "auto -> the Trainer's value (checked when training starts)")
            elif value is not None:
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ZeroConfigError(f"`{name}={value!r}` must be a whole number >= 1.")
            given.append(value)
        self.out.batch = resolve_batch(BatchTriple(*given), world, micro, acc)
        if self.out.batch.train_batch_size is not None:
            self.option("train_batch_size", self.out.batch.train_batch_size, "train_batch_size")

    def misc(self) -> None:
        clip = self.ds.get("gradient_clipping")
        if clip == AUTO:
            self.note("gradient_clipping", "filled", "auto -> the Trainer's `gradient_clip_val`")
        elif clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
                raise ZeroConfigError(f"`gradient_clipping={clip!r}` must be a number >= 0 (0: off).")
            self.out.gradient_clip_val = float(clip) if clip > 0 else None
        if "zero_allow_untested_optimizer" in self.ds:
            self.option("allow_untested_optimizer", self.ds["zero_allow_untested_optimizer"],
                        "zero_allow_untested_optimizer")
        if "zero_force_ds_cpu_optimizer" in self.ds:
            self.note("zero_force_ds_cpu_optimizer", "notice", f"{json.dumps(self.ds['zero_force_ds_cpu_optimizer'])}"
                      " accepted: with offload lzero steps the torch optimizer you return, on the host")
        if "aio" in self.ds:
            self.option("aio", self.ds["aio"], "aio")
            if isinstance(self.ds["aio"], dict) and "thread_count" in self.ds["aio"]:
                self.note("aio.thread_count", "renamed", "read as `aio.intra_op_parallelism`")
        if "activation_checkpointing" in self.ds:
            from lzero.engine.activation_checkpointing import from_deepspeed

            self.out.cpu_checkpointing = from_deepspeed(self.ds["activation_checkpointing"])["cpu_checkpointing"]
        with as_written(self.out):  # every value checked by lzero's own rules, refused by the key as written
            ZeroConfig(**self.out.options)


def _partition_plan(config: Any, where: str) -> dict[str, str]:
    """AutoTP's ``partition_config`` as a ``tp_plan`` of ``re:`` patterns (see [Note: the tensor-parallel plan] in
    lzero/engine/tensor_parallel_plan.py); refused by name where it asks for what lzero does not build."""
    if not isinstance(config, dict) or not isinstance(config.get("layer_specs"), list) or not config["layer_specs"]:
        raise ZeroConfigError(f"`{where}` must be an object with a non-empty `layer_specs` list, found {config!r:.80}."
                              " HINT: `layer_specs`: a list of {patterns: [regexes over parameter names],"
                              " partition_type: 'row' or 'column'}.")
    unknown = [k for k in config if k not in ("layer_specs", "use_default_specs")]
    if unknown:
        raise ZeroConfigError(f"`{where}.{unknown[0]}` is not an AutoTP partition key. HINT: `layer_specs` and"
                              " `use_default_specs` only.")
    styles = {"row": "rowwise", "column": "colwise"}
    plan: dict[str, str] = {}
    for i, spec in enumerate(config["layer_specs"]):
        at = f"{where}.layer_specs[{i}]"
        if not isinstance(spec, dict):
            raise ZeroConfigError(f"`{at}` must be an object with `patterns` and `partition_type`, found {spec!r:.60}.")
        extra = [k for k in spec if k not in ("patterns", "partition_type")]
        if extra:
            raise ZeroConfigError(f"`{at}.{extra[0]}`: fused layers cut along a reshaped dimension (`shape`,"
                                  " `partition_dim`) are not built. HINT: split that projection in the model, or"
                                  " parallelize it in `configure_model` yourself.")
        if spec.get("partition_type") not in styles:
            raise ZeroConfigError(f"`{at}.partition_type={spec.get('partition_type')!r}` is not 'row' or 'column'."
                                  " HINT: 'column' splits output features, 'row' input features.")
        patterns = spec.get("patterns")
        if not isinstance(patterns, list) or not patterns or not all(isinstance(x, str) for x in patterns):
            raise ZeroConfigError(f"`{at}.patterns` must be a non-empty list of regexes, found {patterns!r:.60}.")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ZeroConfigError(f"`{at}.patterns`: {pattern!r} is not a regex ({err}). HINT: a Python regex"
                                      " searched in parameter names, e.g. '.*\\.o_proj\\.weight$'.") from err
            plan[f"re:{pattern}"] = styles[spec["partition_type"]]
    return plan


@contextmanager
def as_written(translated: Optional[Translated]) -> Iterator[None]:
    """A :class:`ZeroConfigError` raised inside for an option ``translated`` holds names the DeepSpeed key it was
    written as (see [Note: errors name the key as written]); ``translated`` None: nothing changes."""
    try:
        yield
    except ZeroConfigError as err:
        message = written_as(str(err), translated.origins) if translated is not None else str(err)
        if message == str(err):
            raise
        raise DeepSpeedConfigError([message]).with_traceback(err.__traceback__) from None


def written_as(message: str, origins: dict[str, str]) -> str:
    """``message`` with each lzero option of ``origins`` it names in backticks (```name=...```, ```name.key```,
    ```name```) named by its DeepSpeed key; the first mention of each adds lzero's name where the two differ."""
    named: set[str] = set()

    def rename(span: re.Match) -> str:
        text = span.group(1)
        name = next((n for n in sorted(origins, key=len, reverse=True)
                     if text == n or text.startswith((f"{n}=", f"{n}."))), None)
        if name is None:
            return span.group(0)
        key, also = origins[name], ""
        if name not in named and key.rsplit(".", 1)[-1] != name:
            also = f" (lzero's `{name}`)"
        named.add(name)
        return f"`{key}{text[len(name):]}`{also}"

    return re.sub(r"`([^`]+)`", rename, message)


def _normal(precision: str) -> str:
    """Lightning's short precision names as the long ones."""
    return {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "16-mixed": "16-mixed"}.get(str(precision),
                                                                                                str(precision))


def resolve_batch(triple: BatchTriple, world: Optional[int], micro: Optional[int] = None,
                  acc: Optional[int] = None) -> BatchTriple:
    """DeepSpeed's rule ``train_batch_size = micro x accumulation x world size``: the triple completed from what is
    known (given two, the third), or :class:`ZeroConfigError` showing the numbers when they disagree."""
    total, m, a = triple.train_batch_size, triple.micro, triple.accumulate
    shown = f"world size {world if world is not None else '(not known yet)'}"
    for name, mine, theirs in (("train_micro_batch_size_per_gpu", m, micro), ("gradient_accumulation_steps", a, acc)):
        if mine is not None and theirs is not None and mine != theirs:
            what = "the DataLoader's batch size" if name.startswith("train_micro") else "accumulate_grad_batches"
            raise ZeroConfigError(f"`{name}={mine}` but {what} is {theirs} (train_batch_size {total}, {shown})."
                                  f" HINT: make them agree, or write \"auto\" in the configuration.")
    m = m if m is not None else micro
    a = a if a is not None else acc
    if total is None and m is not None and a is not None and world is not None:
        total = m * a * world
    if total is not None and world is not None:
        if m is None and a is None:
            a = 1
        if m is None:
            m = _divide(total, a * world, total, m, a, world)
        if a is None:
            a = _divide(total, m * world, total, m, a, world)
    elif m is not None and a is None and total is None:
        a = 1
    if None not in (total, m, a):
        if world is None:
            _divide(total, m * a, total, m, a, world)  # some whole world size must fit
        elif total != m * a * world:
            raise _mismatch(total, m, a, world)
    return BatchTriple(total, m, a)


def _divide(total: int, by: int, *numbers: Any) -> int:
    if total % by:
        raise _mismatch(*numbers)
    return total // by


def _mismatch(total: Any, m: Any, a: Any, world: Any) -> ZeroConfigError:
    product = f" = {m * a * world}" if None not in (m, a, world) else ""
    return ZeroConfigError(
        f"Batch sizes disagree: train_batch_size {total} != train_micro_batch_size_per_gpu {m} x"
        f" gradient_accumulation_steps {a} x world size {world if world is not None else '(any)'}{product}."
        " HINT: DeepSpeed's rule is train_batch_size = micro x accumulation x world size; give two of the three"
        " (or \"auto\") and lzero derives the third.")


# --- checks against the Trainer (called by ZeroStrategy) ---------------------------------------------------------


def apply_to_trainer(translated: Translated, trainer: Any) -> None:
    """Set the Trainer's clipping and accumulation from the configuration where the Trainer left its defaults (the
    accumulation derived from ``train_batch_size`` and the micro batch at this world size when the configuration gives
    those two); refuse a Trainer value that differs."""
    check_trainer_precision(translated, trainer)
    b, accumulate = translated.batch, translated.batch.accumulate
    if translated.options.get("pipeline_parallel_size", 1) > 1:
        accumulate = None  # the schedule's micro-batches: [Note: pipeline parallel under ZeRO]
    elif accumulate is None and b.train_batch_size is not None and b.micro is not None:  # given two, the third
        world = trainer.world_size
        accumulate = _divide(b.train_batch_size, b.micro * world, b.train_batch_size, b.micro, None, world)
    for attr, key, value, default in (
        ("gradient_clip_val", "gradient_clipping", translated.gradient_clip_val, None),
        ("accumulate_grad_batches", "gradient_accumulation_steps", accumulate, 1),
    ):
        current = getattr(trainer, attr)
        if value is None or current == value:
            continue
        if current not in (default, 0):
            raise ZeroConfigError(f"The DeepSpeed configuration sets `{key}={value}` but the Trainer has `{attr}="
                                  f"{current}`. HINT: make them agree, or drop one of them.")
        setattr(trainer, attr, value)


def check_trainer_precision(translated: Translated, trainer: Any) -> None:
    """Refuse a ``Trainer(precision=...)`` (other than the default 32-true) that contradicts the fp16/bf16 blocks.
    Lightning keeps a strategy's own precision plugin and drops the Trainer's flag silently, so it is read here."""
    name = str(getattr(getattr(trainer, "_accelerator_connector", None), "_precision_flag", "32-true"))
    if translated.precision is not None and name != "32-true" and _normal(name) != translated.precision:
        raise ZeroConfigError(
            f"The DeepSpeed configuration asks for precision {translated.precision!r} (its fp16/bf16 blocks) but the"
            f" Trainer for {name!r}. HINT: make them agree, or drop one (the Trainer's `precision` or the"
            " configuration's block).")
