"""The one typed configuration of a ZeRO run, validated in one place.

:class:`ZeroConfig` is made of sections, each a small frozen dataclass that checks its own fields in its own
``__post_init__``: :class:`ShardingConfig` (what is sharded, the buckets of its collectives),
:class:`ScheduleConfig` (when stage 3 gathers; the engine's ``GatherSchedule`` is this section with every knob
set), :class:`CheckpointConfig`, :class:`OffloadConfig` (DeepSpeed's offload and ``aio`` blocks) and
:class:`ZeroPlusPlusConfig` (hybrid sharding and ZeRO++). ``ZeroConfig`` inherits their fields, so its keyword
arguments, attributes and YAML keys are flat (``ZeroConfig(stage=3, prefetch=2)``, ``config.prefetch``), and adds
the run's own options and the checks that span sections (the stage a knob needs, options that exclude each other).
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal, Optional, Sequence, Union

from lzero.errors import ZeroError

BUILT_STAGES = (1, 2, 3)
"""Stages this release implements; the others are refused with a clear error."""

OffloadDevice = Literal["none", "cpu", "nvme"]


class ZeroConfigError(ZeroError, ValueError):
    """A configuration value that lzero cannot run with; the message names the value and the fix."""


NVME_KEYS = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write")
"""DeepSpeed offload keys that only apply with ``device: nvme`` (ZeRO-Infinity)."""

AUTO = "auto"
BY_HIDDEN_SIZE = ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")
"""The fields that may be "auto": sized from the model's hidden size at setup ([Note: sizes from the hidden size]
in auto_sizes.py), as the Hugging Face integration sizes DeepSpeed's keys."""


def whole_number(name: str, value: Any, least: int = 0, unit: str = "", hint: str = "") -> int:
    """``value`` of the option ``name`` as an int: a float that is a whole number becomes one (DeepSpeed configs
    write 5e8); a fraction, a bool, anything else, or a number below ``least`` is refused, naming ``name``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = f"a positive whole number{unit}" if least == 1 else f"a whole number{unit} >= {least}"
        raise ZeroConfigError(f"`{name}={value!r}` must be {what}." + (f" HINT: {hint}" if hint else ""))
    return value


def did_you_mean(name: Any, known: Sequence[str], what: str) -> str:
    """The HINT for an unknown ``name``: the closest of ``known`` (its ``what``: "keys", "options"), or all of them."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f"did you mean `{close[0]}`?" if close else f"the {what} are: {', '.join(known)}."


def true_or_false(name: str, value: Any) -> None:
    """Refuse a ``value`` of the option ``name`` that is not a bool (YAML's true/false)."""
    if not isinstance(value, bool):
        raise ZeroConfigError(f"`{name}={value!r}` must be true or false.")


def _set_whole(section: Any, name: str, least: int = 0, unit: str = "", hint: str = "", label: str = "") -> None:
    """The field ``name`` of a frozen ``section`` checked by :func:`whole_number` and stored as an int."""
    object.__setattr__(section, name, whole_number(label or name, getattr(section, name), least, unit, hint))


def _set_positive(section: Any, name: str) -> None:
    """A count of elements (or of collectives) > 0, with the field's default as the example."""
    default = type(section).__dataclass_fields__[name].default
    _set_whole(section, name, 1, " of elements", f"e.g. `{name}={default or 32}`.")


