"""A Hugging Face checkpoint folder read by flat ranges: each rank reads only the bytes of its shards.

[Note: reading a pretrained checkpoint into shards]
A unit's flat buffer holds its parameters back to back; a rank owns one contiguous range of it
(partition.py). For every parameter piece in that range, exactly the bytes of those elements are read
from the checkpoint file and converted to the unit's dtype: a rank reads 1/N of the files.

safetensors files are read with lzero's own reader (``TensorFile`` in lzero/checkpoint/files.py: the
header validated whole, a file cut short refused): ``readinto`` straight into the shard's memory when
the dtypes agree, so every byte is touched once. The safetensors library's ``safe_open(...).get_slice``
maps the file instead: its reads are rounded to whole rows, the mapped pages count in the process's
resident memory while the file is open, and each byte costs a page fault on the mapping before the copy.
On a 355M-parameter GPT-2 at world size 2 (benchmarks/README.md, loading), a rank's load took 7.6 s
with 1,350 MB of peak memory growth through ``get_slice`` (with a copy of the shard on the way), and 2.0-5.2 s
with 736 MB (its 710 MB shard) through ``readinto``.

Checkpoint keys are the model's own (``transformer.h.0.attn.c_attn.weight``); the loader finds each
model tensor's key when ``from_pretrained`` runs (pretrained.py), and the engine recognizes the tensors
by identity. ``pytorch_model.bin`` files are read with ``torch.load(weights_only=True, mmap=True)``:
slices of a mapped file, never an unpickled object; a file that needs more than tensors is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lzero.checkpoint.files import CheckpointError, TensorFile
from lzero.errors import ZeroError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


class PretrainedLoadError(ZeroError, RuntimeError):
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
    headers: dict[str, TensorFile] = field(default_factory=dict)  # safetensors: file name -> its parsed header


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
    found = CheckpointFiles(folder, "safetensors")
    for name in files:
        tensor_file = found.headers[name] = _tensor_file(folder / name)  # opens the file per read: no handle kept
        for key in tensor_file.names:
            entry = tensor_file.entry(key)
            found.tensors[key] = TensorInfo(name, entry.dtype, tuple(entry.shape))
    return found


def _tensor_file(path: Path) -> TensorFile:
    """The file's header, validated whole (a short file, a bad header) by lzero's safetensors reader."""
    if not path.is_file():
        raise PretrainedLoadError(f"`{path}` is named by the weight index but does not exist. HINT: copy the whole"
                                  " folder again, or write it again with `save_pretrained`.")
    try:
        return TensorFile(path)
    except CheckpointError as err:
        problem = str(err).split(". HINT:")[0]
        raise PretrainedLoadError(f"{problem}: not a complete safetensors file. HINT: the download or copy was"
                                  " probably cut short: fetch the file again.") from None


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
    """Checkpoint files in use for a while (one unit); reads flat ranges of tensors into given memory. safetensors
    files are read through the headers parsed once by :func:`find_files`; ``.bin`` files are mapped until ``close``."""

    def __init__(self, files: CheckpointFiles) -> None:
        self._files = files
        self._open: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        if self._files.kind == "safetensors":
            return self._files.headers[name]
        if name not in self._open:
            self._open[name] = _load_bin(self._files.folder / name)
        return self._open[name]

    @torch.no_grad()
    def read_flat_into(self, key: str, start: int, end: int, out: Tensor) -> None:
        """Elements [start, end) of checkpoint tensor ``key`` flattened, into ``out`` (1-D, converted to its dtype).
        safetensors: exactly those bytes, read straight into ``out`` where the dtypes and device allow."""
        info = self._files.tensors[key]
        handle = self._handle(info.file)
        if self._files.kind == "bin":
            out.copy_(handle[key].reshape(-1)[start:end])  # a slice of the mapped file
        elif out.dtype == info.dtype and out.device.type == "cpu" and out.is_contiguous():
            handle.read_flat_range(key, start, end, out=out)
        else:
            out.copy_(handle.read_flat_range(key, start, end))

    def close(self) -> None:
        self._open.clear()  # a mapped .bin file is unmapped when its tensors go
