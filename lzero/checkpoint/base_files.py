"""A checkpoint written without its frozen base: the record of where the base's tensors are, checked and read back.

[Note: a checkpoint without its frozen base]
A LoRA or QLoRA fine-tune trains a few million parameters beside a frozen base of billions, read from
``from_pretrained`` files that do not change. Writing the base into every checkpoint costs its whole size per save
(the 4-bit codes of a QLoRA base included) for bytes that are already on disk. With ``save_frozen=False`` (the
default) a frozen parameter that came unchanged from such files is not written; the manifest's ``base`` holds instead

- ``files``: each pretrained file the omitted tensors come from, by absolute path, with its size in bytes and the
  SHA-256 of its content;
- ``tensors``: each omitted parameter by name: its file and key there, the dtype it was read into (``dtype``: the
  parameter's, a bf16-true cast included), the dtype its pieces have in a checkpoint that holds it (``saved``: a
  frozen unit's shard is in its compute dtype), and for a quantized weight of a QLoRA base the recipe of its codes
  (``quantized``: :meth:`lzero.engine.quantized_read.QuantizedRead.record`).

Every reader of the checkpoint (resume at any world size or stage, ``lzero consolidate``, ``export-hf``,
``inspect``) opens it through :class:`lzero.checkpoint.reader.ShardedCheckpoint`, which checks every recorded
file's size and hash on open, before anything is loaded, and refuses a missing or changed file by its path. The
omitted parameters are then pieces like any other: one piece per tensor whose source reads its flat ranges from the
file, converted as the load converted them (the file's dtype into ``dtype``, then into ``saved``) or quantized on
the spot as the load quantized them, so what a reader gets is bitwise what a checkpoint holding the base gives.

What is omitted is decided at each save, by the engine (:class:`lzero.engine.frozen_base.FrozenBase`): a frozen
parameter read from safetensors files, in a unit whose shard still holds what was read at setup on every rank (a
fingerprint, compared at the save). Anything else is written as before: a frozen layer drawn at random, a DPO
reference built from a config, a base changed after loading, a ``.bin`` checkpoint's tensors. ``save_frozen=True``
writes the base as well.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lzero.checkpoint.files import CheckpointError, TensorFile
from lzero.checkpoint.pieces import Piece

HASH = "sha256"
_CHUNK = 1 << 24  # bytes hashed per read


class BaseTensor(NamedTuple):
    """Where one frozen parameter's values are, and how they were read: see [Note: a checkpoint without its frozen
    base]."""

    file: str  # absolute path of a safetensors file
    key: str  # the tensor's key in it
    dtype: torch.dtype  # what the load read it into (the parameter's dtype)
    saved: torch.dtype  # the dtype of its pieces in a checkpoint that holds them
    quantized: Optional[dict[str, Any]] = None  # a QLoRA base's codes: QuantizedRead.record()
    shape: Optional[tuple[int, ...]] = None  # a whole tensor of the module's state (not a unit's parameter): its shape

    def as_json(self) -> dict[str, Any]:
        out = {"file": self.file, "key": self.key, "dtype": _name(self.dtype), "saved": _name(self.saved)}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return {**out, "quantized": self.quantized} if self.quantized is not None else out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def digest(path: str) -> str:
    """The SHA-256 of the file's content, hashed once per process for a file whose size, inode and modification time
    are unchanged."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_ino, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def base_record(tensors: dict[str, BaseTensor], whole: Optional[dict[str, tuple[BaseTensor, str]]] = None
                ) -> dict[str, Any]:
    """The manifest's ``base``: ``tensors`` (units' parameters, by name), ``whole`` (tensors of the module's state
    outside every unit, by state-dict key, each with the SHA-256 of its bytes: [Note: an eager model's frozen base] in
    lzero/hf/eager_base.py) and the size and hash of each of their files."""
    whole = whole or {}
    files = sorted({t.file for t in tensors.values()} | {t.file for t, _ in whole.values()})
    record = {"files": {f: {"bytes": os.stat(f).st_size, HASH: digest(f)} for f in files},
              "tensors": {name: t.as_json() for name, t in tensors.items()}}
    if whole:
        record["whole"] = {key: {**t.as_json(), HASH: h} for key, (t, h) in whole.items()}
    return record


def check_record(record: Any, where: Path) -> tuple[dict[str, BaseTensor], dict[str, tuple[BaseTensor, str]]]:
    """The recorded units' parameters (by name) and whole tensors of the module's state (by state-dict key, each with
    its bytes' SHA-256), once the record is well formed and every file it names is there with its recorded size and
    hash; a missing or changed file is refused by its path, before any tensor is read."""

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"`{where}`: the record of the frozen base {problem}. HINT: this checkpoint's manifest is"
                               " damaged; resume from an earlier checkpoint.")

    def tensor(name: str, t: Any) -> BaseTensor:
        try:
            shape = tuple(int(d) for d in t["shape"]) if "shape" in t else None
            out = BaseTensor(t["file"], t["key"], _dtype(t["dtype"]), _dtype(t["saved"]), t.get("quantized"), shape)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise bad(f"of `{name}` is not {{file, key, dtype, saved}}") from None
        if out.file not in record["files"]:
            raise bad(f"of `{name}` names `{out.file}`, which is not among its files")
        return out

    if not isinstance(record, dict) or not isinstance(record.get("files"), dict) \
            or not isinstance(record.get("tensors"), dict) or not isinstance(record.get("whole", {}), dict):
        raise bad("must be {files: {...}, tensors: {...}, whole: {...}}")
    for path, info in record["files"].items():
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or not isinstance(info.get(HASH), str):
            raise bad(f"names `{path}` without its bytes and {HASH}")
        _check_file(Path(path), info, where)
    whole = {}
    for key, t in record.get("whole", {}).items():
        whole[key] = (tensor(key, t), t.get(HASH))  # tensor() refused anything but a mapping
        if whole[key][0].shape is None or not isinstance(whole[key][1], str):
            raise bad(f"of `{key}` has no shape or {HASH}")
    return {name: tensor(name, t) for name, t in record["tensors"].items()}, whole


