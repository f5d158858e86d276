"""ZeroConfig's offload section: DeepSpeed's ``offload_optimizer``, ``offload_param`` and ``aio`` blocks, each a
dataclass of its own, and how a block written as a device name or a dict is read into one."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Optional, Union

from lzero.config.checks import did_you_mean, set_positive, set_whole, true_or_false
from lzero.errors import ZeroConfigError

OffloadDevice = Literal["none", "cpu", "nvme"]

NVME_KEYS = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write")
"""DeepSpeed offload keys that only apply with ``device: nvme`` (ZeRO-Infinity)."""


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
            set_whole(self, key, 1, label=f"aio.{key}")
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
        set_positive(self, "sub_group_size")


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
        set_whole(block, "host_threads", 0, label=f"{name}.host_threads", hint="0 divides this host's cores among"
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
            set_whole(block, key, least, label=f"{name}.{key}")
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
