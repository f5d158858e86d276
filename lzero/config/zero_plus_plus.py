"""ZeroConfig's ZeRO++ section: which ranks a collective spans (hybrid sharding, tensor parallel) and what it sends (hpZ,
qwZ, qgZ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from lzero.config.checks import true_or_false, whole_number
from lzero.errors import ZeroConfigError

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
    self.device_mesh["tensor_parallel"], plan)``). Must divide the world size. Stages 1-2 in fp32, Trainer only, no
    checkpoints yet. 1: off. See [Note: tensor parallel under ZeRO] in lzero/engine/tensor_parallel.py."""

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
        true_or_false("quantized_weights", self.quantized_weights)
        if self.quantized_gradients not in (None, 8, 4) or isinstance(self.quantized_gradients, bool):
            raise ZeroConfigError(f"`quantized_gradients={self.quantized_gradients!r}` is not one of None, 8, 4 (bits"
                                  " per gradient element sent). HINT: 8 (int8) or 4 (int4), or None for exact sums.")

    def _hpz_on(self) -> bool:
        return self.hpz_partition_size == "node" or self.hpz_partition_size > 1
