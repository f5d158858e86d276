"""Which frozen parameters a checkpoint may leave out, because they are still what their pretrained files hold.

See [Note: a checkpoint without its frozen base] in lzero/checkpoint/base_files.py. At setup the engine keeps, for
each frozen unit some of whose parameters were read from files (``weights.base_tensor``), a fingerprint of this
rank's shard as read. At a save, :meth:`FrozenBase.unchanged` fingerprints the shards again: a unit left out must be
unchanged on every rank (one all-reduce), since every rank writes its pieces of the same units.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lzero.engine import collectives

if TYPE_CHECKING:
    from lzero.engine.flat_unit import FlatUnit

_WORDS = 1 << 22  # elements weighed at once on an accelerator (a 32 MB int64 temporary)


class WholeBase(NamedTuple):
    """A frozen tensor outside every unit that is its pretrained file's ([Note: an eager model's frozen base] in
    lzero/hf/eager_base.py): where the files hold it, the SHA-256 of its bytes (what readers check) and its
    :func:`fingerprint` (what a save compares, without copying it to the host), both taken at setup on rank 0."""

    where: Any  # lzero.checkpoint.base_files.BaseTensor
    sha256: str
    fingerprint: int


def byte_view(t: Tensor) -> Tensor:
    """The tensor's bytes, flat (a view where it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def digest_tensor(t: Tensor) -> str:
    """The SHA-256 of the tensor's bytes (read on the host): the hash a checkpoint's record keeps."""
    return hashlib.sha256(byte_view(t.cpu()).numpy()).hexdigest()


@torch.no_grad()
def fingerprint(t: Tensor) -> int:
    """A digest of the tensor's bytes: SHA-256 on the host (0.35 s for 700 MB here); on an accelerator a weighted sum
    of its bytes, each byte by a weight that depends on its position (any one changed byte changes it), without a copy
    to the host."""
    flat = byte_view(t)
    if flat.device.type == "cpu":
        return int.from_bytes(hashlib.sha256(flat.numpy()).digest()[:16], "little")
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for lo in range(0, flat.numel(), _WORDS):
        chunk = flat[lo : lo + _WORDS].to(torch.int64)
        weights = torch.arange(lo, lo + chunk.numel(), dtype=torch.int64, device=flat.device)
        weights.mul_(2654435761).remainder_(4294967291).add_(1)
        total += (chunk * weights).sum()
    return int(total.item())


class FrozenBase:
    """The frozen units read from pretrained files, and their shards' fingerprints as read."""

    def __init__(self, units: Sequence["FlatUnit"], weights: Any, group: Optional[dist.ProcessGroup]) -> None:
        """A collective on ``group``: a parameter is left out of checkpoints only where every rank can read it back."""
        self._weights = weights
        self._units: list[tuple["FlatUnit", list[str], int]] = []
        frozen = [unit for unit in units if unit.spec.frozen]
        names = [p.name for unit in frozen for p in unit.spec.params]
        readable = torch.tensor([float(weights.base_tensor(n) is not None) for n in names], dtype=torch.float32)
        if names:
            collectives.all_reduce(readable, dist.ReduceOp.MIN, group)
        everywhere = {n for n, ok in zip(names, readable.tolist()) if ok}
        for unit in frozen:
            kept = [p.name for p in unit.spec.params if p.name in everywhere]
            if kept:
                self._units.append((unit, kept, _unit_print(unit)))

    def __bool__(self) -> bool:
        return bool(self._units)

    def unchanged(self, group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
        """Parameter name -> where its values are in the files (``weights.base_tensor``), for the parameters of every
        unit whose shard still holds what was read, on every rank of ``group``. A collective on ``group``."""
        changed = torch.tensor([float(_unit_print(u) != before) for u, _, before in self._units], dtype=torch.float32)
        collectives.all_reduce(changed, dist.ReduceOp.MAX, group)
        return {name: self._weights.base_tensor(name, unit.master_dtype, unit.master_shard.dtype)
                for (unit, names, _), moved in zip(self._units, changed.tolist()) if not moved for name in names}


def _unit_print(unit: "FlatUnit") -> int:
    if unit.store.in_memory:
        return fingerprint(unit.master_shard)
    with unit.resident():  # a shard in a file: read for the fingerprint, as a save reads it
        return fingerprint(unit.master_shard)
