"""Checkpoint files: safetensors-format tensor files and the JSON manifest. Storage only: no
Lightning, no torch.distributed. See [Note: checkpoint files] in lzero/checkpoint/__init__.py.

Every refusal is a :class:`CheckpointError` that names the file (or the key inside a tree), says what
is wrong, and ends with a HINT.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import struct
from typing import Any, BinaryIO, Iterable, NamedTuple

import torch
from torch import Tensor

from lzero.errors import ZeroError

MAX_HEADER_BYTES = 100_000_000
"""The safetensors limit; a larger declared header means the file is not a tensor file."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype code -> torch dtype, for every dtype lzero stores."""
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}

DAMAGED = "this checkpoint is incomplete or damaged; resume from an earlier checkpoint"
_FOREIGN = "lzero only reads files it wrote; never point it at a pickle or torch.save file"


class CheckpointError(ZeroError, ValueError):
    """A checkpoint file or value lzero refuses; the message names it and ends with a HINT."""


def refuse(what: str, problem: str, hint: str) -> CheckpointError:
    return CheckpointError(f"`{what}` {problem}. HINT: {hint}.")


# ---------------------------------------------------------------------------------------- tensor files


class TensorEntry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _byte_view(t: Tensor) -> Tensor:
    """The bytes of a contiguous CPU tensor, as a 1-D uint8 tensor sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


class SafetensorsLayout:
    """The header of one file and the order its tensors must be written in."""

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, Any]], metadata: dict[str, str]):
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise refuse(
                path, f"cannot take metadata {metadata!r}", "metadata maps str to str; encode other values first"
            )
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        self.order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in entries:
            shape = tuple(int(n) for n in shape)
            if any(n < 0 for n in shape):
                raise refuse(path, f"cannot hold `{name}` of shape {list(shape)}", "declare non-negative sizes")
            if not isinstance(name, str) or name == "__metadata__" or name in header:
                raise refuse(
                    path,
                    f"cannot hold a tensor named {name!r} (not a str, reserved, or repeated)",
                    "give every tensor its own str name",
                )
            if dtype not in DTYPE_CODES:
                raise refuse(path, f"cannot hold `{name}` of dtype {dtype}",
                             f"convert it to one of {sorted(map(str, DTYPE_CODES))}")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.order.append((name, dtype, shape))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the format allows trailing spaces; they align the data to 8 bytes
        self.header = struct.pack("<Q", len(text)) + text
        self.written = 0
        self.path = path

    def write(self, file: BinaryIO, name: str, tensor: Tensor) -> None:
        if self.written == len(self.order):
            raise refuse(
                self.path,
                f"got tensor `{name}` after every declared tensor was written",
                "declare every tensor up front",
            )
        want, dtype, shape = self.order[self.written]
        t = tensor.detach()
        if name != want:
            raise refuse(
                self.path,
                f"expected tensor `{want}` next, got `{name}`",
                "write tensors in the order they were declared",
            )
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise refuse(
                self.path,
                f"declared `{name}` as {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}",
                "declare the dtype and shape the tensor will have",
            )
        file.write(_byte_view(t.cpu().contiguous()).numpy())
        self.written += 1

    def finish(self, file: BinaryIO) -> None:
        if self.written != len(self.order):
            missing = [n for n, _, _ in self.order[self.written :]]
            raise refuse(
                self.path,
                f"was closed with {len(missing)} declared tensors unwritten ({missing[:3]}...)",
                "write every declared tensor before close()",
            )
        file.flush()
        os.fsync(file.fileno())


def write_tensors(path: str | os.PathLike, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` as one safetensors file at ``path``, in one pass, fsynced; never overwrites.

    Not atomic on its own: a file is trusted only once a manifest naming its save id exists. A value with a
    ``materialize()`` method (and ``dtype``, ``shape``) is materialized only when its turn to be written comes,
    so a writer can stream tensors that are not all in memory at once.
    """
    path = os.fspath(path)
    layout = SafetensorsLayout(path, ((n, t.dtype, t.shape) for n, t in tensors.items()), metadata)
    try:
        file = open(path, "xb")
    except FileExistsError:
        raise refuse(
            path, "already exists", "save into a fresh checkpoint directory, or remove the stale file"
        ) from None
    try:
        with file:
            file.write(layout.header)
            for name, t in tensors.items():
                layout.write(file, name, t.materialize() if hasattr(t, "materialize") else t)
            layout.finish(file)
    except BaseException:
        os.unlink(path)
        raise


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("repeated key")
    return out


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads_json(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no repeated keys. Raises ValueError."""
    return json.loads(raw.decode("utf-8"), object_pairs_hook=_json_pairs, parse_constant=_json_constant)


def is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _parse_header(path: str, raw: bytes) -> tuple[dict[str, str], dict[str, TensorEntry], dict[str, int]]:
    """(metadata, entries, data offsets) of a header, every field checked; the entries must tile the data."""
    try:
        header = _loads_json(raw)
    except ValueError as e:
        raise refuse(path, f"has a header that is not JSON ({e})", DAMAGED) from None
    if not isinstance(header, dict):
        raise refuse(path, f"has a header that is a JSON {type(header).__name__}, not an object", _FOREIGN)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise refuse(path, "has `__metadata__` that is not an object of strings", DAMAGED)
    entries, begins = {}, {}
    for name, spec in header.items():
        entries[name], begins[name] = _parse_entry(path, name, spec)
    end, last = 0, None
    for name in sorted(entries, key=lambda n: (begins[n], entries[n].nbytes)):
        if begins[name] < end:
            raise refuse(path, f"has overlapping entries `{last}` and `{name}`", DAMAGED)
        if begins[name] > end:
            raise refuse(path, f"has unused bytes [{end}, {begins[name]}) before `{name}`", DAMAGED)
        end, last = begins[name] + entries[name].nbytes, name
    return metadata, entries, begins


def _parse_entry(path: str, name: str, spec: Any) -> tuple[TensorEntry, int]:
    """(entry, begin in the data section) of one header entry, every field checked."""

    def bad(problem: str) -> CheckpointError:
        return refuse(path, f"has a bad entry `{name}`: {problem}", DAMAGED)

    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad("expected exactly the keys dtype, shape, data_offsets")
    if spec["dtype"] not in DTYPES:
        raise bad(f"unknown dtype {spec['dtype']!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(is_count(n) for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(n) for n in offsets):
        raise bad(f"data_offsets {offsets!r} is not two non-negative ints")
    nbytes = math.prod(shape) * DTYPES[spec["dtype"]].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise bad(
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, {spec['dtype']} {shape} needs {nbytes}"
        )
    return TensorEntry(DTYPES[spec["dtype"]], tuple(shape), nbytes), offsets[0]


class TensorFile:
    """A safetensors-format file, validated in full on open; tensors are read on demand.

    ``save_id``, when given, must equal ``__metadata__["save_id"]``: a file from another save is refused.
    """

    def __init__(self, path: str | os.PathLike, save_id: str | None = None) -> None:
        self.path = os.fspath(path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise refuse(self.path, "does not exist", DAMAGED) from None
        with f:
            self._size = os.fstat(f.fileno()).st_size
            if self._size < 8:
                raise refuse(
                    self.path, f"is truncated: {self._size} bytes, shorter than the 8-byte header length", DAMAGED
                )
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise refuse(self.path, f"declares a {n}-byte header, more than a tensor file has", _FOREIGN)
            if 8 + n > self._size:
                raise refuse(
                    self.path, f"is truncated: header says {n} header bytes, file has {self._size - 8}", DAMAGED
                )
            raw = f.read(n)
        self._metadata, self._entries, self._begins = _parse_header(self.path, raw)
        self._data_start = 8 + n
        data_end = sum(e.nbytes for e in self._entries.values())
        have = self._size - self._data_start
        if have < data_end:
            raise refuse(self.path, f"is truncated: header says {data_end} data bytes, file has {have}", DAMAGED)
        if have > data_end:
            raise refuse(self.path, f"has {have - data_end} bytes after its last tensor", DAMAGED)
        if save_id is not None and self._metadata.get("save_id") != save_id:
            raise refuse(
                self.path,
                f"belongs to save {self._metadata.get('save_id')!r}, but the manifest is of save {save_id!r}",
                "a save was interrupted and left this file behind; resume from an earlier checkpoint",
            )

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def entry(self, name: str) -> TensorEntry:
        if name not in self._entries:
            some = ", ".join(f"`{n}`" for n in list(self._entries)[:5])
            raise refuse(
                self.path,
                f"has no tensor `{name}` (it has {len(self._entries)}: {some}...)",
                "the manifest and this file disagree; " + DAMAGED,
            )
        return self._entries[name]

    def read(self, name: str) -> Tensor:
        """The whole tensor, in fresh memory."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self._read_into(self._begins[name], _byte_view(out))
        return out

    def read_flat_range(self, name: str, start: int, end: int, out: Tensor | None = None) -> Tensor:
        """Elements [start, end) of the flattened tensor, reading only their bytes; into ``out`` (1-D, contiguous,
        on the CPU, of the tensor's dtype) when given, else into fresh memory."""
        entry = self.entry(name)
        numel = math.prod(entry.shape)
        if not (type(start) is int and type(end) is int and 0 <= start <= end <= numel):
            raise refuse(
                self.path,
                f"cannot give elements [{start}, {end}) of `{name}`, which has {numel}",
                "ask for a range inside [0, numel); the partition metadata and this file disagree",
            )
        if out is None:
            out = torch.empty(end - start, dtype=entry.dtype)
        self._read_into(self._begins[name] + start * entry.dtype.itemsize, _byte_view(out))
        return out

    def _read_into(self, offset: int, buffer: Tensor) -> None:
        view, done = memoryview(buffer.numpy()), 0
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self._size:
                raise refuse(
                    self.path, "changed size since it was opened", "do not write into a checkpoint while loading it"
                )
            f.seek(self._data_start + offset)
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise refuse(self.path, "ended early while reading", DAMAGED)
                done += n


# ----------------------------------------------------------------------------------- manifest & commit


def fsync_dir(directory: str) -> None:
    """Make a rename durable. Some platforms cannot open a directory; there is nothing to do there."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON at ``path`` so that a reader sees the old file or the new one, whole.

    The temporary file is ``.<name>.tmp-<random>`` in the same directory: it never ends in ``.json`` or
    ``.ckpt``, so nothing that scans for checkpoints picks it up.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(6)}")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(obj, f, allow_nan=False, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, (TypeError, ValueError)) and not isinstance(e, CheckpointError):
            raise refuse(
                path, f"cannot be written: the value is not plain JSON ({e})", "encode it with encode_tree() first"
            ) from e
        raise
    fsync_dir(directory)


def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object at ``path`` (``what`` names it in errors, e.g. "manifest"). Never unpickles."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise refuse(
            path, f"does not exist, so there is no {what}", "the save did not finish; resume from an earlier checkpoint"
        ) from None
    if raw[:1] == b"\x80" or raw[:4] == b"PK\x03\x04":
        raise refuse(
            path,
            f"is a pickle or torch.save file, not the JSON {what}",
            _FOREIGN + "; load trusted legacy files with torch.load yourself",
        )
    try:
        obj = _loads_json(raw)
    except ValueError as e:
        raise refuse(path, f"is not a JSON {what} ({str(e)[:200]})", DAMAGED) from None
    if not isinstance(obj, dict):
        raise refuse(path, f"holds a JSON {type(obj).__name__}, not the {what} object", DAMAGED)
    return obj


