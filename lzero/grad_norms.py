"""Per-parameter gradient norms from the shards, with Lightning's keys.

[Note: per-parameter gradient norms]
Under DDP ``p.grad`` holds each parameter's averaged gradient when ``on_before_optimizer_step`` runs, and
Lightning's ``grad_norm(self, norm_type)`` logs ``grad_{p}_norm/{name}`` for each and ``grad_{p}_norm_total``.
Under ZeRO the averaged gradient lives in the units' shards and ``p.grad`` is None (stages 2-3) or this rank's
unreduced gradient (stage 1), so Lightning's function returns ``{}`` or local values. :func:`grad_norm` computes
the same dictionary from the shards: each rank sums ``|g|^p`` (the maximum of ``|g|`` for the inf norm) over the
pieces of each parameter it owns, one all-reduce of that vector (SUM, or MAX) gives every parameter's total, and
the total norm is taken over the per-parameter norms as Lightning does. It is a collective: every rank calls it,
in ``on_before_optimizer_step`` (the shards are final there). Under tensor parallel a tensor-sharded parameter's
total is taken over its tensor group too, a second all-reduce ([Note: tensor parallel under ZeRO] in
lzero/engine/tensor_parallel.py).
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor, nn

from lzero.engine import collectives


@torch.no_grad()
def parameter_grad_norms(engine: Any, norm_type: float) -> dict[str, Tensor]:
    """Every trainable parameter's gradient norm (the averaged gradient, as DDP holds it), by its name in the partition;
    parameters of units without a gradient this step are left out. One all-reduce. A collective."""
    units = [u for u in engine.units if not u.spec.frozen]
    engine.prepare_step(units)
    stepped = [u for u in units if u.has_step_grad]
    names = [p.name for u in stepped for p in u.spec.params]
    device = stepped[0].flat_param.device if stepped else torch.device("cpu")
    partial = torch.zeros(len(names), dtype=torch.float32, device=device)  # sum |g|^p (inf: max |g|) per parameter
    position = {name: i for i, name in enumerate(names)}
    for unit in stepped:
        grad = unit.shard_grad
        for param, start, end, at in unit.spec.owned_pieces(engine.rank):
            piece = grad[at: at + end - start].float().abs()
            value = piece.max() if norm_type == float("inf") else piece.pow(norm_type).sum()
            partial[position[param.name]] = value.to(device)
    op = torch.distributed.ReduceOp.MAX if norm_type == float("inf") else None  # None: SUM
    total = collectives.all_reduce(partial, group=engine.group, op=op)
    if engine.tensor_group is not None:  # the pieces of a tensor-sharded parameter on the other tensor ranks
        sharded = torch.tensor([engine.tensor_sharded(name) for name in names], device=device)
        across = collectives.all_reduce(torch.where(sharded, total, 0.0), group=engine.tensor_group, op=op)
        total = torch.where(sharded, across, total)
    norms = total if norm_type == float("inf") else total.pow(1.0 / norm_type)
    return dict(zip(names, norms.unbind()))


def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, Tensor]:
    """``lightning.pytorch.utilities.grad_norm`` for a module trained by an lzero strategy: the same keys and values
    as under DDP, computed from the shards (see [Note: per-parameter gradient norms]). Call it on every rank in
    ``on_before_optimizer_step``; under any other strategy it is Lightning's own function."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    trainer = getattr(module, "_trainer", None)
    engine = getattr(getattr(trainer, "strategy", None), "engine", None)
    if engine is None:
        return lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    by_name = parameter_grad_norms(engine, norm_type)
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": by_name[name]
             for name, _ in module.named_parameters() if name in by_name}
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms
