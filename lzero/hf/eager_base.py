"""The frozen base of a model transformers loaded itself (zero1/zero2, where every rank holds it whole), found again in
its pretrained files, so that checkpoints may leave it out too.

[Note: an eager model's frozen base]
At zero1/zero2 ``from_pretrained`` is transformers' own (every rank needs every parameter) and a frozen base stays
whole on every rank, outside every unit; checkpoints write it with rank 0's common part (``lzero/module_state``).
After the engine is set up (mixed precision has cast what it casts), :func:`find_base` looks for each frozen,
floating parameter outside the units in the safetensors files of the Hugging Face model that holds it (the folder its
``name_or_path`` names, when that is a local folder), by the keys transformers matches (with or without the base
model's prefix; a tied parameter under any of its names), and keeps those whose bytes are exactly the file's tensor
converted to the parameter's dtype (each rank checks every N-th, one all-reduce agrees). Those the saves leave out
while their bytes keep the SHA-256 taken here ([Note: a checkpoint without its frozen base] in
lzero/checkpoint/base_files.py): a reader reads the file's tensor back, converts it, and checks the hash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lzero.checkpoint.base_files import BaseTensor
from lzero.checkpoint.files import TensorFile
from lzero.engine import collectives, packed_weights
from lzero.engine.frozen_base import WholeBase, byte_view, digest_tensor, fingerprint
from lzero.hf.pretrained import candidate_keys, state_keys
from lzero.hf.weights import PretrainedLoadError, find_files


def _models(root: nn.Module) -> list[tuple[nn.Module, Path]]:
    """Each outermost Hugging Face ``PreTrainedModel`` inside ``root`` whose ``name_or_path`` is a local folder, with
    that folder."""
    from lzero.hf.pretrained import pretrained_class

    base = pretrained_class()
    found: list[tuple[str, nn.Module, Path]] = []
    for name, sub in root.named_modules():
        if base is None or not isinstance(sub, base) or any(name.startswith(f"{p}.") or not p for p, _, _ in found):
            continue
        folder = Path(str(getattr(sub, "name_or_path", "") or ""))
        if folder.is_dir():
            found.append((name, sub, folder))
    return [(sub, folder) for _, sub, folder in found]


def _file_keys(root: nn.Module) -> dict[int, tuple[str, str]]:
    """id(tensor) -> (the absolute path of the safetensors file, the key there) for each tensor of a Hugging Face model
    inside ``root`` whose files hold a tensor of its shape under a name transformers would load it from (a layer
    peft wrapped is looked up without its ``.base_layer``)."""
    out: dict[int, tuple[str, str]] = {}
    for model, folder in _models(root):
        try:
            files = find_files(folder, use_safetensors=True)
        except PretrainedLoadError:
            continue
        prefix = getattr(model, "base_model_prefix", "") or ""
        tensors = model.state_dict(keep_vars=True)
        for first, aliases in state_keys(model).items():
            names = [n for a in aliases for n in (a, a.replace(".base_layer.", "."))]
            key = next((c for n in names for c in candidate_keys(n, prefix) if c in files.tensors), None)
            if key is not None and tuple(files.tensors[key].shape) == tuple(tensors[first].shape):
                out[id(tensors[first])] = (str((folder / files.tensors[key].file).resolve()), key)
    return out


@torch.no_grad()
def _same_as_file(t: Tensor, path: str, key: str) -> bool:
    want = torch.empty(t.shape, dtype=t.dtype)
    want.copy_(TensorFile(path).read(key))
    mine = t.detach().cpu()
    return torch.equal(byte_view(want), byte_view(mine))


def find_base(root: nn.Module, outside: list[nn.Parameter], group: Optional[dist.ProcessGroup], rank: int,
              world: int) -> dict[str, WholeBase]:
    """State-dict key -> where the files hold it, with its bytes' SHA-256 and fingerprint (on rank 0, which writes
    the module's state), of each frozen floating parameter in ``outside`` that is exactly its pretrained file's
    tensor; see [Note: an eager model's frozen base]. A collective on ``group`` (every rank calls it with the same
    model)."""
    where = _file_keys(root)
    frozen = [p for p in outside if not p.requires_grad and p.is_floating_point() and not packed_weights.is_packed(p)
              and id(p) in where]
    same = torch.zeros(len(frozen), dtype=torch.float32)
    for i, p in enumerate(frozen):
        if i % world == rank:
            same[i] = float(_same_as_file(p, *where[id(p)]))
    if frozen:
        collectives.all_reduce(same, group=group)  # each flag set by exactly one rank
    kept = {id(p) for p, ok in zip(frozen, same.tolist()) if ok == 1.0}
    out: dict[str, WholeBase] = {}
    hashed: dict[int, tuple[str, int]] = {}  # a tied tensor hashed once
    for key, t in root.state_dict(keep_vars=True).items():
        if id(t) in kept:
            if id(t) not in hashed:
                hashed[id(t)] = (digest_tensor(t), fingerprint(t)) if rank == 0 else ("", 0)
            path, file_key = where[id(t)]
            out[key] = WholeBase(BaseTensor(path, file_key, t.dtype, t.dtype, shape=tuple(t.shape)), *hashed[id(t)])
    return out
