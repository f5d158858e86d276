"""Model-state memory of one rank, by kind and by store: what the ZeRO formulas count.

Each tensor storage is counted once, under the first kind that claims it, in the order parameters,
gradients, masters, averaged shards (weight averaging), optimizer state (then the offload stores' staging buffers): a master that is the parameters' own memory (full precision,
not offloaded) counts as parameters, as the formulas count it. The store is the one the unit keeps
that kind in ("device", or "cpu" for host memory under offload; "nvme" for swap files), so the split is right on a
CPU-only machine too, where both stores are host memory. Parameters outside every unit (frozen ones at stages
1-2: a frozen reference model, a LoRA or QLoRA base) are whole on every rank, on the device, counted as parameters.
At stage 3 a unit's gathered values (its block gathered, or kept gathered between steps by the gather schedule)
are working set, counted as buffers; its shard is the parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from torch import Tensor

from lzero.engine.ownership import state_tensors
from lzero.engine.tensor_parallel import local
from lzero.offload.store import KINDS

if TYPE_CHECKING:
    from lzero.engine.engine import ZeroEngine

__all__ = ["KINDS", "model_state_bytes", "total"]


def model_state_bytes(engine: "ZeroEngine", optimizers: Sequence[Any] = ()) -> dict[str, dict[str, int]]:
    """``{store: {kind: bytes}}`` held by this rank now (no communication). ``optimizers``: the
    :class:`lzero.optimizer.ZeroOptimizer` s whose state to count (that module sits a floor above this one)."""
    seen: set[int] = set()
    out: dict[str, dict[str, int]] = {}
    for store, kind, tensor in _tensors(engine, optimizers):
        storage = local(tensor).untyped_storage()  # a DTensor's (tensor parallel): its local tensor's
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        per_kind = out.setdefault(store, dict.fromkeys(KINDS, 0))
        per_kind[kind] += storage.nbytes()
    for store in engine.stores:
        staging = getattr(store, "staging_bytes", None)
        if staging is not None:
            out.setdefault(store.memory, dict.fromkeys(KINDS, 0))["buffers"] += staging()
        on_disk = getattr(store, "bytes_on_disk", None)
        if on_disk is not None:  # NVMe swap files
            for kind, nbytes in on_disk().items():
                out.setdefault("nvme", dict.fromkeys(KINDS, 0))[kind] += nbytes
    return out


def _tensors(engine: "ZeroEngine", optimizers: Sequence[Any]) -> Iterator[tuple[str, str, Tensor]]:
    secondary = engine.gatherer.secondary if engine.gatherer is not None else None
    for piece in secondary.tensors() if secondary is not None else ():  # hpZ's node-local copies
        yield "device", "parameters", piece
    gathered = "parameters" if engine.gatherer is None else "buffers"  # stage 3: a gathered block is working set
    for unit in engine.units:
        yield unit.param_store.memory, "parameters", unit.compute_shard()
        yield "device", gathered, unit.flat_param
        for binding in unit.bindings or ():  # a quantized base's state, whole on every rank (engine/packed_weights.py)
            for tensor in binding.tensors():
                yield "device", "parameters", tensor
    for p, whole in engine.outside_units():  # whole on every rank: frozen parameters at stages 1-2
        for tensor in (p.detach(), *whole.state):
            yield "device", "parameters", tensor
        if p.grad is not None:  # trainable, but in no optimizer
            yield "device", "gradients", p.grad
    for store in engine.stores:  # persistent host gradient buffers ([Note: persistent host buffers])
        for grad in getattr(store, "gradient_buffers", list)():
            yield store.memory, "gradients", grad
    for unit in engine.units:
        for grad in (unit.flat_grad, unit.shard_grad, unit.master_shard.grad if unit.stepping else None):
            if grad is not None:  # stepping: the delayed update's step in flight holds its own gradient
                yield unit.store.memory, "gradients", grad
        for p in unit.params:
            if p.grad is not None:
                yield "device", "gradients", p.grad
    for unit in engine.units:
        yield unit.store.memory, "masters", unit.master_shard.detach()
    for memory, shard in engine.average.tensors() if engine.average is not None else ():
        yield memory, "averages", shard  # a weight-averaging callback's: [Note: averaged shards]
    for zopt in optimizers:
        for unit in zopt.units:
            for value in state_tensors(zopt, unit):
                yield unit.store.memory, "optimizer_state", value


def total(by_store: dict[str, dict[str, int]], store: Optional[str] = None) -> int:
    """The sum over kinds (and over stores, or of ``store`` alone)."""
    return sum(sum(kinds.values()) for name, kinds in by_store.items() if store is None or name == store)