@dataclass(frozen=True)
class OffloadOptimizer:
    """DeepSpeed's ``offload_optimizer`` block (its names and defaults)."""

    KEY: ClassVar[str] = "offload_optimizer"

    device: OffloadDevice = "none"
    """"none": on the device the model computes on; "cpu": host memory; "nvme": swap files under ``nvme_path``."""

    pin_memory: bool = True
    """On CUDA, keep the host tensors the copies read and write in page-locked memory, so copies run
    asynchronously at full bus speed. Ignored (nothing to pin) when the model computes on the CPU."""

    ratio: float = 1.0
    """The fraction of the optimizer state (by elements) that is offloaded; the first units, up to
    ``1 - ratio`` of the elements, keep their state on the device and step there (DeepSpeed's Twin-Flow)."""

    nvme_path: Optional[str] = None
    """``device: nvme``: the folder (on a fast local disk) that holds the swap files; None: a per-run folder
    under the system temporary directory, printed at start."""

    buffer_count: int = 4
    """``device: nvme``: units whose state may be in host memory at once while the step reads ahead and writes
    behind (at least 2)."""

    pipeline_read: bool = False
    """``device: nvme``: read the next group of units while the current one steps."""

    pipeline_write: bool = False
    """``device: nvme``: write a stepped group back while the next one steps, instead of waiting for it."""

    host_threads: int = 0
    """Threads of the host optimizer step per process (torch's intra-op threads; the delayed update's worker gets
    the same team). 0: this host's cores divided evenly among its processes, since torch's default of one thread
    per core in every process oversubscribes a host that runs one process per GPU."""

    huge_pages: bool = True
    """Back the host store's persistent buffers (fp32 masters, shard gradients, the outgoing compute-dtype copies,
    stage-3 parameter shards in host memory) with transparent huge pages (``madvise``) where the kernel offers
    them: fewer page faults and TLB misses for memory streamed every step. A request; a kernel without them gives
    ordinary pages. See [Note: persistent host buffers] in lzero/offload/host_memory.py."""

    delayed_update: bool = False
    """``device: cpu``: the one-step delayed parameter update of the ZeRO-Offload paper ("DPU", section 5.3; not
    in DeepSpeed's releases). The host step of step t runs on a worker thread while the device computes the
    forward and backward of step t+1, which therefore uses the parameters of step t-1: each step's gradients are
    one update stale. Clipping, the non-finite check and loss scaling still see each step's own gradients. A
    checkpoint, validation, test, predict and the end of fit first finish the step in flight. Changes the
    training trajectory (not bitwise equal to the same run without it); see [Note: one-step delayed update]."""

    def __post_init__(self) -> None:
        _check_offload_values(self)


@dataclass(frozen=True)
class OffloadParam:
    """DeepSpeed's ``offload_param`` block (its names and defaults); stage 3 only."""

    KEY: ClassVar[str] = "offload_param"

    device: OffloadDevice = "none"
    """"none": parameter shards on the device; "cpu": in host memory; "nvme": swap files (past ``max_in_cpu``)."""

    pin_memory: bool = True
    """As :attr:`OffloadOptimizer.pin_memory`."""

    nvme_path: Optional[str] = None
    """``device: nvme``: as :attr:`OffloadOptimizer.nvme_path`."""

    buffer_count: int = 5
    """``device: nvme``: parameter shards being read at once."""

    buffer_size: int = 100_000_000
    """``device: nvme``: elements per read buffer (sized to min(this, the largest unit))."""

    max_in_cpu: int = 1_000_000_000
    """``device: nvme``: parameter elements kept in host memory instead of files."""

    def __post_init__(self) -> None:
        _check_offload_values(self)


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's ``aio`` block: how NVMe swap files are read and written (lzero: a thread pool issuing
    ``os.preadv``/``os.pwritev`` on ``O_DIRECT`` files; no libaio)."""

    block_size: int = 1_048_576
    """Bytes per request."""

    queue_depth: int = 8
    """Requests in flight per thread."""

    intra_op_parallelism: int = 1
    """I/O threads (DeepSpeed's older name ``thread_count`` is read as this)."""

    single_submit: bool = False
    """Submit requests one at a time instead of in batches (lzero's threads submit one request per call, so
    both values behave the same)."""

    overlap_events: bool = True
    """Overlap request submission and completion (always so with lzero's thread pool)."""

    use_gds: bool = False
    """GPUDirect Storage; refused: this torch build offers no usable ``torch.cuda.gds`` path in lzero."""
    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "intra_op_parallelism"):
            _set_whole(self, key, 1, label=f"aio.{key}")
        if self.block_size % 4096:
            raise ZeroConfigError(f"`aio.block_size={self.block_size}` must be a multiple of 4096 bytes (O_DIRECT"
                                  " requests are page-aligned). HINT: e.g. 1048576.")
        for key in ("single_submit", "overlap_events", "use_gds"):
            true_or_false(f"aio.{key}", getattr(self, key))
        if self.use_gds:
            raise ZeroConfigError(
                "`aio.use_gds=true`: lzero does not read swap files with GPUDirect Storage (it reads through host"
                " buffers). HINT: set `use_gds: false`."
            )