def whole_tensor(tensor: BaseTensor, expected: str, key: str, where: Path) -> Tensor:
    """A tensor of the module's state read whole from its file, converted as it was, checked against its hash."""
    from lzero.engine.frozen_base import digest_tensor

    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(TensorFile(tensor.file).read(tensor.key).reshape(tensor.shape))
    if digest_tensor(out) != expected:
        raise CheckpointError(f"`{where}`: `{key}`, read from `{tensor.key}` in `{tensor.file}` and converted to"
                              f" {tensor.dtype}, differs from the tensor the run saved. HINT: read the checkpoint on a"
                              " machine where the file is the same, or save it with `save_frozen=True`.")
    return out


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(name)
    return dtype


def _check_file(path: Path, info: dict[str, Any], where: Path) -> None:
    hint = (" HINT: this checkpoint holds the trained tensors only, and reads its frozen base from the pretrained files"
            " it was trained from: put those files back where they were (the same content), or resume from a"
            " checkpoint saved with `save_frozen=True`.")
    if not path.is_file():
        raise CheckpointError(f"`{where}` reads its frozen base from `{path}`, which does not exist.{hint}")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(f"`{where}` reads its frozen base from `{path}`, which has changed: {size} bytes, the"
                              f" checkpoint recorded {info['bytes']}.{hint}")
    if digest(str(path)) != info[HASH]:
        raise CheckpointError(f"`{where}` reads its frozen base from `{path}`, which has changed: its {HASH} differs"
                              f" from the one the checkpoint recorded.{hint}")


class _BaseSource:
    """One omitted tensor, read from its pretrained file as the load read it (a piece's source: pieces.py)."""

    def __init__(self, tensor: BaseTensor, files: dict[str, TensorFile]) -> None:
        self.tensor = tensor
        if tensor.file not in files:
            files[tensor.file] = TensorFile(tensor.file)
        self.file = files[tensor.file]

    @torch.no_grad()
    def read_flat_range(self, start: int, end: int) -> Tensor:
        t = self.tensor
        out = torch.empty(end - start, dtype=t.dtype)
        if t.quantized is None:
            out.copy_(self.file.read_flat_range(t.key, start, end))
        else:
            from lzero.engine.quantized_read import QuantizedRead

            read = QuantizedRead.from_record(t.quantized)
            values = lambda a, b, into: into.copy_(self.file.read_flat_range(t.key, a, b))  # noqa: E731
            read.read(values, start, end, out)
        return out if t.saved == t.dtype else out.to(t.saved)


def base_pieces(tensors: dict[str, BaseTensor], params: dict[str, Any]) -> dict[str, list[Piece]]:
    """``param/<name>`` of each recorded tensor: one piece, read from its file."""
    files: dict[str, TensorFile] = {}
    return {f"param/{name}": [Piece(0, params[name]["numel"], _BaseSource(t, files))] for name, t in tensors.items()
            if name in params}


# --- the quantization state of a QLoRA base, left out with its codes -------------------------------------------------


def state_keys(tensors: dict[str, BaseTensor]) -> dict[str, tuple[str, str]]:
    """State-dict key -> (the weight it belongs to, its name under it) of each recorded 4-bit weight's quantization
    state (``<weight>.absmax``, ``<weight>.quant_map``...), which a checkpoint holding the codes holds beside them."""
    return {f"{name}.{k}": (name, k) for name, t in tensors.items()
            if t.quantized is not None and "state" in t.quantized for k in t.quantized["state"]["tensors"]}


def state_layout(tensor: BaseTensor, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape of one of the weight's state tensors, from the record."""
    info = tensor.quantized["state"]["tensors"][key]
    return _dtype(info["dtype"]), tuple(info["shape"])


def state_again(tensor: BaseTensor, where: Path) -> dict[str, Tensor]:
    """The weight's quantization state computed again from its file (every group of it read and quantized), each
    tensor checked against the hash the record holds."""
    from lzero.engine.frozen_base import digest_tensor
    from lzero.engine.quantized_read import QuantizedRead

    read = QuantizedRead.from_record(tensor.quantized)
    file = TensorFile(tensor.file)
    state = read.state_again(lambda a, b, into: into.copy_(file.read_flat_range(tensor.key, a, b)))
    for key, info in tensor.quantized["state"]["tensors"].items():
        if key not in state or digest_tensor(state[key]) != info[HASH]:
            raise CheckpointError(
                f"`{where}`: the quantization state `{key}` of the frozen base's `{tensor.key}` (from `{tensor.file}`)"
                " computed again on this machine differs from the one the run saved. HINT: read the checkpoint with"
                " the bitsandbytes version the run used, or save it with `save_frozen=True`.")
    return {k: state[k] for k in tensor.quantized["state"]["tensors"]}
