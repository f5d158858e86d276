"""ZeroConfig's sharding section: what is sharded, and the buckets of its collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lzero.config.checks import AUTO, BY_HIDDEN_SIZE, did_you_mean, set_positive, true_or_false
from lzero.errors import ZeroConfigError

OPTIMIZER_PARTITIONS = ("auto", "per_tensor")
"""``optimizer_partition``'s values: see [Note: per-tensor ownership] in lzero/engine/partition.py."""

BUILT_STAGES = (1, 2, 3)
"""Stages this release implements; the others are refused with a clear error."""


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

    optimizer_partition: str = "auto"
    """How an optimizer's state is split across the data-parallel ranks. ``"auto"``: element by element for the
    elementwise optimizers (AdamW, SGD, ...), whole tensors per owning rank for the optimizers that read a whole
    matrix (``torch.optim.Muon``, ``torch.optim.Adafactor``). ``"per_tensor"``: whole tensors for every optimizer,
    so any optimizer that steps each parameter on its own (Shampoo, SOAP, ...) runs as under DDP. See [Note:
    per-tensor ownership] in lzero/engine/partition.py."""

    def __post_init__(self) -> None:
        _check_stage(self.stage)
        if self.optimizer_partition not in OPTIMIZER_PARTITIONS:
            raise ZeroConfigError(
                f"`optimizer_partition={self.optimizer_partition!r}` is not an option: 'auto' (per element, per tensor"
                " for Muon and Adafactor) or 'per_tensor' (whole tensors for every optimizer). HINT:"
                f" {did_you_mean(self.optimizer_partition, OPTIMIZER_PARTITIONS, 'options')}")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "max_inflight_reductions"):
            if getattr(self, name) != AUTO or name not in BY_HIDDEN_SIZE:
                set_positive(self, name)
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