@dataclass(frozen=True)
class ShardingConfig:
    """What is sharded, and how gradients and parameters are grouped into units and collectives."""

    stage: int = 2
    """ZeRO stage. 1: optimizer state sharded. 2: also gradients. 3: also parameters."""

    reduce_bucket_size: Union[int, Literal["auto"]] = 5_000_000
    """Elements per gradient reduce-scatter. At stages 1 and 2 this is also the size limit of a unit:
    parameters are packed, in backward order, into flat units of at most this many elements (a larger
    parameter forms a unit of its own). Counted in elements, as DeepSpeed counts them. "auto": h*h for the
    model's hidden size h, filled at setup (see [Note: sizes from the hidden size] in auto_sizes.py)."""

    allgather_bucket_size: int = 5_000_000
    """Elements per parameter all-gather after the optimizer step. Consecutive units are coalesced into
    one collective up to this many elements, so small units do not each pay a collective's latency
    (and very large gathers cost more per element: benchmarks/README.md, collectives)."""

    overlap_comm: bool = True
    """Launch each unit's gradient reduce-scatter asynchronously as soon as its gradients are ready, so
    communication overlaps the rest of backward. False runs every collective synchronously."""

    max_inflight_reductions: int = 2
    """With ``overlap_comm``, how many reduce-scatters may be outstanding at once. Each holds one unit
    of gradients, so this bounds the extra memory that overlapping costs."""

    unit_modules: Optional[tuple[str, ...]] = None
    """Stage 3: class names of the modules whose instances form units (e.g. ``("Block",)``). None
    finds them: the outermost module classes that repeat (transformer blocks)."""

    unit_order_timeout_s: float = 120.0
    """Stage 3: before each unit's all-gather the ranks check that they gather the same unit; a rank
    that does not arrive within this many seconds raises an error naming the unit (0 disables the
    check). This turns a unit run on only some ranks into a clear error instead of a silent mix."""

    find_unused_parameters: bool = False
    """DDP's semantics for parameters that get no gradient: a parameter that no rank used in a step is
    not stepped (its optimizer state untouched), as under ``DDPStrategy(find_unused_parameters=True)``.
    Every parameter then forms a unit of its own, so each is reduce-scattered (and, at stage 3, sharded)
    separately: more, smaller collectives. False (the default, DeepSpeed's behaviour): units are
    bucketed, and an unused parameter in a unit whose other parameters got gradients is stepped with a
    zero gradient, which stateful optimizers (Adam's momentum) still move. A unit that no rank used at
    all is skipped either way."""

    def __post_init__(self) -> None:
        _check_stage(self.stage)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "max_inflight_reductions"):
            if getattr(self, name) != AUTO or name not in BY_HIDDEN_SIZE:
                _set_positive(self, name)
        timeout = self.unit_order_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ZeroConfigError(f"`unit_order_timeout_s={timeout!r}` must be a number of seconds >= 0."
                                  " HINT: e.g. 120, or 0 to disable the check.")
        if self.unit_modules is not None:
            if isinstance(self.unit_modules, str) or not isinstance(self.unit_modules, (list, tuple)) or \
                    not all(isinstance(n, str) for n in self.unit_modules):
                raise ZeroConfigError(
                    f"`unit_modules={self.unit_modules!r}` must be a list of class names. HINT: `unit_modules=['Block']`."
                )
            object.__setattr__(self, "unit_modules", tuple(self.unit_modules))
        for name in ("overlap_comm", "find_unused_parameters"):
            true_or_false(name, getattr(self, name))


