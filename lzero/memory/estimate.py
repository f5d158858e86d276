"""Model-state memory of one rank before a run: what each strategy keeps on the device, in host memory and
on NVMe, by kind, in the same ``{store: {kind: bytes}}`` form that :func:`lzero.memory.accounting.model_state_bytes`
measures. Pure arithmetic: nothing is allocated.

Symbols: Ψ trainable parameters, F frozen ones, N = num_gpus x num_nodes (the data-parallel world), c the
compute dtype's bytes (4 under ``32-true``, 2 under ``bf16-mixed``/``16-mixed``), O the optimizer's state
bytes per parameter (Adam's two fp32 moments: 8), K = O + 4 under mixed precision (the fp32 master), K = O
under ``32-true`` (the master is the parameter itself). Stores: ``device``, ``cpu`` (host memory), ``nvme``.

[Note: lzero's layout]
What lzero allocates (flat_unit.py, store.py, placement.py), per rank, with every gradient present (from a
backward to its step; between steps the gradient terms are absent, see [Note: gradient buffers]):

| strategy | device | host | nvme |
|---|---|---|---|
| ddp (Lightning's DDP) | (8 + O)Ψ + 4F | | |
| zero1 | 2cΨ + cF + (4 + K)Ψ/N mixed, 8Ψ + 4F + 8Ψ/N fp32 | | |
| zero2 | cΨ + cF + (4 + K)Ψ/N | | |
| zero3 | (c + 4 + K)Ψ/N + cF/N | | |
| zero2_offload | cΨ + cF | (8 + O)Ψ/N | |
| zero3_offload | | (c + 4 + K)Ψ/N + cF/N | |
| zero3_offload_nvme | | 4Ψ/N + c·min((Ψ+F)/N, max_in_cpu) | (4 + O)Ψ/N + c·rest |

- Gradients: a stage-1 unit accumulates in a full flat gradient of the compute dtype (cΨ); the reduced shard
  is a separate fp32 tensor (4Ψ/N) except in fp32 on the device, where it is a view of the flat gradient.
  Stages 2-3 keep only the fp32 shard gradient (4Ψ/N). The ZeRO paper counts 16-bit gradients (2Ψ/N), so
  under mixed precision lzero holds 2Ψ/N more than the paper at stages 2-3, and at stage 1 2Ψ/N more (its
  fp32 shard gradient beside the full 16-bit one).
- Masters: fp32 shards (4Ψ/N) in the optimizer's store; in fp32 on the device at stages 1-2 they are the
  parameters' own slice, and at stage 3 (device or host alike) the parameter shard itself, counted once as
  parameters (so fp32 zero3_offload holds 16Ψ/N in host memory, mixed precision 18Ψ/N).
- Offload: ``offload_optimizer`` moves shard gradients, masters and optimizer state to host memory (NVMe:
  masters and optimizer state to files, gradients stay in host memory); the stage-1/2 parameters stay on the
  device in the compute dtype. ``offload_param`` moves the stage-3 parameter shards (NVMe: past
  ``max_in_cpu`` elements per rank, to files). ``ratio`` < 1 keeps the first ``1 - ratio`` of the elements'
  optimizer side (gradients, masters, state) on the device.
- Frozen parameters: stages 1-2 leave them as module parameters in the compute dtype; stage 3 shards them in
  the parameter store (cF/N). Q of them quantized (a QLoRA base) take their codes' bytes instead (b·Q, b·Q/N at
  stage 3: b = 1/2 at 4 bits, 1 at 8) and their quantization state whole on every rank, on the device (s·Q:
  ``QUANTIZED_BYTES``).
- Flat units are padded to a multiple of N elements; the estimate leaves the padding out.

[Note: working set]
``buffers=True`` adds, as kind ``buffers``, what lzero holds besides the model states, with the
``ZeroConfig`` defaults (``reduce_bucket_size`` 5e6 elements, ``max_inflight_reductions`` 2, ``prefetch`` 1,
NVMe ``buffer_count`` 4 units and parameter ``buffer_count`` 5):

- ddp: torch's gradient buckets, a copy of every gradient (4Ψ; ``gradient_as_bucket_view=False``, the default).
- stages 1-2: ``max_inflight_reductions`` reduce buckets of one unit in the fp32 reduce dtype: 2 x 4U, where U
  is the largest stage-1/2 unit, max(``reduce_bucket_size``, the largest parameter), at most Ψ.
- stage 3: the gathered root unit and the gathered blocks in the compute dtype, c(R + gB), plus the reduce
  buckets, 2 x 4B (B: the largest block, R: the parameters outside blocks; both known only from a model,
  otherwise taken as ``reduce_bucket_size`` each). g follows the gather schedule ([Note: stage-3 gather
  schedule] in gather.py), counting every block as B: the computing block and those prefetched ahead (``prefetch``,
  or ceil(``prefetch_bucket_size`` / B)), or the blocks kept across the forward-backward turn (ceil(
  ``max_reuse_distance`` / 2B)), whichever is more, each within ``max_live_parameters``; every block when
  ``param_persistence_threshold`` >= B (all persistent); 2 with the defaults. With ``gather_bucket_size`` >= 4B,
  runs of floor(``gather_bucket_size`` / B) blocks are gathered together: the computing run and those prefetched
  ahead, plus one run in the staging buffer of its all-gather.
- an offload store: the outgoing compute-dtype copy of every offloaded master, cΨ/N in host memory (page-locked
  on a GPU), which the publish casts into and uploads from; none where the host casts straight into stage-3
  parameter shards kept in host memory, unless the delayed update's worker casts ahead (a CPU model without the
  delayed update holds none either: there the cast writes the parameters). The fp32 shard gradients are model
  states (4Ψ/N, persistent: [Note: persistent host buffers]). NVMe adds the ``buffer_count`` resident units
  (4 x (4 + O)U/N) and, when parameters are in files, 5 parameter read buffers (5 x c·min(``buffer_size``, U/N)).
Activations, the allocator's caching and the CUDA context are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from torch import nn

from lzero.config import AUTO, ZeroConfig
from lzero.engine.mesh import local_world_size
from lzero.errors import ZeroError
from lzero.offload.store import KINDS

GB = 1e9
"""Bytes per GB, as the ZeRO paper counts (printed figures are GB, not GiB)."""

STORES = ("device", "cpu", "nvme")

COMPUTE_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
"""Bytes of a parameter in the dtype the model computes in, per Lightning precision string."""

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_nvme")
"""The rows of an estimate, in order of increasing communication."""

ADAM_BYTES = 8
"""Optimizer state bytes per parameter of Adam/AdamW: two fp32 moments."""


class EstimateError(ZeroError, ValueError):
    """An input the estimate cannot use; the message names the value and the fix."""


QUANTIZED_BYTES = {"4bit": (0.5, 4 / 64), "4bit-dq": (0.5, 1 / 64 + 4 / (64 * 256)), "int8": (1.0, 4 / 4096)}
"""A quantized weight's bytes: (codes, sharded at stage 3; its state, whole on every rank). 4-bit: two codes a byte
and one fp32 absmax per 64 weights; double quantization: one byte per 64 weights, and one fp32 per 256 of those;
int8: one byte a weight and one fp32 scale per row (rows of 4096 taken). See [Note: packed parameters]."""


@dataclass(frozen=True)
class ModelCount:
    """The parameter counts an estimate needs."""

    trainable: int
    """Ψ: elements of the parameters that require gradients."""

    frozen: int = 0
    """F: elements of the parameters that do not."""

    largest_param: Optional[int] = None
    """Elements of the largest single parameter (a stage-1/2 unit may exceed ``reduce_bucket_size`` by it)."""

    largest_block: Optional[int] = None
    """Elements of the largest stage-3 block unit (a transformer block). None: unknown."""

    root: Optional[int] = None
    """Elements outside every stage-3 block (the root unit, gathered for the whole forward). None: unknown."""

    quantized: int = 0
    """Q: the elements of F that are quantized weights (a QLoRA base), counted before packing."""

    quantization: str = "4bit-dq"
    """How the Q weights are stored: a key of :data:`QUANTIZED_BYTES`."""

    blocks: Optional[tuple[int, ...]] = None
    """Elements of each stage-3 block, in the model's order (what ``schedule="auto"`` plans over). None: unknown."""

    tensor_sharded: int = 0
    """Of Ψ, the elements a tensor-parallel plan splits over the tensor ranks (column-wise weights and biases,
    row-wise weights); the rest is whole on every tensor rank. See :meth:`per_tensor_rank`."""

    def per_tensor_rank(self, tensor_parallel_size: int) -> "ModelCount":
        """What one tensor rank holds (its local tensors: the split elements over T, the rest whole), which ZeRO then
        shards over the data-parallel ranks ([Note: tensor parallel under ZeRO] in lzero/engine/tensor_parallel.py).
        Block sizes are not split (unknown per block): a stage-3 schedule from this count is conservative."""
        if tensor_parallel_size == 1:
            return self
        local = self.trainable - self.tensor_sharded + math.ceil(self.tensor_sharded / tensor_parallel_size)
        return replace(self, trainable=local, tensor_sharded=0)

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZED_BYTES:
            raise EstimateError(f"`quantization={self.quantization!r}` is not one of {sorted(QUANTIZED_BYTES)}."
                                " HINT: 4bit (nf4/fp4), 4bit-dq (with double quantization) or int8 (LLM.int8).")
        for name in ("trainable", "frozen", "largest_param", "largest_block", "root", "quantized", "tensor_sharded"):
            value = getattr(self, name)
            if value is None and name not in ("trainable", "frozen", "quantized", "tensor_sharded"):
                continue
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, value := int(value))
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise EstimateError(f"`{name}={value!r}` must be a whole number of parameters >= 0."
                                    " HINT: e.g. 7.5e9 for 7.5 billion.")
        if self.quantized > self.frozen:
            raise EstimateError(f"`quantized={self.quantized}` exceeds the frozen parameters ({self.frozen}): a"
                                " quantized base is frozen. HINT: give the frozen count with --frozen-params.")
        if self.trainable == 0:
            raise EstimateError("`trainable=0`: there is nothing to train, so nothing to estimate."
                                " HINT: give the number of trainable parameters, e.g. `--params 7.5e9`.")
        if self.tensor_sharded > self.trainable:
            raise EstimateError(f"`tensor_sharded={self.tensor_sharded}` exceeds the trainable parameters"
                                f" ({self.trainable}). HINT: give at most --params with --tensor-sharded-params.")


