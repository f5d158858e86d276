"""ZeroConfig's ZeRO++ section: which ranks a collective spans (hybrid sharding, tensor parallel) and what it sends (hpZ,
qwZ, qgZ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from lzero.config.checks import true_or_false, whole_number
from lzero.errors import ZeroConfigError

TP_STYLES = ("colwise", "rowwise")
"""The plan styles lzero applies: torch's ``ColwiseParallel()`` and ``RowwiseParallel()``."""


@dataclass(frozen=True)
class ZeroPlusPlusConfig:
    """Which ranks a collective spans and what it sends: hybrid sharding (MiCS), tensor parallel and ZeRO++ (hpZ, qwZ,
    qgZ)."""

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

    tensor_parallel_size: int = 1
    """Tensor parallel: the ranks form a 2-D mesh, ``world = data x tensor`` with the tensor dimension innermost (rank
    r has tensor coordinate r % T), ``strategy.device_mesh`` has the dimensions ``("data_parallel",
    "tensor_parallel")`` as under Lightning's ``ModelParallelStrategy``, and ZeRO shards over the data-parallel ranks
    only. The model is parallelized by the user's ``configure_model`` (``parallelize_module(...,
    self.device_mesh["tensor_parallel"], plan)``), or by the strategy from ``tp_plan``. Must divide the world size.
    Every stage, offload and hybrid sharding (over the data ranks), sharded checkpoints, both doors (Fabric:
    ``parallelize_fn``); fp32 and bf16-mixed. 1: off.
    See [Note: tensor parallel under ZeRO] in lzero/engine/tensor_parallel.py."""

    tp_plan: Union[None, Literal["auto"], dict[str, str]] = None
    """Tensor parallel without user code: the plan the strategy applies over ``device_mesh["tensor_parallel"]`` right
    after ``configure_model`` (or at setup for a model built in ``__init__``). None: the user's ``configure_model``
    parallelizes. ``"auto"``: each Hugging Face model's own ``config.base_model_tp_plan``, prefixed with its base
    model's path. A dict: module-name patterns of the LightningModule (``*`` matches one path component) to
    ``"colwise"`` or ``"rowwise"`` (torch's ``ColwiseParallel()``/``RowwiseParallel()`` on ``nn.Linear``). Needs
    ``tensor_parallel_size`` > 1. See [Note: the tensor-parallel plan] in lzero/engine/tensor_parallel_plan.py."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_parallel_size", whole_number(
            "tensor_parallel_size", self.tensor_parallel_size, 1, " of ranks",
            "e.g. `tensor_parallel_size=2` (a divisor of the world size), or 1 for no tensor parallel."))
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
        self._check_tp_plan()
        true_or_false("quantized_weights", self.quantized_weights)
        if self.quantized_gradients not in (None, 8, 4) or isinstance(self.quantized_gradients, bool):
            raise ZeroConfigError(f"`quantized_gradients={self.quantized_gradients!r}` is not one of None, 8, 4 (bits"
                                  " per gradient element sent). HINT: 8 (int8) or 4 (int4), or None for exact sums.")

    def _hpz_on(self) -> bool:
        return self.hpz_partition_size == "node" or self.hpz_partition_size > 1

    def _check_tp_plan(self) -> None:
        plan = self.tp_plan
        if plan is None:
            return
        if plan != "auto" and not (isinstance(plan, dict) and plan and all(isinstance(k, str) and isinstance(v, str)
                                                                           for k, v in plan.items())):
            raise ZeroConfigError(f"`tp_plan={plan!r}` is not None, 'auto' or a non-empty dict of module-name patterns to"
                                  " style names. HINT: e.g. `tp_plan={'model.layers.*.mlp.up_proj': 'colwise',"
                                  " 'model.layers.*.mlp.down_proj': 'rowwise'}`, or 'auto' for a Hugging Face model.")
        if self.tensor_parallel_size == 1:
            raise ZeroConfigError(f"`tp_plan={plan!r}` with `tensor_parallel_size=1`: a plan splits modules over the"
                                  " tensor dimension, and there is none. HINT: set `tensor_parallel_size=T` (T > 1),"
                                  " or drop `tp_plan`.")
        if isinstance(plan, dict):
            for pattern, style in plan.items():
                if style not in TP_STYLES:
                    raise ZeroConfigError(
                        f"`tp_plan` style {style!r} for {pattern!r} is not built: lzero applies {list(TP_STYLES)}"
                        " (torch's ColwiseParallel() and RowwiseParallel()). HINT: parallelize with"
                        " `parallelize_module(..., self.device_mesh['tensor_parallel'], plan)` in `configure_model`"
                        " yourself, and leave `tp_plan` None.")