GATHER_KNOBS = ("prefetch", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                "param_persistence_threshold", "gather_bucket_size")
"""The stage-3 knobs of [Note: stage-3 gather schedule]: whole numbers, or None (unset)."""

_KNOB_WORDS = {  # (unit, HINT) of a knob's error
    **{name: (" of elements", "e.g. 0, or leave it unset.") for name in GATHER_KNOBS},
    "prefetch": ("", "e.g. `prefetch=1`."),
    **{name: (" of elements", '"auto" sizes it from the model\'s hidden size.') for name in BY_HIDDEN_SIZE},
}


@dataclass(frozen=True)
class ScheduleConfig:
    """Stage 3: when each block's parameters are gathered and how long they stay gathered ([Note: stage-3 gather
    schedule] in lzero/engine/gather.py; the engine runs it as ``lzero.engine.blocks.GatherSchedule``)."""

    schedule: Literal["auto", "min_memory"] = "auto"
    """Stage 3: who sets the gather schedule's knobs (``prefetch``, ``max_reuse_distance``,
    ``param_persistence_threshold``, ``gather_bucket_size``) left at None. "auto": the first two training steps run
    the memory-minimal schedule and measure their peak; from the third step on, the blocks are kept gathered
    (persistent, or across the forward-backward turn) as far as the measured peak plus the extra gathered bytes fits
    the rank's memory budget less ``schedule_margin``: the fewest collectives that fit. "min_memory": every knob left
    at None takes its memory-minimal value (one block prefetched, none kept, none persistent), FSDP's schedule. Knobs
    given explicitly always win. See [Note: choosing the gather schedule] in lzero/engine/schedule.py."""

    schedule_margin: float = 0.1
    """Stage 3, ``schedule="auto"``: the fraction of the memory budget kept free (allocator fragmentation, a longer
    batch later) when the schedule is chosen."""

    prefetch: Optional[int] = None
    """Stage 3: how many units ahead to all-gather while the current one computes (0: none). None: 1 (the
    ``schedule`` does not change it)."""

    prefetch_bucket_size: Union[None, int, Literal["auto"]] = None
    """Stage 3: prefetch by size instead of by count: all-gather the next units while those already gathered
    or launched ahead of the current one hold fewer than this many elements (a unit is never split, so the last
    one may pass the limit; 0: no prefetch). DeepSpeed's ``stage3_prefetch_bucket_size``. None: ``prefetch``
    units ahead. "auto": 0.9*h*h, filled at setup. See [Note: stage-3 gather schedule] in gather.py."""

    max_live_parameters: Optional[int] = None
    """Stage 3: a prefetch, or a unit kept gathered by ``max_reuse_distance``, never takes the gathered
    parameters past this many elements (the unit being computed is always gathered). DeepSpeed's
    ``stage3_max_live_parameters``. None: no limit."""

    max_reuse_distance: Optional[int] = None
    """Stage 3: a unit whose next use is fewer than this many elements away is kept gathered instead of being
    released and gathered again. The distance is counted in the elements of the units used in between: for
    the unit at position k of n in forward, twice the elements of units k+1..n-1 (their forward, then their
    backward), so the last units of forward, which backward needs first, are kept from the second step on
    (the first step records the order). DeepSpeed's ``stage3_max_reuse_distance``. 0: none kept. None: the
    ``schedule`` chooses (``min_memory``: 0)."""

    param_persistence_threshold: Union[None, int, Literal["auto"]] = None
    """Stage 3: a unit of at most this many elements stays gathered from its forward to the end of its
    backward, and is gathered again right after the optimizer step, with the other such units in coalesced
    all-gathers of ``allgather_bucket_size``, so the next forward finds it gathered: many small blocks cost one
    collective per bucket instead of two per block. DeepSpeed's ``stage3_param_persistence_threshold``
    compares each parameter; lzero gathers a unit's parameters in one collective, so it compares the unit
    (small parameters inside a large unit cost no collective of their own). 0: none. "auto": 10*h, filled
    at setup. None: the ``schedule`` chooses (``min_memory``: 0)."""

    gather_bucket_size: Optional[int] = None
    """Stage 3: from the second step on (the first records the order), consecutive units of at most a quarter
    of this many elements each are all-gathered together, in forward and again in backward: one collective (and
    one order check) of at most this many elements per run of units instead of one per unit, which is what a
    model of many small blocks waits on. A run counts as one unit for ``prefetch``, so up to about two runs are
    gathered at once. Units whose parameter shards live in host memory or files, and persistent ones, are
    gathered alone. 0: one all-gather per unit. None: 0 (the ``schedule`` does not choose runs). See [Note: stage-3
    gather schedule] in gather.py."""

    def __post_init__(self) -> None:
        if self.schedule not in ("auto", "min_memory"):
            raise ZeroConfigError(f"`schedule={self.schedule!r}` is not a gather schedule policy. HINT: 'auto' (the"
                                  " fastest that fits the memory budget) or 'min_memory' (FSDP's: every block gathered"
                                  " for its forward and again for its backward).")
        margin = self.schedule_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ZeroConfigError(f"`schedule_margin={margin!r}` must be a fraction in [0, 1). HINT: e.g. 0.1.")
        for name in GATHER_KNOBS:
            value = getattr(self, name)
            if value is not None and not (value == AUTO and name in BY_HIDDEN_SIZE):
                _set_whole(self, name, 0, *_KNOB_WORDS[name])
        if self.prefetch_bucket_size is not None and self.prefetch is not None:
            raise ZeroConfigError(f"`prefetch={self.prefetch}` and `prefetch_bucket_size={self.prefetch_bucket_size}`"
                                  " both say how far to prefetch. HINT: give one of them.")


