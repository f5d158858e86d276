"""Checkpoint files: safetensors-format tensor files, a pickle-free tree codec, an atomic JSON
manifest, and streaming writers for consolidated single-file outputs.

Storage only: no Lightning, no torch.distributed. Every refusal is a :class:`CheckpointError` that
names the file (or the key inside a tree), says what is wrong, and ends with a HINT.

[Note: checkpoint files]
A checkpoint is a directory (``epoch=0-step=100.ckpt/``). Every rank writes its own shard files with
:func:`write_tensors`, then rank 0 writes the manifest with :func:`write_json_atomic`. The manifest is
the commit: a directory without one is a save that did not finish. Every file carries the id of the
save that wrote it (``__metadata__["save_id"]`` in a tensor file, checked by :class:`TensorFile`), and
the manifest names that id, so a shard left over from another or an interrupted save is refused
rather than silently mixed in.

Loading never unpickles. Stock ``torch.distributed.checkpoint`` (DCP) does: ``FileSystemReader.
read_metadata`` calls ``pickle.load`` on ``.metadata``, and ``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)`` on every non-tensor item, so opening a DCP checkpoint from an
untrusted place runs whatever code it holds. Here tensors live in safetensors-format files (8-byte
little-endian header length, a JSON header, raw little-endian bytes): the header is validated in full
before a data byte is read, one tensor or one flat range of it is read with a single seek (a rank at a
new world size reads only its part of another rank's shard), and the files open with the
``safetensors`` package and other tools without lzero. The format is implemented here rather than
imported because it is a page long and lzero adds no dependency. Everything that is not a big tensor
(loop, callback and scheduler state, hyperparameters, RNG states) goes through :func:`encode_tree`, a
JSON codec for a fixed list of types that refuses the rest by the key's path; its tensors are written
to a tensor file like any other. Hosts are assumed little-endian, as every platform torch ships for is.

The consolidated outputs are streamed so that peak memory is near the largest tensor, not the model:
:class:`SafetensorsStreamWriter` writes the header from declared entries up front, and
:class:`TorchStreamWriter` writes each storage into torch's zip format as it arrives and the pickle
of the nesting last (a file ``torch.load(weights_only=True)`` reads). Both write to ``<path>.partial``
and rename on a complete close, so ``path`` never holds half a file.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import functools
import importlib
import io
import json
import math
import os
import pickle
import secrets
import struct
import sys
import types
import weakref
from typing import Any, BinaryIO, Iterable, NamedTuple

import torch
from torch import Tensor
from typing_extensions import override

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
_CODES = {dtype: code for code, dtype in DTYPES.items()}

_DAMAGED = "this checkpoint is incomplete or damaged; resume from an earlier checkpoint"
_FOREIGN = "lzero only reads files it wrote; never point it at a pickle or torch.save file"


class CheckpointError(ValueError):
    """A checkpoint file or value lzero refuses; the message names it and ends with a HINT."""


def _refuse(what: str, problem: str, hint: str) -> CheckpointError:
    return CheckpointError(f"`{what}` {problem}. HINT: {hint}.")


# ---------------------------------------------------------------------------------------- tensor files


class TensorEntry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _byte_view(t: Tensor) -> Tensor:
    """The bytes of a contiguous CPU tensor, as a 1-D uint8 tensor sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