@dataclass(frozen=True)
class Estimate:
    """One strategy's model-state bytes per rank (``per_rank``: ``{store: {kind: bytes}}``) and per node."""

    strategy: str
    per_rank: dict[str, dict[str, int]]
    ranks_per_node: int
    paper_bytes: Optional[int] = None
    """The ZeRO paper's per-device formula (16-bit gradients, no buffers); None for the offload rows."""

    def store_bytes(self, store: str) -> int:
        return sum(self.per_rank.get(store, {}).values())

    @property
    def per_device(self) -> int:
        return self.store_bytes("device")

    @property
    def per_host(self) -> int:
        """Host memory of one node: every local rank's share."""
        return self.store_bytes("cpu") * self.ranks_per_node

    @property
    def per_nvme(self) -> int:
        """Swap-file bytes of one node (every local rank's folder, on one disk)."""
        return self.store_bytes("nvme") * self.ranks_per_node

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "per_device_bytes": self.per_device, "per_host_bytes": self.per_host,
                "per_nvme_bytes": self.per_nvme, "paper_per_device_bytes": self.paper_bytes,
                "per_rank": self.per_rank}


@dataclass
class _Bytes:
    """``{store: {kind: bytes}}`` being summed."""

    table: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, store: str, kind: str, nbytes: float) -> None:
        if nbytes:
            self.table.setdefault(store, dict.fromkeys(KINDS, 0.0))[kind] += nbytes

    def rounded(self) -> dict[str, dict[str, int]]:
        return {store: {kind: round(v) for kind, v in kinds.items()} for store, kinds in self.table.items()}


