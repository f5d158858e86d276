"""What one rank holds of a model and its optimizers, as a checkpoint sees it: the owned pieces of
each parameter, and the optimizers' param groups.

[Note: owned pieces]
A unit's flat buffer concatenates its parameters (then padding); rank r owns the slice
``shard_range(r)`` of it. ``UnitSpec.owned_pieces(r)`` names, for every parameter that overlaps that
slice, the elements ``[a, b)`` of the flattened parameter that the rank owns and where they start in
its shard (``s``). Checkpoints are keyed by parameter, never by unit, so that the partition (world
size, stage, bucket size) may change between save and load: every save cuts a shard into these
pieces (:func:`shard_pieces`) and every load assembles a shard from them (:func:`fill_shard`),
whether the pieces come from a full tensor, a sharded checkpoint or a fp32 master.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    from lzero.engine.engine import ZeroEngine
    from lzero.engine.flat_unit import FlatUnit
    from lzero.engine.partition import ParamSpec


class ShardedOptimizer(Protocol):
    """What checkpoints read of a :class:`lzero.ZeroOptimizer` (named here, not imported, so that the
    optimizer can build its ``state_dict`` from this package without an import circle)."""

    engine: "ZeroEngine"
    units: list["FlatUnit"]
    param_groups: list[dict[str, Any]]

    def shard_optimizer(self, unit: "FlatUnit") -> Optimizer: ...

    def owned_tensors(self, unit: "FlatUnit") -> list[Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def fill_shard(shard: Tensor, unit: "FlatUnit", fetch: Callable[["ParamSpec", int, int], Tensor]) -> Tensor:
    """Write into ``shard`` (1D: this rank's shard of ``unit``, or a tensor of its shape) the elements
    this rank owns of each parameter: ``fetch(spec, a, b)`` returns elements ``[a, b)`` of the
    flattened parameter (the whole one under tensor parallel: a local range is read as its runs, see [Note:
    tensor-parallel checkpoints] in lzero/engine/tensor_layout.py), or None to keep the elements there. Padding is
    left as it is. See [Note: owned pieces]."""
    for spec, a, b, s in unit.spec.owned_runs(unit.rank):
        value = fetch(spec, a, b)
        if value is not None:
            shard[s : s + (b - a)].copy_(value)
    return shard


def shard_pieces(unit: "FlatUnit", shard: Tensor) -> Iterator[tuple["ParamSpec", int, int, Tensor]]:
    """The reverse of :func:`fill_shard`: (parameter, a, b, elements [a, b) of that flattened parameter
    as a view of ``shard``) for every piece this rank owns. See [Note: owned pieces]."""
    for spec, a, b, s in unit.spec.owned_pieces(unit.rank):
        yield spec, a, b, shard[s : s + (b - a)]


def tensor_state_value(key: str, value: Any, like: Tensor) -> Any:
    """A saved state entry of a whole tensor as its optimizer holds it: as ``torch.optim.Optimizer.load_state_dict``
    casts, a floating tensor to the parameter's device and dtype, ``step`` kept as saved (on the device)."""
    if not isinstance(value, Tensor):
        return value
    if key == "step" or not value.is_floating_point():
        return value.to(like.device, copy=True)
    return value.to(like.device, like.dtype, copy=True)


def pack_param_groups(zopt: ShardedOptimizer, param_id: Callable[[Tensor], Any]) -> list[dict[str, Any]]:
    """Every group's hyperparameters, and its parameters as ``param_id(p)`` (torch's index, or a name)."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [param_id(p) for p in g["params"]]}
            for g in zopt.param_groups]


def restore_param_groups(zopt: ShardedOptimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Make every group's hyperparameters those of the checkpoint, keeping its parameters.

    The group is cleared first, so that it ends up exactly as saved, as ``torch.optim.Optimizer.
    load_state_dict`` (what DDP resumes with) replaces each group by the saved one: a key that only
    the current group has (a scheduler or a callback added it in this run) does not survive into the
    resumed run, and a key only the checkpoint has comes back. Updating without clearing would keep
    the current run's extra keys, so the resumed groups would depend on how the new run was set up.
    The dicts are changed in place, not replaced: they are the user's optimizer's own groups (see
    [Note: two faces of one optimizer] in optimizer.py). A constructor flag a checkpoint lacks (one a
    newer torch added) still reaches the step: each unit's inner optimizer was built with every flag
    and the step copies only the keys the group has."""
    for group, saved in zip(zopt.param_groups, saved_groups):
        params = group["params"]
        group.clear()
        group.update({k: v for k, v in saved.items() if k != "params"})
        group["params"] = params