@dataclass(frozen=True)
class CheckpointConfig:
    """What checkpoints and state dicts hold, and how they are written."""

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

    def __post_init__(self) -> None:
        timeout = self.exception_checkpoint_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ZeroConfigError(
                f"`exception_checkpoint_timeout_s={timeout!r}` must be a number of seconds > 0. HINT: e.g. 30."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ZeroConfigError(
                f"`state_dict_type={self.state_dict_type!r}` is not one of 'sharded', 'full'. HINT: use 'sharded'."
            )
        true_or_false("async_save", self.async_save)
        if self.async_save and self.checkpoint_format != "sharded":
            raise ZeroConfigError("`async_save=True` needs `checkpoint_format='sharded'`: a full checkpoint is gathered"
                                  " onto rank 0. HINT: drop one of the two.")
        if self.checkpoint_format not in ("sharded", "full"):
            raise ZeroConfigError(
                f"`checkpoint_format={self.checkpoint_format!r}` is not one of 'sharded', 'full'."
                " HINT: 'sharded' (a directory per checkpoint) or 'full' (one DDP-format file)."
            )


@dataclass(frozen=True)
class OffloadConfig:
    """Where states live off the device: DeepSpeed's ``offload_optimizer``, ``offload_param`` and ``aio`` blocks."""

    offload_optimizer: Union[OffloadDevice, dict[str, Any], OffloadOptimizer] = "none"
    """Where the fp32 master shards, the shard gradients and the optimizer state live (stages 1-3), as
    DeepSpeed's ``offload_optimizer`` block: a device name ("none", "cpu", "nvme") or
    ``{device: cpu, pin_memory: true, ratio: 1.0}``. See :class:`OffloadOptimizer` for each key."""

    offload_param: Union[OffloadDevice, dict[str, Any], OffloadParam] = "none"
    """Stage 3 only: where the 16-bit parameter shards live between uses, as DeepSpeed's ``offload_param``
    block: "none", "cpu", "nvme" or ``{device: cpu, pin_memory: true}`` (see :class:`OffloadParam`). Each unit's
    shard is copied to the device inside the stage-3 prefetch, before its all-gather."""

    aio: Union[dict[str, Any], AioConfig] = AioConfig()
    """DeepSpeed's ``aio`` block, used by NVMe offload: ``{block_size: 1048576, queue_depth: 8,
    intra_op_parallelism: 1, single_submit: false, overlap_events: true, use_gds: false}``."""

    sub_group_size: int = 1_000_000_000
    """With ``offload_optimizer``: elements the host optimizer steps before it sends the stepped values back
    to the device (and, at stages 1-2, launches their all-gather). Consecutive units are stepped in groups of
    at most this many elements (a larger unit is a group of its own), so smaller groups start the copies back
    earlier. DeepSpeed's key and default (1e9)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload_optimizer", _offload_block("offload_optimizer", self.offload_optimizer,
                                                                     OffloadOptimizer))
        object.__setattr__(self, "offload_param", _offload_block("offload_param", self.offload_param, OffloadParam))
        object.__setattr__(self, "aio", _aio_block(self.aio))
        paths = {b.nvme_path for b in (self.offload_optimizer, self.offload_param)
                 if b.device == "nvme" and b.nvme_path is not None}
        if len(paths) > 1:
            raise ZeroConfigError(
                f"`offload_optimizer.nvme_path` and `offload_param.nvme_path` differ ({sorted(paths)}): lzero keeps one"
                " swap folder per rank. HINT: give both the same path, or set it in one block only."
            )
        _set_positive(self, "sub_group_size")


@dataclass(frozen=True)
class ZeroPlusPlusConfig:
    """Which ranks a collective spans and what it sends: hybrid sharding (MiCS) and ZeRO++ (hpZ, qwZ, qgZ)."""

    shard_group_size: Union[None, int, Literal["node"]] = None
    """Hybrid sharding: the ranks form groups of this many consecutive ranks; states are sharded within a group and
    replicated across groups, and gradients are reduce-scattered within the group, then all-reduced across the groups
    on the shard only. ``"node"``: the ranks of one node (``LOCAL_WORLD_SIZE``). None: one group of every rank (flat
    ZeRO). Memory follows the formulas with G in place of N. DeepSpeed's ``mics_shard_size``. See [Note: hybrid
    sharding] in lzero/engine/mesh.py."""

    hpz_partition_size: Union[int, Literal["node"]] = 1
    """ZeRO++'s hpZ (stage 3): besides the primary shards over every rank, each block keeps a secondary copy of its
    gathered parameters, partitioned over groups of this many consecutive ranks (a node; ``"node"``: the ranks of one
    node, ``LOCAL_WORLD_SIZE``), so that backward's all-gather stays within the group. Costs 1/H of the blocks' parameters per rank in the compute dtype, counted by
    the memory logs and ``lzero estimate``. 1: off. DeepSpeed's ``zero_hpz_partition_size``. See [Note: hpZ] in
    lzero/engine/hpz.py."""

    quantized_weights: bool = False
    """ZeRO++'s qwZ (stage 3): parameter all-gathers send blockwise int8 codes (about 1 byte per element) and every
    rank computes with the dequantized weights; the masters stay exact. Changes results. DeepSpeed's
    ``zero_quantized_weights``. See [Note: quantized collectives] in lzero/engine/quantized_collectives.py."""

    quantized_gradients: Optional[int] = None
    """ZeRO++'s qgZ: gradient reductions as an all-to-all of blockwise int8 (8) or int4 (4) codes, summed in fp32 by
    the receiving rank. None: exact reductions. Changes results. DeepSpeed's ``zero_quantized_gradients`` (its
    ``true`` reads as 4). See [Note: quantized collectives] in lzero/engine/quantized_collectives.py."""

    def __post_init__(self) -> None:
        size = self.shard_group_size
        if size is not None and size != "node" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ZeroConfigError(f"`shard_group_size={size!r}` must be a number of ranks >= 1 or 'node'. HINT: e.g."
                                  " the ranks per node (8), or 'node'.")
        hpz = self.hpz_partition_size
        if hpz != "node" and (isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1):
            raise ZeroConfigError(f"`hpz_partition_size={hpz!r}` must be a number of ranks >= 1 (1: off) or 'node'."
                                  " HINT: the ranks per node, e.g. 8, or 'node'.")
        if self._hpz_on() and size is not None:
            raise ZeroConfigError(f"`hpz_partition_size={hpz!r}` with `shard_group_size={size!r}`: both keep the"
                                  " all-gathers within a node, one by sharding states there, the other by a secondary"
                                  " copy. HINT: choose one.")
        true_or_false("quantized_weights", self.quantized_weights)
        if self.quantized_gradients not in (None, 8, 4) or isinstance(self.quantized_gradients, bool):
            raise ZeroConfigError(f"`quantized_gradients={self.quantized_gradients!r}` is not one of None, 8, 4 (bits"
                                  " per gradient element sent). HINT: 8 (int8) or 4 (int4), or None for exact sums.")

    def _hpz_on(self) -> bool:
        return self.hpz_partition_size == "node" or self.hpz_partition_size > 1


@dataclass(frozen=True)
class ZeroConfig(ZeroPlusPlusConfig, OffloadConfig, CheckpointConfig, ScheduleConfig, ShardingConfig):
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
            _set_positive(self, "train_batch_size")
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


def _offload_block(name: str, value: Any, cls: type) -> Any:
    """``value`` (a device name, a DeepSpeed-style dict, or ``cls``) as a ``cls``, which checks the values; here
    the keys: each must be ``cls``'s, and an NVMe key needs ``device: nvme``."""
    if isinstance(value, str):
        value = {"device": value}
    elif isinstance(value, cls):  # the fields that differ from the defaults, as if written in a block
        value = {f.name: getattr(value, f.name) for f in fields(cls)
                 if f.name == "device" or getattr(value, f.name) != f.default}
    elif not isinstance(value, dict):
        raise ZeroConfigError(
            f"`{name}={value!r}` must be a device name or a block. HINT: `{name}='cpu'` or"
            f" `{name}={{'device': 'cpu', 'pin_memory': True}}`."
        )
    defaults = {f.name: f.default for f in fields(cls)}
    device = value.get("device", "none") or "none"
    for key in value:  # a key at its default says nothing (LightningCLI writes out every key of a block)
        if key in NVME_KEYS and key in defaults and device != "nvme" and value[key] != defaults[key]:
            raise ZeroConfigError(
                f"`{name}.{key}` only applies with `device: nvme` (ZeRO-Infinity); with device {device!r} it would"
                f" be ignored. HINT: remove `{key}`, or use `{name}={{'device': 'nvme', '{key}': ...}}`."
            )
        if key in NVME_KEYS and key not in defaults:
            raise ZeroConfigError(
                f"`{name}.{key}` is not an `{name}` key (DeepSpeed has it in the other offload block). HINT: remove it"
                f" or move it to {'`offload_param`' if name == 'offload_optimizer' else '`offload_optimizer`'}."
            )
        if key not in defaults:
            raise ZeroConfigError(f"Unknown key `{name}.{key}`. HINT: {did_you_mean(key, list(defaults), 'keys')}")
    return cls(**{**defaults, **value})