class _SafetensorsLayout:
    """The header of one file and the order its tensors must be written in."""

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, Any]], metadata: dict[str, str]):
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise _refuse(
                path, f"cannot take metadata {metadata!r}", "metadata maps str to str; encode other values first"
            )
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        self.order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in entries:
            shape = tuple(int(n) for n in shape)
            if any(n < 0 for n in shape):
                raise _refuse(path, f"cannot hold `{name}` of shape {list(shape)}", "declare non-negative sizes")
            if not isinstance(name, str) or name == "__metadata__" or name in header:
                raise _refuse(
                    path,
                    f"cannot hold a tensor named {name!r} (not a str, reserved, or repeated)",
                    "give every tensor its own str name",
                )
            if dtype not in _CODES:
                raise _refuse(
                    path, f"cannot hold `{name}` of dtype {dtype}", f"convert it to one of {sorted(map(str, _CODES))}"
                )
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.order.append((name, dtype, shape))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the format allows trailing spaces; they align the data to 8 bytes
        self.header = struct.pack("<Q", len(text)) + text
        self.written = 0
        self.path = path

    def write(self, file: BinaryIO, name: str, tensor: Tensor) -> None:
        if self.written == len(self.order):
            raise _refuse(
                self.path,
                f"got tensor `{name}` after every declared tensor was written",
                "declare every tensor up front",
            )
        want, dtype, shape = self.order[self.written]
        t = tensor.detach()
        if name != want:
            raise _refuse(
                self.path,
                f"expected tensor `{want}` next, got `{name}`",
                "write tensors in the order they were declared",
            )
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise _refuse(
                self.path,
                f"declared `{name}` as {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}",
                "declare the dtype and shape the tensor will have",
            )
        file.write(_byte_view(t.cpu().contiguous()).numpy())
        self.written += 1

    def finish(self, file: BinaryIO) -> None:
        if self.written != len(self.order):
            missing = [n for n, _, _ in self.order[self.written :]]
            raise _refuse(
                self.path,
                f"was closed with {len(missing)} declared tensors unwritten ({missing[:3]}...)",
                "write every declared tensor before close()",
            )
        file.flush()
        os.fsync(file.fileno())