def check_precision(precision: str) -> int:
    """The compute dtype's bytes of ``precision``, or an error naming the choices."""
    if precision not in COMPUTE_BYTES:
        raise EstimateError(f"Unknown precision {precision!r}. HINT: use one of {', '.join(COMPUTE_BYTES)}.")
    return COMPUTE_BYTES[precision]


def model_states(config: ZeroConfig, count: ModelCount, world_size: int, precision: str = "bf16-mixed",
                 optimizer_bytes: float = ADAM_BYTES, secondary: Optional[float] = None) -> dict[str, dict[str, int]]:
    """One rank's model states under ``config`` (see [Note: lzero's layout]), every gradient present.
    ``secondary``: with hpZ, the elements of its node-local copy this rank holds (1/H of the blocks' parameters,
    padded; default: 1/H of the whole model), in the compute dtype ([Note: hpZ] in lzero/engine/hpz.py)."""
    c, mixed = check_precision(precision), precision != "32-true"
    out = _Bytes()
    psi, frozen, n, stage = count.trainable, count.frozen, world_size, config.stage
    opt, param = config.offload_optimizer, config.offload_param
    offloaded = opt.ratio if opt.device != "none" else 0.0
    host_store = "nvme" if opt.device == "nvme" else "cpu"
    param_store = {"none": "device", "cpu": "cpu", "nvme": "nvme"}[param.device]
    codes, state = QUANTIZED_BYTES[count.quantization]
    quantized, frozen = count.quantized, frozen - count.quantized
    out.add("device", "parameters", state * quantized)  # a quantized base's state: whole on every rank
    if stage < 3:
        out.add("device", "parameters", c * (psi + frozen) + codes * quantized)
        if stage == 1:
            out.add("device", "gradients", c * psi)
    else:
        _stage3_parameters(out, param_store, codes, quantized / n, param.max_in_cpu)
        _stage3_parameters(out, param_store, c, frozen / n, param.max_in_cpu)
        hpz = config.hpz_partition_size
        if hpz == "node":
            hpz = local_world_size(n)
        if secondary is not None:
            out.add("device", "parameters", c * secondary)
        elif 1 < hpz < n:
            out.add("device", "parameters", c * (psi + frozen + quantized) / hpz)
    for share, store in ((1.0 - offloaded, "device"), (offloaded, host_store)):
        elements = share * psi / n
        memory = "cpu" if store == "nvme" else store  # NVMe keeps gradients in host memory
        if stage >= 2 or store != "device" or mixed:  # stage 1, fp32, device: a view of the flat gradient
            out.add(memory, "gradients", 4 * elements)
        if store != "device" and opt.delayed_update:  # the step in flight keeps the previous step's gradient
            out.add(memory, "gradients", 4 * elements)
        out.add(store, "optimizer_state", optimizer_bytes * elements)
        if stage < 3:
            if mixed or store != "device":  # fp32 on the device: the master is the parameters' own slice
                out.add(store, "masters", 4 * elements)
        elif not mixed and store == param_store and store != "nvme":  # the parameter shard is the master
            out.add(store, "parameters", 4 * elements)
        else:
            _stage3_parameters(out, param_store, c, elements, param.max_in_cpu)
            out.add(store, "masters", 4 * elements)
    return out.rounded()