def _check_offload_values(block: Union[OffloadOptimizer, OffloadParam]) -> None:
    """The values of an offload block, each named as its key in ``ZeroConfig`` (``offload_optimizer.ratio``)."""
    name, device = block.KEY, "none" if block.device is None else block.device
    if device not in ("none", "cpu", "nvme"):
        raise ZeroConfigError(
            f"`{name}.device={device!r}` is not an offload device: without offload the state already lives on the"
            " device the model computes on (the GPU). HINT: use 'none' (keep it there) or 'cpu' (host memory)."
        )
    object.__setattr__(block, "device", device)
    for key in ("pin_memory", "delayed_update", "huge_pages", "pipeline_read", "pipeline_write"):
        if hasattr(block, key):
            true_or_false(f"{name}.{key}", getattr(block, key))
    if isinstance(block, OffloadOptimizer):
        _set_whole(block, "host_threads", 0, label=f"{name}.host_threads", hint="0 divides this host's cores among"
                   " its processes; 8 gives each process 8 threads.")
        ratio = block.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ZeroConfigError(
                f"`{name}.ratio={ratio!r}` must be a fraction in (0, 1]: the share of the optimizer state kept in"
                " host memory. HINT: 1.0 offloads all of it; to offload none, use `device: none`."
            )
        object.__setattr__(block, "ratio", float(ratio))
        if block.delayed_update and (device != "cpu" or block.ratio != 1.0):
            raise ZeroConfigError(
                f"`{name}.delayed_update=True` with `device: {device!r}`, `ratio: {block.ratio!r}`: the delayed update"
                " overlaps the host step of every unit with the next step's forward and backward, so every unit must"
                " be stepped in host memory. HINT: use `{device: cpu, ratio: 1.0, delayed_update: true}` (the"
                " 'zero2_offload' or 'zero3_offload' strategy's block), or drop `delayed_update`."
            )
    for key, least in (("buffer_count", 2), ("buffer_size", 1), ("max_in_cpu", 0)):
        if hasattr(block, key):
            _set_whole(block, key, least, label=f"{name}.{key}")
    if block.nvme_path is not None and not isinstance(block.nvme_path, str):
        raise ZeroConfigError(f"`{name}.nvme_path={block.nvme_path!r}` must be a folder path (a string).")