def write_tensors(path: str | os.PathLike, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` as one safetensors file at ``path``, in one pass, fsynced; never overwrites.

    Not atomic on its own: a file is trusted only once a manifest naming its save id exists.
    """
    path = os.fspath(path)
    layout = _SafetensorsLayout(path, ((n, t.dtype, t.shape) for n, t in tensors.items()), metadata)
    try:
        file = open(path, "xb")
    except FileExistsError:
        raise _refuse(
            path, "already exists", "save into a fresh checkpoint directory, or remove the stale file"
        ) from None
    try:
        with file:
            file.write(layout.header)
            for name, t in tensors.items():
                layout.write(file, name, t)
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


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _parse_header(path: str, raw: bytes) -> tuple[dict[str, str], dict[str, TensorEntry], dict[str, int]]:
    """(metadata, entries, data offsets) of a header, every field checked; the entries must tile the data."""
    try:
        header = _loads_json(raw)
    except ValueError as e:
        raise _refuse(path, f"has a header that is not JSON ({e})", _DAMAGED) from None
    if not isinstance(header, dict):
        raise _refuse(path, f"has a header that is a JSON {type(header).__name__}, not an object", _FOREIGN)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _refuse(path, "has `__metadata__` that is not an object of strings", _DAMAGED)
    entries, begins = {}, {}
    for name, spec in header.items():
        entries[name], begins[name] = _parse_entry(path, name, spec)
    end, last = 0, None
    for name in sorted(entries, key=lambda n: (begins[n], entries[n].nbytes)):
        if begins[name] < end:
            raise _refuse(path, f"has overlapping entries `{last}` and `{name}`", _DAMAGED)
        if begins[name] > end:
            raise _refuse(path, f"has unused bytes [{end}, {begins[name]}) before `{name}`", _DAMAGED)
        end, last = begins[name] + entries[name].nbytes, name
    return metadata, entries, begins


def _parse_entry(path: str, name: str, spec: Any) -> tuple[TensorEntry, int]:
    """(entry, begin in the data section) of one header entry, every field checked."""

    def bad(problem: str) -> CheckpointError:
        return _refuse(path, f"has a bad entry `{name}`: {problem}", _DAMAGED)

    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad("expected exactly the keys dtype, shape, data_offsets")
    if spec["dtype"] not in DTYPES:
        raise bad(f"unknown dtype {spec['dtype']!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
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
            raise _refuse(self.path, "does not exist", _DAMAGED) from None
        with f:
            self._size = os.fstat(f.fileno()).st_size
            if self._size < 8:
                raise _refuse(
                    self.path, f"is truncated: {self._size} bytes, shorter than the 8-byte header length", _DAMAGED
                )
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise _refuse(self.path, f"declares a {n}-byte header, more than a tensor file has", _FOREIGN)
            if 8 + n > self._size:
                raise _refuse(
                    self.path, f"is truncated: header says {n} header bytes, file has {self._size - 8}", _DAMAGED
                )
            raw = f.read(n)
        self._metadata, self._entries, self._begins = _parse_header(self.path, raw)
        self._data_start = 8 + n
        data_end = sum(e.nbytes for e in self._entries.values())
        have = self._size - self._data_start
        if have < data_end:
            raise _refuse(self.path, f"is truncated: header says {data_end} data bytes, file has {have}", _DAMAGED)
        if have > data_end:
            raise _refuse(self.path, f"has {have - data_end} bytes after its last tensor", _DAMAGED)
        if save_id is not None and self._metadata.get("save_id") != save_id:
            raise _refuse(
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
            raise _refuse(
                self.path,
                f"has no tensor `{name}` (it has {len(self._entries)}: {some}...)",
                "the manifest and this file disagree; " + _DAMAGED,
            )
        return self._entries[name]

    def read(self, name: str) -> Tensor:
        """The whole tensor, in fresh memory."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self._read_into(self._begins[name], _byte_view(out))
        return out

    def read_flat_range(self, name: str, start: int, end: int) -> Tensor:
        """Elements [start, end) of the flattened tensor, reading only their bytes."""
        entry = self.entry(name)
        numel = math.prod(entry.shape)
        if not (type(start) is int and type(end) is int and 0 <= start <= end <= numel):
            raise _refuse(
                self.path,
                f"cannot give elements [{start}, {end}) of `{name}`, which has {numel}",
                "ask for a range inside [0, numel); the partition metadata and this file disagree",
            )
        out = torch.empty(end - start, dtype=entry.dtype)
        self._read_into(self._begins[name] + start * entry.dtype.itemsize, _byte_view(out))
        return out

    def _read_into(self, offset: int, buffer: Tensor) -> None:
        view, done = memoryview(buffer.numpy()), 0
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self._size:
                raise _refuse(
                    self.path, "changed size since it was opened", "do not write into a checkpoint while loading it"
                )
            f.seek(self._data_start + offset)
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise _refuse(self.path, "ended early while reading", _DAMAGED)
                done += n


# ------------------------------------------------------------------------------------------ tree codec

_I64 = 2**63
_ATTRIBUTE_DICTS = {
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
}


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _join(path: str, key: Any) -> str:
    key = key if isinstance(key, str) else repr(key)
    return f"{path}.{key}" if path else key


def encode_tree(obj: Any) -> tuple[Any, dict[str, Tensor]]:
    """(plain JSON, tensors) for ``obj``; :func:`decode_tree` gives ``obj`` back, exactly.

    Stored as themselves: None, bool, str, finite float, int in [-2**63, 2**63) and lists; dicts whose
    keys are all str (unless the only key starts with "@"). Everything else becomes a one-key object
    ``{"@tag": payload}``: ``@float`` (nan/inf), ``@int`` (larger ints, as decimal text), ``@bytes``
    (base64), ``@tuple``, ``@set``, ``@frozenset``, ``@dict`` and ``@odict`` (key/value pairs, keys of any
    type above), ``@namespace`` (argparse), ``@attrdict`` (Lightning's AttributeDict, imported only when
    decoded), ``@dtype``, ``@device``, ``@tensor`` (a key of ``tensors``), ``@ndarray`` (dtype, shape and
    a uint8 tensor of its bytes) and ``@npscalar``.

    Only exact types are accepted (an IntEnum or a namedtuple is refused, not flattened), except that
    other dict subclasses come back as plain dicts. Tensors come back as stored in ``tensors``
    (detached; on CPU after a file round trip); the same tensor at two places is stored once and comes
    back as one tensor. Functions, classes and other objects raise :class:`CheckpointError` naming the
    key's path. Tensor keys are those paths, made unique.
    """
    encoder = _Encoder()
    return encoder.encode(obj, ""), encoder.tensors


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self._tensor_keys: dict[int, tuple[Tensor, str]] = {}
        self._open: set[int] = set()  # containers on the current path, to refuse cycles

    def encode(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        numpy = sys.modules.get("numpy")  # a numpy value cannot exist unless numpy was imported
        if numpy is not None and isinstance(obj, (numpy.ndarray, numpy.generic)):
            return self._numpy(numpy, obj, path)
        if obj is None or kind in (bool, str):
            return obj
        if kind is int:
            return obj if -_I64 <= obj < _I64 else {"@int": str(obj)}
        if kind is float:
            return obj if math.isfinite(obj) else {"@float": repr(obj)}
        if kind is bytes:
            return {"@bytes": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, Tensor):
            return {"@tensor": self._tensor(obj, path)}
        if kind is torch.dtype:
            return {"@dtype": str(obj).removeprefix("torch.")}
        if kind is torch.device:
            return {"@device": str(obj)}
        if kind in (list, tuple, set, frozenset, argparse.Namespace) or isinstance(obj, dict):
            if id(obj) in self._open:
                raise _refuse(path or "<root>", "contains itself", "break the cycle before saving")
            self._open.add(id(obj))
            try:
                return self._container(obj, path)
            finally:
                self._open.discard(id(obj))
        raise _cannot_store(path, obj)

    def _container(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        if kind is list:
            return [self.encode(v, _join(path, i)) for i, v in enumerate(obj)]
        if kind in (tuple, set, frozenset):
            return {f"@{kind.__name__}": [self.encode(v, _join(path, i)) for i, v in enumerate(obj)]}
        if kind is argparse.Namespace:
            return {"@namespace": self._container(vars(obj), path)}
        if _qualname(kind) in _ATTRIBUTE_DICTS:
            return {"@attrdict": [_qualname(kind), self._container(dict(obj), path)]}
        pairs = [(self.encode(k, _join(path, f"<key {k!r}>")), self.encode(v, _join(path, k))) for k, v in obj.items()]
        if kind is collections.OrderedDict:
            return {"@odict": [list(p) for p in pairs]}
        if all(type(k) is str for k in obj) and not (len(obj) == 1 and next(iter(obj)).startswith("@")):
            return dict(pairs)
        return {"@dict": [list(p) for p in pairs]}

    def _tensor(self, t: Tensor, path: str) -> str:
        if t.dtype not in _CODES or t.layout != torch.strided:
            raise _refuse(
                path or "<root>",
                f"is a {t.layout} {t.dtype} tensor, which a tensor file cannot hold",
                f"convert it to a dense tensor of one of {sorted(map(str, _CODES))}",
            )
        if id(t) not in self._tensor_keys:  # keeps t alive, so its id is not reused while encoding
            self._tensor_keys[id(t)] = (t, self._store(t.detach(), path))
        return self._tensor_keys[id(t)][1]

    def _store(self, t: Tensor, path: str) -> str:
        key, n = path or "<root>", 0
        while key in self.tensors:
            n += 1
            key = f"{path}#{n}"
        self.tensors[key] = t
        return key

    def _numpy(self, numpy: Any, obj: Any, path: str) -> Any:
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise _refuse(path or "<root>", f"is a numpy value of dtype {obj.dtype}", "store plain numeric arrays only")
        if isinstance(obj, numpy.generic):
            return {"@npscalar": [obj.dtype.str, base64.b64encode(obj.tobytes()).decode("ascii")]}
        data = torch.from_numpy(numpy.ascontiguousarray(obj).reshape(-1).view(numpy.uint8).copy())
        return {"@ndarray": {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": self._store(data, path)}}


def _cannot_store(path: str, obj: Any) -> CheckpointError:
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        what = "a function"
    elif isinstance(obj, type):
        what = f"the class {_qualname(obj)}"
    else:
        what = f"a {_qualname(type(obj)).removeprefix('builtins.')}"
    return CheckpointError(
        f"cannot store `{path or '<root>'}` ({what}) without pickle. HINT: store a string/number instead, "
        "or drop it (for hyperparameters: save_hyperparameters(ignore=[...]))."
    )


def decode_tree(encoded: Any, tensors: dict[str, Tensor], *, source: str = "checkpoint") -> Any:
    """The object :func:`encode_tree` encoded. Builds only the types listed there, never imports code
    named by the data; ``source`` (a file name) is named in errors."""
    return _Decoder(tensors, source).decode(encoded, "")


class _Decoder:
    def __init__(self, tensors: dict[str, Tensor], source: str) -> None:
        self.tensors, self.source = tensors, source

    def fail(self, path: str, problem: str) -> CheckpointError:
        return _refuse(self.source, f"has a bad value at `{path or '<root>'}`: {problem}", _DAMAGED)

    def decode(self, obj: Any, path: str) -> Any:
        if obj is None or type(obj) in (bool, int, float, str):
            return obj
        if type(obj) is list:
            return [self.decode(v, _join(path, i)) for i, v in enumerate(obj)]
        if type(obj) is not dict:
            raise self.fail(path, f"a {type(obj).__name__} is not JSON")
        if len(obj) == 1 and next(iter(obj)).startswith("@"):
            ((tag, payload),) = obj.items()
            try:
                return self._tagged(tag, payload, path)
            except (TypeError, ValueError, KeyError, RuntimeError) as e:
                if isinstance(e, CheckpointError):
                    raise
                raise self.fail(path, f"cannot decode {tag} {str(payload)[:80]!r} ({type(e).__name__}: {e})") from None
        return {k: self.decode(v, _join(path, k)) for k, v in obj.items()}

    def _pairs(self, payload: Any, path: str) -> list[tuple[Any, Any]]:
        out = []
        for pair in _expect(payload, list):
            if type(pair) is not list or len(pair) != 2:
                raise self.fail(path, f"{pair!r} is not a [key, value] pair")
            key = self.decode(pair[0], path)
            hash(key)  # a TypeError for an unhashable key
            out.append((key, self.decode(pair[1], _join(path, key))))
        return out

    def _tagged(self, tag: str, payload: Any, path: str) -> Any:
        if tag == "@float" and payload in ("nan", "inf", "-inf"):
            return float(payload)
        if tag == "@int":
            return int(_expect(payload, str))
        if tag == "@bytes":
            return base64.b64decode(_expect(payload, str), validate=True)
        if tag in ("@tuple", "@set", "@frozenset"):
            items = [self.decode(v, _join(path, i)) for i, v in enumerate(_expect(payload, list))]
            return {"@tuple": tuple, "@set": set, "@frozenset": frozenset}[tag](items)
        if tag == "@dict":
            return dict(self._pairs(payload, path))
        if tag == "@odict":
            return collections.OrderedDict(self._pairs(payload, path))
        if tag == "@namespace":
            return argparse.Namespace(**_expect(self.decode(payload, path), dict))
        if tag == "@attrdict":
            name, items = _expect(payload, list)
            return _attribute_dict(_expect(name, str))(_expect(self.decode(items, path), dict))
        if tag == "@dtype" and _expect(payload, str) in _torch_dtypes():
            return _torch_dtypes()[payload]
        if tag == "@device":
            return torch.device(_expect(payload, str))
        if tag == "@tensor":
            if _expect(payload, str) not in self.tensors:
                raise self.fail(path, f"tensor `{payload}` is missing from the tensor file")
            return self.tensors[payload]
        if tag == "@ndarray":
            return self._ndarray(_expect(payload, dict), path)
        if tag == "@npscalar":
            import numpy

            dtype, data = _expect(payload, list)
            raw = base64.b64decode(_expect(data, str), validate=True)
            return numpy.frombuffer(raw, dtype=_plain_numpy_dtype(numpy, dtype))[0]
        raise self.fail(path, f"unknown tag {tag} (or a bad payload {str(payload)[:80]!r})")

    def _ndarray(self, payload: dict[str, Any], path: str) -> Any:
        import numpy

        dtype = _plain_numpy_dtype(numpy, payload["dtype"])
        shape = _expect(payload["shape"], list)
        data = self._tagged("@tensor", payload["data"], path)
        if (
            not all(_is_count(n) for n in shape)
            or data.dtype != torch.uint8
            or data.numel() != math.prod(shape) * dtype.itemsize
        ):
            raise self.fail(path, f"{data.numel()} bytes cannot be a {dtype} array of shape {shape}")
        return data.numpy().copy().view(dtype).reshape(shape)


def _expect(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected a {kind.__name__}, got {type(value).__name__}")
    return value


def _plain_numpy_dtype(numpy: Any, text: Any) -> Any:
    dtype = numpy.dtype(_expect(text, str))
    if dtype.hasobject or dtype.fields is not None:
        raise ValueError(f"numpy dtype {dtype} holds objects or fields")
    return dtype


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    return {name: d for name, d in vars(torch).items() if isinstance(d, torch.dtype)}


def _attribute_dict(name: str) -> type:
    """The AttributeDict class ``name`` if its package is installed, else dict. Imports only names
    from a fixed list."""
    if name not in _ATTRIBUTE_DICTS:
        raise ValueError(f"{name} is not a known AttributeDict")
    module, _, cls = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError:
        return dict


# ----------------------------------------------------------------------------------- manifest & commit


def _fsync_dir(directory: str) -> None:
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
            raise _refuse(
                path, f"cannot be written: the value is not plain JSON ({e})", "encode it with encode_tree() first"
            ) from e
        raise
    _fsync_dir(directory)


def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object at ``path`` (``what`` names it in errors, e.g. "manifest"). Never unpickles."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise _refuse(
            path, f"does not exist, so there is no {what}", "the save did not finish; resume from an earlier checkpoint"
        ) from None
    if raw[:1] == b"\x80" or raw[:4] == b"PK\x03\x04":
        raise _refuse(
            path,
            f"is a pickle or torch.save file, not the JSON {what}",
            _FOREIGN + "; load trusted legacy files with torch.load yourself",
        )
    try:
        obj = _loads_json(raw)
    except ValueError as e:
        raise _refuse(path, f"is not a JSON {what} ({str(e)[:200]})", _DAMAGED) from None
    if not isinstance(obj, dict):
        raise _refuse(path, f"holds a JSON {type(obj).__name__}, not the {what} object", _DAMAGED)
    return obj


# ---------------------------------------------------------------------------------- streaming writers


def _commit(file: BinaryIO, partial: str, path: str) -> None:
    file.flush()
    os.fsync(file.fileno())
    file.close()
    os.replace(partial, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


class _PartialFile:
    """A file written at ``<path>.partial`` and renamed onto ``path`` only when complete."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._partial = self.path + ".partial"
        self._file: BinaryIO | None = open(self._partial, "wb")

    def _live(self) -> BinaryIO:
        if self._file is None:
            raise _refuse(self.path, "is already closed", "create a new writer")
        return self._file

    def _commit(self) -> None:
        _commit(self._live(), self._partial, self.path)
        self._file = None

    def abort(self) -> None:
        """Drop what was written; ``path`` is left as it was."""
        if self._file is not None:
            self._file.close()
            self._file = None
            os.unlink(self._partial)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            self.abort()


class SafetensorsStreamWriter(_PartialFile):
    """A safetensors file written tensor by tensor, in the order ``entries`` declares them.

    Use as a context manager: a clean exit closes (and refuses if a tensor is missing), an exception
    aborts. ``path`` is replaced atomically if it exists.
    """

    def __init__(
        self, path: str | os.PathLike, entries: Iterable[tuple[str, torch.dtype, Any]], metadata: dict[str, str]
    ) -> None:
        self._layout = _SafetensorsLayout(os.fspath(path), entries, metadata)
        super().__init__(path)
        self._live().write(self._layout.header)

    def write(self, name: str, tensor: Tensor) -> None:
        self._layout.write(self._live(), name, tensor)

    def close(self) -> None:
        self._layout.finish(self._live())
        self._commit()

    @override
    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None and self._file is not None:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise
        super().__exit__(kind, *rest)


class StoredTensor:
    """A tensor a :class:`TorchStreamWriter` has written; place it in the object given to ``close``."""

    __slots__ = ("key", "dtype", "shape", "owner")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], owner: "TorchStreamWriter") -> None:
        self.key, self.dtype, self.shape, self.owner = key, dtype, shape, owner

    def __repr__(self) -> str:
        return f"StoredTensor(key={self.key!r}, dtype={self.dtype}, shape={list(self.shape)})"


class _StorageRef(NamedTuple):
    key: str
    dtype: torch.dtype
    numel: int


class _TorchPickler(pickle.Pickler):
    """torch.save's pickle: a tensor is ``_rebuild_tensor_v2(storage, 0, shape, stride, False, {})``
    and a storage the persistent id ``("storage", <dtype>Storage, key, "cpu", numel)``."""

    @override
    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageRef:
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None

    @override
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not StoredTensor:
            return NotImplemented
        stride = torch.empty(obj.shape, device="meta").stride()
        storage = _StorageRef(obj.key, obj.dtype, math.prod(obj.shape))
        return torch._utils._rebuild_tensor_v2, (storage, 0, obj.shape, stride, False, collections.OrderedDict())


class TorchStreamWriter(_PartialFile):
    """A file ``torch.load(path, weights_only=True)`` reads, written one tensor at a time.

    ``add(tensor)`` writes the tensor's bytes at once and returns a :class:`StoredTensor`;
    ``close(obj)`` writes ``obj`` (nested dict/OrderedDict/list/tuple of str/int/float/bool/None and
    StoredTensors) and commits. Adding the same tensor again, or another tensor object with the same
    storage, offset, shape and stride (tied weights from ``state_dict()``) while the first is alive,
    returns the first StoredTensor: it is written once and loads back as one tensor. As a context
    manager, leaving without ``close`` (an exception, or a forgotten call) leaves nothing at ``path``.

    Records: ``data/<key>`` per tensor as it is added, then ``data.pkl``; ``.format_version``,
    ``.storage_alignment`` and ``byteorder`` as torch.save writes them; the zip writer adds ``version``
    and ``.data/serialization_id``. torch.save writes ``data.pkl`` first, torch.load finds records by
    name. Relies on torch internals (``torch._C.PyTorchFileWriter``, ``torch._utils._rebuild_tensor_v2``).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from torch.serialization import _get_storage_alignment, get_crc32_options

        super().__init__(path)
        alignment = str(_get_storage_alignment())
        self._zip: Any = torch._C.PyTorchFileWriter(self._live(), get_crc32_options(), int(alignment))
        for name, value in ((".format_version", "1"), (".storage_alignment", alignment), ("byteorder", sys.byteorder)):
            self._zip.write_record(name, value, len(value))
        self._ties: dict[tuple, tuple[weakref.ref, StoredTensor]] = {}
        self._count = 0

    def add(self, tensor: Tensor) -> StoredTensor:
        t = tensor.detach()
        if t.dtype not in torch.storage._dtype_to_storage_type_map() or t.layout != torch.strided:
            raise _refuse(self.path, f"cannot hold a {t.layout} {t.dtype} tensor", "convert it to a dense tensor")
        tie = (t.device, t.untyped_storage().data_ptr(), t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
        known = self._ties.get(tie)
        if known is not None and known[0]() is not None:
            return known[1]
        stored = StoredTensor(str(self._count), t.dtype, tuple(t.shape), self)
        self._count += 1
        if t.untyped_storage().nbytes():  # empty tensors share nothing, so they are never ties
            with contextlib.suppress(TypeError):  # a tensor that takes no weakref gets no ties
                self._ties[tie] = (weakref.ref(tensor), stored)
        t = t.cpu()
        if not t.is_contiguous() or t.storage_offset() != 0:
            t = t.clone(memory_format=torch.contiguous_format)
        self._live_zip().write_record(f"data/{stored.key}", t.untyped_storage(), t.nbytes)
        return stored

    def close(self, obj: Any) -> None:
        _check_torch_tree(self, obj, "")
        buffer = io.BytesIO()
        _TorchPickler(buffer, protocol=2).dump(obj)  # torch.save's default protocol
        data = buffer.getvalue()
        zip_writer = self._live_zip()
        zip_writer.write_record("data.pkl", data, len(data))
        zip_writer.write_end_of_file()
        self._zip = None
        self._commit()

    @override
    def abort(self) -> None:
        self._zip = None  # the zip writer finishes its records into the file before it is dropped
        super().abort()

    @override
    def __exit__(self, *_: Any) -> None:
        self.abort()  # a no-op after close(); otherwise the file was never finished

    def _live_zip(self) -> Any:
        self._live()
        return self._zip


_TORCH_LEAVES = (str, int, float, bool, type(None))


def _check_torch_tree(writer: TorchStreamWriter, obj: Any, path: str) -> None:
    """Refuse, by path, anything ``torch.load(weights_only=True)`` would not read back as written."""
    kind = type(obj)
    if kind in _TORCH_LEAVES:
        return
    if kind is StoredTensor:
        if obj.owner is not writer:
            raise _refuse(path or "<root>", "is a tensor stored by another writer", "add() it to this writer")
        return
    if kind in (list, tuple):
        for i, v in enumerate(obj):
            _check_torch_tree(writer, v, _join(path, i))
        return
    if kind in (dict, collections.OrderedDict):
        for k, v in obj.items():
            if type(k) not in _TORCH_LEAVES:
                raise _refuse(_join(path, k), "has a key that is not a str/int/float/bool/None", "use plain keys")
            _check_torch_tree(writer, v, _join(path, k))
        return
    if isinstance(obj, Tensor):
        raise _refuse(
            path or "<root>", "is a tensor that was not added", "pass writer.add(tensor) instead of the tensor"
        )
    raise _cannot_store(path, obj)