def _stage3_parameters(out: _Bytes, store: str, c: int, elements: float, max_in_cpu: int) -> None:
    """Stage-3 compute-dtype parameter shards of ``elements`` per rank. NVMe keeps shards in host memory
    until the rank holds ``max_in_cpu`` elements there (lzero fills it unit by unit; this counts frozen, then
    trainable elements, without unit granularity), the rest in files."""
    if store != "nvme":
        out.add(store, "parameters", c * elements)
        return
    in_cpu = min(elements, max(0.0, max_in_cpu - out.table.get("cpu", {}).get("parameters", 0.0) / c))
    out.add("cpu", "parameters", c * in_cpu)
    out.add("nvme", "parameters", c * (elements - in_cpu))


def ddp_states(count: ModelCount, optimizer_bytes: float = ADAM_BYTES) -> dict[str, dict[str, int]]:
    """Lightning's DDP: fp32 parameters and gradients under every precision listed (``*-mixed`` is
    autocast), the optimizer state, all on the device."""
    out = _Bytes()
    codes, state = QUANTIZED_BYTES[count.quantization]
    out.add("device", "parameters", 4 * (count.trainable + count.frozen - count.quantized)
            + (codes + state) * count.quantized)
    out.add("device", "gradients", 4 * count.trainable)
    out.add("device", "optimizer_state", optimizer_bytes * count.trainable)
    return out.rounded()