def _aio_block(value: Any) -> AioConfig:
    """DeepSpeed's ``aio`` block as an :class:`AioConfig`, which checks the values; ``thread_count`` read as
    ``intra_op_parallelism``."""
    if isinstance(value, AioConfig):
        return value
    if not isinstance(value, dict):
        raise ZeroConfigError(f"`aio={value!r}` must be a block. HINT: `aio={{'block_size': 1048576, 'queue_depth': 8}}`.")
    value = dict(value)
    if "thread_count" in value:  # DeepSpeed's older spelling, which DeepSpeed itself now ignores
        threads = value.pop("thread_count")
        if "intra_op_parallelism" in value and value["intra_op_parallelism"] != threads:
            raise ZeroConfigError(
                f"`aio.thread_count={threads!r}` and `aio.intra_op_parallelism={value['intra_op_parallelism']!r}` say"
                " different things (the first is the older name of the second). HINT: keep `intra_op_parallelism`."
            )
        value["intra_op_parallelism"] = threads
    known = [f.name for f in fields(AioConfig)]
    for key in value:
        if key not in known:
            raise ZeroConfigError(f"Unknown key `aio.{key}`. HINT: {did_you_mean(key, known, 'keys')}")
    return AioConfig(**value)


def _check_names(kwargs: dict[str, Any], what: str) -> None:
    """Refuse a keyword that is not a ZeroConfig field, naming the closest one."""
    known = [f.name for f in fields(ZeroConfig)]
    for name in kwargs:
        if name not in known:
            raise ZeroConfigError(f"Unknown {what} `{name}`. HINT: {did_you_mean(name, known, 'options')}")


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
            f"`stage={stage!r}` is not a ZeRO stage. HINT: use stage 1 (optimizer state), 2 (+ gradients)"
            " or 3 (+ parameters); for plain data parallel use `strategy='ddp'`."
        )
    if stage not in BUILT_STAGES:
        raise ZeroConfigError(
            f"`stage={stage}`: ZeRO stage {stage} is not part of lzero (stages: {BUILT_STAGES})."
            " HINT: stage 0 is plain data parallel: use `strategy='ddp'`."
        )


def optional_config(config: Optional[ZeroConfig], **overrides: Any) -> ZeroConfig:
    """The config a strategy runs with: ``config`` (or the defaults) with ``overrides`` applied."""
    base = config if config is not None else ZeroConfig()
    if not isinstance(base, ZeroConfig):
        raise ZeroConfigError(
            f"`config` must be an lzero.ZeroConfig, got {type(base).__name__}. HINT: `ZeroConfig(stage=2)`."
        )
    return base.with_overrides(**{k: v for k, v in overrides.items() if v is not None})
