"""A Hugging Face checkpoint folder read by flat ranges: each rank reads only the rows covering its shards.

[Note: reading a pretrained checkpoint into shards]
A unit's flat buffer holds its parameters back to back; a rank owns one contiguous range of it
(partition.py). For every parameter piece in that range, the rows of the tensor covering the piece are
read from the checkpoint (``safe_open(...).get_slice(key)[row0:row1]``: only those bytes come off the
disk), trimmed to the piece and converted to the unit's dtype. So a rank reads about 1/N of the files,
plus at most one row on each side of each piece.

Files are opened per unit and closed after it: safetensors maps a file into memory, and the pages
touched stay in the process's resident set while the file is open. Checkpoint keys are the model's own
(``transformer.h.0.attn.c_attn.weight``): the loader maps a module's parameter names (with the
LightningModule's prefix) to them; a tied parameter is read under any of its names that the file holds,
and a checkpoint saved from the base model (or from a model with a head) matches by the model's
``base_model_prefix``, as transformers does.

``pytorch_model.bin`` files are read with ``torch.load(weights_only=True, mmap=True)``: slices of a mapped
file, never an unpickled object; a file that needs more than tensors is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


class PretrainedLoadError(RuntimeError):
    """A pretrained checkpoint lzero cannot load into shards; the message names the fix."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives and what it is, read from the file header."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class CheckpointFiles:
    """The weight files of one folder and the header of every tensor in them (no tensor read)."""

    folder: Path
    kind: str  # "safetensors" or "bin"
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in self.tensors.values())


def find_files(folder: Path, use_safetensors: Optional[bool] = None) -> CheckpointFiles:
    """The checkpoint in ``folder`` (sharded with an index, or one file), its headers read."""
    folder = Path(folder)
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if use_safetensors is not False:
        if SAFE_INDEX in names:
            return _safetensors(folder, _index_files(folder / SAFE_INDEX))
        if SAFE_SINGLE in names:
            return _safetensors(folder, [SAFE_SINGLE])
    if use_safetensors is not True:
        if BIN_INDEX in names:
            return _bin(folder, _index_files(folder / BIN_INDEX))
        if BIN_SINGLE in names:
            return _bin(folder, [BIN_SINGLE])
    wanted = {True: f"{SAFE_INDEX} or {SAFE_SINGLE}", None: f"{SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX} or {BIN_SINGLE}",
              False: f"{BIN_INDEX} or {BIN_SINGLE}"}[use_safetensors]
    raise PretrainedLoadError(
        f"No model weights in `{folder}`: it holds {names or 'nothing'}, none of {wanted}. HINT: pass the folder"
        " that `save_pretrained` wrote (or a Hugging Face model id), or build the model with `from_config` to"
        " train it from scratch.")


def _index_files(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise PretrainedLoadError(f"`{index}` is not a weight index ({err!r}). HINT: write the folder again with"
                                  " `save_pretrained`.") from None
    return sorted(set(weight_map.values()))


def _safetensors(folder: Path, files: list[str]) -> CheckpointFiles:
    from safetensors import safe_open

    found = CheckpointFiles(folder, "safetensors")
    for name in files:
        path = folder / name
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    found.tensors[key] = TensorInfo(name, _safe_dtype(sl.get_dtype(), path, key), tuple(sl.get_shape()))
        except FileNotFoundError:
            raise PretrainedLoadError(f"`{path}` is named by the weight index but does not exist. HINT: copy the"
                                      " whole folder again, or write it again with `save_pretrained`.") from None
        except PretrainedLoadError:
            raise
        except Exception as err:  # safetensors raises its own error types for a bad header or a short file
            raise PretrainedLoadError(
                f"`{path}` is not a complete safetensors file ({type(err).__name__}: {err}). HINT: the download or"
                " copy was probably cut short: fetch the file again.") from None
        _check_length(path, found, name)
    return found


def _check_length(path: Path, found: CheckpointFiles, name: str) -> None:
    """A file cut short after its header: safetensors checks the header, not that the data is all there."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    need = 8 + header + sum(math.prod(t.shape) * t.dtype.itemsize for t in found.tensors.values() if t.file == name)
    size = path.stat().st_size
    if size < need:
        raise PretrainedLoadError(f"`{path}` is truncated: {size} bytes, its header describes {need}. HINT: the"
                                  " download or copy was cut short: fetch the file again.")


_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def _safe_dtype(name: str, path: Path, key: str) -> torch.dtype:
    if name not in _SAFE_DTYPES:
        raise PretrainedLoadError(f"`{key}` in `{path}` is stored as {name}, which lzero does not load. HINT: save"
                                  " the model in float32, bfloat16 or float16.")
    return _SAFE_DTYPES[name]


def _bin(folder: Path, files: list[str]) -> CheckpointFiles:
    found = CheckpointFiles(folder, "bin")
    for name in files:
        for key, t in _load_bin(folder / name).items():
            found.tensors[key] = TensorInfo(name, t.dtype, tuple(t.shape))
    return found


def _load_bin(path: Path) -> dict[str, Tensor]:
    """A ``pytorch_model.bin`` mapped, not read (``mmap=True``), with ``weights_only=True``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise PretrainedLoadError(f"`{path}` is named by the weight index but does not exist.") from None
    except Exception as err:
        raise PretrainedLoadError(
            f"`{path}` cannot be read with `torch.load(weights_only=True)`: {str(err).splitlines()[0]}. lzero never"
            " unpickles arbitrary objects from a checkpoint. HINT: if you trust the file, convert it once:"
            " `model = AutoModel.from_pretrained(folder)` in a plain process, then `model.save_pretrained(out)`"
            " (safetensors).") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise PretrainedLoadError(f"`{path}` holds {type(state).__name__}, not a state dict of tensors. HINT:"
                                  " write the model again with `save_pretrained`.")
    return state


class OpenFiles:
    """Open checkpoint files for a while (one unit); reads flat ranges of tensors. Close to unmap them."""

    def __init__(self, files: CheckpointFiles) -> None:
        self._files = files
        self._open: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        if name not in self._open:
            path = self._files.folder / name
            if self._files.kind == "safetensors":
                from safetensors import safe_open

                self._open[name] = safe_open(str(path), framework="pt")
            else:
                self._open[name] = _load_bin(path)
        return self._open[name]

    def read_flat(self, key: str, start: int, end: int) -> Tensor:
        """Elements [start, end) of checkpoint tensor ``key`` flattened; reads only the rows covering them."""
        info = self._files.tensors[key]
        handle = self._handle(info.file)
        if len(info.shape) == 0:
            whole = handle.get_tensor(key) if self._files.kind == "safetensors" else handle[key]
            return whole.reshape(-1)[start:end]
        row = math.prod(info.shape[1:])
        first, last = start // row, -(-end // row)
        rows = handle.get_slice(key)[first:last] if self._files.kind == "safetensors" else handle[key][first:last]
        return rows.reshape(-1)[start - first * row: end - first * row]

    def close(self) -> None:
        self._open.clear()  # safetensors unmaps a file when its handle goes

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