def paper_bytes(stage: int, count: ModelCount, world_size: int, precision: str = "bf16-mixed",
                optimizer_bytes: float = ADAM_BYTES) -> int:
    """The ZeRO paper's per-device model states (stage 0: DDP): 16-bit gradients, K = O (+ 4 mixed);
    mixed-precision Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N. Frozen parameters add cF (cF/N at stage 3)."""
    c = check_precision(precision)
    k = optimizer_bytes + (4 if precision != "32-true" else 0)
    psi, n = count.trainable, world_size
    formula = {0: (2 * c + k) * psi, 1: 2 * c * psi + k * psi / n, 2: c * psi + (c + k) * psi / n,
               3: (2 * c + k) * psi / n}[stage]
    return round(formula + c * count.frozen / (n if stage == 3 else 1))


def gathered_blocks(config: ZeroConfig, root: float, block: float, psi: float) -> int:
    """Stage 3: how many blocks of ``block`` elements are gathered at once (see [Note: working set]), under the
    knobs as given (those left to ``schedule`` at their memory-minimal values)."""
    from lzero.engine.blocks import GatherSchedule

    if block <= 0:
        return 1
    schedule = GatherSchedule.of(config)
    blocks = max(1, math.ceil((psi - root) / block))
    if schedule.param_persistence_threshold != AUTO and schedule.param_persistence_threshold >= block:
        return blocks
    live = schedule.max_live_parameters

    def within_live(n: int) -> int:  # the computing block always; more only while root + n blocks fit
        return n if live is None else max(1, min(n, int((live - root) // block)))

    by_size = schedule.prefetch_bucket_size
    ahead = schedule.prefetch if by_size in (None, AUTO) else math.ceil(by_size / block)
    kept = math.ceil(schedule.max_reuse_distance / (2 * block))
    run = int(schedule.gather_bucket_size // block) if 4 * block <= schedule.gather_bucket_size else 1
    if run > 1:  # runs of blocks gathered together: the computing run, the runs ahead, and one run's staging buffer
        return min(blocks, max(run + within_live(run * (1 + ahead)), within_live(kept) if kept else 1))
    return min(blocks, max(within_live(1 + ahead), within_live(kept) if kept else 1))


def working_set(config: ZeroConfig, count: ModelCount, world_size: int, precision: str = "bf16-mixed",
                optimizer_bytes: float = ADAM_BYTES) -> dict[str, int]:
    """Bytes per store that lzero's buckets, gathers and staging hold (see [Note: working set])."""
    c, n = check_precision(precision), world_size
    psi = count.trainable + count.frozen
    fallback = min(config.reduce_bucket_size, psi)
    if config.stage < 3:
        unit = min(max(config.reduce_bucket_size, count.largest_param or 0), psi)
        out = {"device": config.max_inflight_reductions * 4 * unit}
    else:
        unit = count.largest_block if count.largest_block is not None else fallback
        root = count.root if count.root is not None else fallback
        blocks = gathered_blocks(config, root, unit, psi)
        out = {"device": c * (root + blocks * unit) + config.max_inflight_reductions * 4 * unit}
    shard = unit / n
    host = 0.0
    opt, param = config.offload_optimizer, config.offload_param
    if opt.device != "none":  # the outgoing compute-dtype copies of the stepped masters ([Note: host store copies])
        into_shards = config.stage == 3 and param.device != "none"  # the host casts straight into host shards
        if not into_shards or opt.delayed_update:
            host += c * opt.ratio * count.trainable / n
    if "nvme" in (opt.device, param.device):
        if config.offload_optimizer.device == "nvme":
            host += config.offload_optimizer.buffer_count * (4 + optimizer_bytes) * shard
        if config.offload_param.device == "nvme" and psi / n > config.offload_param.max_in_cpu:
            host += config.offload_param.buffer_count * c * min(config.offload_param.buffer_size, shard)
    if host:
        out["cpu"] = host
    return {store: round(v) for store, v in out.items()}


def estimate(count: ModelCount, num_gpus: int = 1, num_nodes: int = 1, precision: str = "bf16-mixed",
             optimizer_bytes: float = ADAM_BYTES, buffers: bool = False, offload_ratio: float = 1.0,
             max_in_cpu: Optional[int] = None, strategies: Sequence[str] = STRATEGIES,
             shard_group_size: Optional[int] = None, hpz_partition_size: Optional[int] = None,
             tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[Estimate]:
    """One :class:`Estimate` per strategy (``STRATEGIES``) for ``num_gpus`` ranks on each of ``num_nodes``
    nodes. ``offload_ratio`` and ``max_in_cpu`` apply to the offload rows (``OffloadOptimizer.ratio``,
    ``OffloadParam.max_in_cpu``; None: its default). ``shard_group_size``: hybrid sharding, the zero rows shard over
    groups of this many ranks (G in place of N; see [Note: hybrid sharding] in lzero/engine/mesh.py).
    ``hpz_partition_size``: adds a ``zero3_hpz`` row after zero3's, with hpZ's secondary copy of 1/H of the model per
    rank (see [Note: hpZ] in lzero/engine/hpz.py). ``tensor_parallel_size``: T tensor ranks split
    ``count.tensor_sharded`` (:meth:`ModelCount.per_tensor_rank`) and every row's data parallel runs over N / T ranks
    (the ddp row: tensor parallel x DDP). ``pipeline_parallel_size``: ``count`` is one pipeline stage's, its data
    parallel over N / (P x T) ranks."""
    from lzero.presets import PRESET_CONFIGS

    for name, value in (("num_gpus", num_gpus), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")
            raise EstimateError(f"`{name}={value!r}` must be a whole number >= 1. HINT: e.g. `{flag} 8`.")
    if isinstance(optimizer_bytes, bool) or not isinstance(optimizer_bytes, (int, float)) or optimizer_bytes < 0:
        raise EstimateError(f"`optimizer_bytes={optimizer_bytes!r}` must be a number >= 0 of bytes per parameter."
                            " HINT: Adam 8, SGD with momentum 4, plain SGD 0.")
    check_precision(precision)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise EstimateError(f"Unknown strategies {unknown}. HINT: use some of {', '.join(STRATEGIES)}.")
    world = num_gpus * num_nodes
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise EstimateError(f"`tensor_parallel_size={tensor_parallel_size!r}` must divide the world size {world}."
                            f" HINT: e.g. `--tensor-parallel {min(num_gpus, 8)}` (within a node).")
    if world % (tensor_parallel_size * pipeline_parallel_size):
        raise EstimateError(f"`pipeline_parallel_size={pipeline_parallel_size}` x `tensor_parallel_size="
                            f"{tensor_parallel_size}` must divide the world size {world}. HINT: e.g."
                            f" `--pipeline-parallel 2` with `--num-gpus {2 * tensor_parallel_size}`.")
    count = count.per_tensor_rank(tensor_parallel_size)
    world //= tensor_parallel_size * pipeline_parallel_size  # the data-parallel ranks
    if shard_group_size is not None and (isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int)
                                         or shard_group_size < 1 or world % shard_group_size):
        raise EstimateError(f"`shard_group_size={shard_group_size!r}` must divide the world size {world}. HINT: e.g."
                            f" `--shard-group-size {num_gpus}` (one node per group).")
    if hpz_partition_size is not None and (isinstance(hpz_partition_size, bool) or not isinstance(
            hpz_partition_size, int) or hpz_partition_size < 2 or world % hpz_partition_size or shard_group_size):
        raise EstimateError(f"`hpz_partition_size={hpz_partition_size!r}` must be a divisor >= 2 of the world size"
                            f" {world}, without `shard_group_size`. HINT: e.g. `--hpz-partition-size {num_gpus}` (the"
                            " ranks per node).")
    if hpz_partition_size is not None and "zero3" in strategies:
        at = list(strategies).index("zero3") + 1
        strategies = [*strategies[:at], "zero3_hpz", *strategies[at:]]
    sharded_over = shard_group_size or world  # the ranks a zero row's states are divided among
    rows = []
    for name in strategies:
        if shard_group_size is not None and name == "zero3_offload_nvme":
            continue  # refused with hybrid sharding (ZeroConfig)
        if name == "ddp":
            per_rank = ddp_states(count, optimizer_bytes)
            extra = {"device": round(4 * count.trainable)} if buffers else {}
            paper = paper_bytes(0, count, world, precision, optimizer_bytes)
        else:
            config = preset_config(PRESET_CONFIGS[name.removesuffix("_hpz")], offload_ratio, max_in_cpu)
            if name == "zero3_hpz":
                config = replace(config, hpz_partition_size=hpz_partition_size)
            per_rank = model_states(config, count, sharded_over, precision, optimizer_bytes)
            extra = working_set(config, count, sharded_over, precision, optimizer_bytes) if buffers else {}
            offloaded = config.offload_optimizer.device != "none"
            paper = None if offloaded or name == "zero3_hpz" else paper_bytes(config.stage, count, sharded_over, precision, optimizer_bytes)
        for store, nbytes in extra.items():
            per_rank.setdefault(store, dict.fromkeys(KINDS, 0))["buffers"] += nbytes
        rows.append(Estimate(name, per_rank, num_gpus, paper))
    return rows


def preset_config(preset: dict, offload_ratio: float, max_in_cpu: Optional[int]) -> ZeroConfig:
    """The preset's ZeroConfig with the ratio and ``max_in_cpu`` asked for (a ZeroConfigError names bad ones)."""
    values = dict(preset)
    if values.get("offload_optimizer", "none") != "none":
        values["offload_optimizer"] = {"device": values["offload_optimizer"], "ratio": offload_ratio}
    if values.get("offload_param") == "nvme" and max_in_cpu is not None:
        values["offload_param"] = {"device": "nvme", "max_in_cpu": max_in_cpu}
    return ZeroConfig(**values)


def count_parameters(module: nn.Module, unit_modules: Optional[Sequence[str]] = None,
                     tensor_plan: Optional[dict[str, str]] = None) -> ModelCount:
    """Ψ, F and the unit sizes of ``module`` (tied weights counted once); works on the meta device. ``tensor_plan``:
    module names to ``"colwise"``/``"rowwise"`` (a resolved ``tp_plan``): the trainable elements it splits
    (``ModelCount.tensor_sharded``: column-wise weights and biases, row-wise weights)."""
    from lzero.engine.units import ROOT, find_blocks, label_parameters

    params = dict(module.named_parameters())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    per_unit: dict[str, int] = {}
    for name, label in label_parameters(module, find_blocks(module, unit_modules)).items():
        per_unit[label] = per_unit.get(label, 0) + params[name].numel()
    root = per_unit.pop(ROOT, 0)
    modules = dict(module.named_modules())
    split = {id(p) for name, style in (tensor_plan or {}).items()
             for key, p in modules[name].named_parameters(recurse=False)
             if p.requires_grad and (style == "colwise" or key == "weight")}
    return ModelCount(trainable, frozen, largest_param=max((p.numel() for p in params.values()), default=0),
                      largest_block=max(per_unit.values(), default=0), root=root, blocks=tuple(per_unit.values()),
                      tensor_sharded=sum(p.numel() for p in params.values() if id(p) in split))


def auto_schedule(count: ModelCount, world_size: int, free_bytes: int, precision: str = "bf16-mixed",
                  activations: int = 0, optimizer_bytes: float = ADAM_BYTES,
                  config: Optional[ZeroConfig] = None) -> dict:
    """What stage 3's ``schedule="auto"`` would choose on a device with ``free_bytes`` per rank, the first steps'
    peak taken as the model states, lzero's working set and ``activations`` (at run time it is measured: [Note:
    choosing the gather schedule] in lzero/engine/schedule.py). Needs the blocks' sizes (a model)."""
    from lzero.engine.blocks import SCHEDULED, GatherSchedule
    from lzero.engine.schedule import describe, extra_elements, plan

    config = config if config is not None else ZeroConfig(stage=3)
    if count.blocks is None:
        raise EstimateError("The gather schedule is planned over the model's blocks, whose sizes a parameter count"
                            " does not give. HINT: pass `--model package.module:Class` with `--free-memory`.")
    c, sizes, root = check_precision(precision), list(count.blocks), count.root or 0
    first = GatherSchedule.of(config)
    states = sum(model_states(config, count, world_size, precision, optimizer_bytes).get("device", {}).values())
    baseline = states + working_set(config, count, world_size, precision, optimizer_bytes).get("device", 0) \
        + activations
    headroom = (1 - config.schedule_margin) * free_bytes - baseline
    fixed = [k for k in SCHEDULED if getattr(config, k) is not None]
    coalesced = config.offload_param.device == "none"
    chosen = first if headroom < 0 or config.schedule != "auto" else \
        plan(sizes, root, int(headroom // c), first, fixed, config.allgather_bucket_size, coalesced)
    return {**describe(sizes, root, first, chosen, config.allgather_bucket_size, coalesced),
            "baseline_bytes": round(baseline),
            "predicted_peak_bytes": round(baseline + c * extra_elements(sizes, root, first, chosen)),
            "budget_bytes": free_bytes, "margin": config.schedule_margin}


def deepspeed_estimator(stage: int, total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                        largest_layer_params: float = 0, buffer_factor: float = 1.5) -> list[dict]:
    """DeepSpeed's own estimate (``estimate_zero2_model_states_mem_needs_all_cold`` /
    ``estimate_zero3_..._all_cold``, DeepSpeed 0.19), re-derived from its documented per-parameter counts, for
    comparison with lzero's: one row per option it prints, ``{"options", "per_gpu", "per_cpu"}`` in bytes.

    DeepSpeed counts 18 bytes per parameter of sharded states (16-bit and fp32 gradients, fp32 masters, Adam), 2 of
    16-bit parameters, 4 bytes of the largest layer at stage 3, and host memory with a 1.5 buffer factor; its
    "cold" variant assumes the worst case of the model's construction (``zero_init`` on or off at stage 3)."""
    gpus = num_gpus_per_node * num_nodes
    rows = []
    if stage == 2:
        rows.append({"options": "offload_optimizer=cpu", "per_gpu": 2 * total_params,
                     "per_cpu": total_params * max(4 * gpus, 16) * buffer_factor})
        rows.append({"options": "offload_optimizer=none", "per_gpu": 2 * total_params + int(18 * total_params / gpus),
                     "per_cpu": total_params * 4 * num_gpus_per_node * buffer_factor})
    elif stage == 3:
        layer, per_node = 4 * largest_layer_params, 1 / num_nodes
        for params_off, opt_off in ((True, True), (False, True), (False, False)):
            for zero_init in (True, False):
                if opt_off and params_off:
                    gpu = layer
                    cpu = total_params * (18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node))
                elif opt_off:
                    gpu = layer + int(2 * total_params / gpus)
                    cpu = total_params * (16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node))
                else:
                    gpu = layer + int(18 * total_params / gpus)
                    cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node
                rows.append({"options": f"offload_param={'cpu' if params_off else 'none'}, offload_optimizer="
                                        f"{'cpu' if opt_off else 'none'}, zero_init={int(zero_init)}",
                             "per_gpu": gpu, "per_cpu": cpu * buffer_factor})
    else:
        raise EstimateError(f"DeepSpeed's estimator covers stages 2 and 3, not {stage!r}.")
    return [{**r, "per_gpu": int(r["per_gpu"]), "per_cpu": int(r["per_cpu"])} for r in rows]
