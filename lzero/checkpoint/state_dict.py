"""The module's parameters going out of the engine (state dicts) and coming back in (loads).

Out: ``sharded_state_dict`` returns the module's own keys with global shapes and, for every sharded
parameter, a :class:`ShardedTensor` (this rank's piece plus ``full_tensor()``), so a caller never
needs the whole model on one rank; ``consolidate`` turns such a dict into plain tensors on rank 0,
gathering one unit at a time. Tied parameters appear under each of their keys, as the same object.
Under 16-bit training ``master_state_dict`` holds the fp32 masters instead of the 16-bit working
parameters, and ``restore_masters`` hands them back to the module at the end of fit.

In: ``load_params`` sets every parameter from a reader of pieces, each rank reading only what it
owns (see [Note: owned pieces] in rank_state.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from lzero.engine import collectives
from lzero.checkpoint.files import CheckpointError
from lzero.checkpoint.rank_state import fill_shard, shard_pieces

if TYPE_CHECKING:
    from lzero.engine.engine import ZeroEngine
    from lzero.engine.flat_unit import FlatUnit


class ShardedTensor:
    """One parameter of a stage-3 model as one rank holds it."""

    def __init__(self, engine: "ZeroEngine", unit: "FlatUnit", index: int) -> None:
        self.engine, self.unit, self.index = engine, unit, index
        self.spec = unit.spec.params[index]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.unit.master_shard.dtype

    def local_shard(self) -> tuple[int, Tensor]:
        """(start within the flattened parameter, this rank's elements of it); empty if it owns none."""
        with self.unit.resident():
            keep = (lambda t: t) if self.unit.store.in_memory else (lambda t: t.clone())
            for spec, a, _, piece in shard_pieces(self.unit, self.unit.master_shard.detach()):
                if spec.name == self.spec.name:
                    return a, keep(piece)
            return 0, keep(self.unit.master_shard.detach()[:0])

    def full_tensor(self) -> Tensor:
        """The whole parameter on every rank (a collective: call it on every rank)."""
        with self.engine.gathered_units([self.unit]):
            return self.unit.params[self.index].detach().clone()

    def __repr__(self) -> str:
        return f"ShardedTensor(name={self.spec.name!r}, shape={tuple(self.shape)}, rank={self.unit.rank})"


def sharded_state_dict(engine: "ZeroEngine", module: nn.Module) -> dict[str, Any]:
    where = {id(p): (u, i) for u in engine.units for i, p in enumerate(u.params)}
    made: dict[int, ShardedTensor] = {}
    out: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in where:
            out[key] = made.setdefault(id(value), ShardedTensor(engine, *where[id(value)]))
        else:
            out[key] = value.detach()
    return out


@torch.no_grad()
def consolidate(engine: "ZeroEngine", state_dict: dict[str, Any], to_all: bool = False) -> dict[str, Any]:
    """Plain tensors on rank 0 (an empty dict elsewhere; ``to_all``: on every rank), one unit gathered at a time. A
    collective."""
    keep = engine.rank == 0 or to_all
    units = []
    for value in state_dict.values():
        if isinstance(value, ShardedTensor) and all(value.unit is not u for u in units):
            units.append(value.unit)
    full: dict[int, Tensor] = {}
    for unit in units:
        with engine.gathered_units([unit]):
            if keep:
                full.update({id(p): p.detach().clone() for p in unit.params})
    if not keep:
        return {}
    return {k: full[id(v.unit.params[v.index])] if isinstance(v, ShardedTensor) else v for k, v in state_dict.items()}


def has_sharded(state_dict: dict[str, Any]) -> bool:
    return any(isinstance(v, ShardedTensor) for v in state_dict.values())


def module_state_dict(engine: "ZeroEngine", module: nn.Module, sharded_checkpoint: bool, full: bool
                      ) -> dict[str, Any]:
    """The state dict a checkpoint of ``module`` takes while fitting. A collective: call it on every rank.

    For a sharded checkpoint (``sharded_checkpoint``) the sharded form at every stage: no rank gathers
    anything. Otherwise the fp32 masters under 16-bit training (not the 16-bit copies); the module's own
    state dict at stages 1-2; at stage 3 the sharded form, or with ``full`` plain tensors on rank 0,
    gathered one unit at a time."""
    if sharded_checkpoint:
        return sharded_state_dict(engine, module)
    if engine.mixed:
        return master_state_dict(engine, module)
    if engine.gatherer is None:
        return module.state_dict()
    state = sharded_state_dict(engine, module)
    return consolidate(engine, state) if full else state


def gathered_masters(engine: "ZeroEngine") -> Iterator[tuple["FlatUnit", Tensor]]:
    """(unit, its full fp32 master buffer), one unit at a time, on every rank. A collective."""
    for unit in engine.units:
        device = unit.flat_param.device  # where collectives run (offloaded masters live in host memory)
        flat = torch.empty(unit.spec.padded_numel, dtype=unit.master_shard.dtype, device=device)
        with unit.resident():
            collectives.all_gather(flat, unit.master_shard.detach().to(device), engine.group)
        yield unit, flat


@torch.no_grad()
def master_state_dict(engine: "ZeroEngine", module: nn.Module, to_all: bool = False) -> dict[str, Tensor]:
    """The module's state dict with the fp32 masters in place of the 16-bit working parameters,
    on rank 0 (an empty dict elsewhere; ``to_all``: on every rank), gathered one unit at a time. A collective."""
    keep = engine.rank == 0 or to_all
    full: dict[int, Tensor] = {}
    for unit, flat in gathered_masters(engine):
        if keep:
            for p, (start, end) in zip(unit.params, unit.ranges):  # frozen parameters in their own dtype, as DDP's
                full[id(p)] = flat[start:end].view(p.shape).to(dtype=unit.master_dtype, copy=True)
    if not keep:
        return {}
    return {k: full[id(v)] if id(v) in full else v.detach() for k, v in module.state_dict(keep_vars=True).items()}


@torch.no_grad()
def restore_masters(engine: "ZeroEngine") -> None:
    """16-bit working parameters, at the end of fit: every parameter becomes a standalone full
    tensor holding its fp32 master again (frozen ones return to their dtype). A collective."""
    for unit, flat in gathered_masters(engine):
        unit.hand_back(flat)
        if engine.gatherer is not None:
            engine.gatherer.release(engine.gatherer.block_of(unit).name)
    engine.restore_frozen_dtypes()


@torch.no_grad()
def load_params(engine: "ZeroEngine", fetch: Callable[[str, int, int], Tensor]) -> None:
    """Set every parameter from ``fetch(name, start, end)`` (elements [start, end) of the flattened
    parameter): each rank fetches only the pieces it owns into its fp32 masters, publishes them in the
    compute dtype, and stages 1-2 all-gather the full parameters. A collective."""
    for unit in engine.units:
        with unit.resident(write=True):
            fill_shard(unit.master_shard.data, unit, lambda spec, a, b: fetch(spec.name, a, b))
            engine.republish(unit)
    engine.refresh_params()


def fetch_full(state_dict: dict[str, Tensor]) -> Callable[[str, int, int], Tensor]:
    """A piece reader over a plain (DDP/Lightning) state dict, for :func:`load_params`."""
    def fetch(name: str, start: int, end: int) -> Tensor:
        if name not in state_dict:
            raise CheckpointError(f"The checkpoint's state_dict has no `{name}`. HINT: it belongs to another model.")
        return state_dict[name].detach().reshape(-1)[start:end]
    return fetch


def keys_as_loaded(module: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` keyed by the names ``module.load_state_dict`` would load each value into: a module's own
    ``_load_from_state_dict`` or load pre-hooks may rename keys (litgpt's LoRA layers load ``lm_head.weight`` into
    ``lm_head.linear.weight``), and lzero reads checkpoints into shards by name. Found by running torch's own loading
    over meta stand-ins of the module's tensors and of the values, watching which value each tensor is copied from:
    nothing is read or written. A value a hook computes (rather than renames) is refused by name."""
    from torch.overrides import TorchFunctionMode

    owners = [(sub, kind) for sub in module.modules() for kind in ("_parameters", "_buffers")]
    saved = [(table, dict(getattr(sub, kind))) for sub, kind in owners for table in [getattr(sub, kind)]]
    stand_in: dict[int, torch.Tensor] = {}
    name_of: dict[int, str] = {}
    names_of: dict[int, set[str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = getattr(sub, kind)
            for local, t in table.items():
                if t is None:
                    continue
                meta = stand_in.setdefault(id(t), torch.empty(t.shape, dtype=t.dtype, device="meta"))
                name = f"{prefix}.{local}" if prefix else local
                name_of.setdefault(id(meta), name)
                names_of.setdefault(id(meta), set()).add(name)  # a tied tensor has several
    probe: dict[str, torch.Tensor] = {}
    key_of: dict[int, str] = {}
    for key in state_dict:  # shapes and dtypes only: lazily loaded values stay unread
        value = state_dict[key]
        probe[key] = torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
        key_of[id(probe[key])] = key
    copies: list[tuple[int, int]] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if getattr(func, "__name__", "") == "copy_" and len(args) >= 2:
                copies.append((id(args[0]), id(args[1])))
            return func(*args, **(kwargs or {}))

    try:
        for table, original in saved:
            for local, t in original.items():
                if t is not None:
                    table[local] = stand_in[id(t)]
        with Watch():
            type(module).load_state_dict(module, probe, strict=False)
    finally:
        for table, original in saved:
            table.update(original)
    out = {k: state_dict[k] for k in state_dict}  # keys no module claims stay as they are (reported as unexpected)
    for dest, src in copies:
        if dest not in name_of:
            continue
        if src not in key_of:
            raise ValueError(f"Loading `{name_of[dest]}` runs a hook of the model that computes its value from the"
                             " state dict, which lzero cannot read into shards piece by piece. HINT: convert the"
                             " checkpoint to the model's own names first (load it into the model built eagerly and"
                             " save `model.state_dict()`).")
        key = key_of[src]
        if key not in names_of[dest]:
            out.pop(key, None)
            out[name_of[dest]] = state_dict[key]
    return out
