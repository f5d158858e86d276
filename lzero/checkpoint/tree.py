"""A pickle-free codec for everything in a checkpoint that is not a big tensor (loop, callback and
scheduler state, hyperparameters, RNG states): JSON for a fixed list of types, tensors kept aside.
A value outside the list is refused by the path of its key."""

from __future__ import annotations

import argparse
import base64
import collections
import functools
import importlib
import math
import sys
import types
from typing import Any

import torch
from torch import Tensor

from lzero.checkpoint.files import DAMAGED, DTYPE_CODES, CheckpointError, is_count, refuse


_I64 = 2**63
_ATTRIBUTE_DICTS = {
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
}


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def join_path(path: str, key: Any) -> str:
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
                raise refuse(path or "<root>", "contains itself", "break the cycle before saving")
            self._open.add(id(obj))
            try:
                return self._container(obj, path)
            finally:
                self._open.discard(id(obj))
        raise cannot_store(path, obj)

    def _container(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        if kind is list:
            return [self.encode(v, join_path(path, i)) for i, v in enumerate(obj)]
        if kind in (tuple, set, frozenset):
            return {f"@{kind.__name__}": [self.encode(v, join_path(path, i)) for i, v in enumerate(obj)]}
        if kind is argparse.Namespace:
            return {"@namespace": self._container(vars(obj), path)}
        if _qualname(kind) in _ATTRIBUTE_DICTS:
            return {"@attrdict": [_qualname(kind), self._container(dict(obj), path)]}
        pairs = [(self.encode(k, join_path(path, f"<key {k!r}>")), self.encode(v, join_path(path, k)))
                 for k, v in obj.items()]
        if kind is collections.OrderedDict:
            return {"@odict": [list(p) for p in pairs]}
        if all(type(k) is str for k in obj) and not (len(obj) == 1 and next(iter(obj)).startswith("@")):
            return dict(pairs)
        return {"@dict": [list(p) for p in pairs]}

    def _tensor(self, t: Tensor, path: str) -> str:
        if t.dtype not in DTYPE_CODES or t.layout != torch.strided:
            raise refuse(
                path or "<root>",
                f"is a {t.layout} {t.dtype} tensor, which a tensor file cannot hold",
                f"convert it to a dense tensor of one of {sorted(map(str, DTYPE_CODES))}",
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
            raise refuse(path or "<root>", f"is a numpy value of dtype {obj.dtype}", "store plain numeric arrays only")
        if isinstance(obj, numpy.generic):
            return {"@npscalar": [obj.dtype.str, base64.b64encode(obj.tobytes()).decode("ascii")]}
        data = torch.from_numpy(numpy.ascontiguousarray(obj).reshape(-1).view(numpy.uint8).copy())
        return {"@ndarray": {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": self._store(data, path)}}


def cannot_store(path: str, obj: Any) -> CheckpointError:
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
        return refuse(self.source, f"has a bad value at `{path or '<root>'}`: {problem}", DAMAGED)

    def decode(self, obj: Any, path: str) -> Any:
        if obj is None or type(obj) in (bool, int, float, str):
            return obj
        if type(obj) is list:
            return [self.decode(v, join_path(path, i)) for i, v in enumerate(obj)]
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
        return {k: self.decode(v, join_path(path, k)) for k, v in obj.items()}

    def _pairs(self, payload: Any, path: str) -> list[tuple[Any, Any]]:
        out = []
        for pair in _expect(payload, list):
            if type(pair) is not list or len(pair) != 2:
                raise self.fail(path, f"{pair!r} is not a [key, value] pair")
            key = self.decode(pair[0], path)
            hash(key)  # a TypeError for an unhashable key
            out.append((key, self.decode(pair[1], join_path(path, key))))
        return out

    def _tagged(self, tag: str, payload: Any, path: str) -> Any:
        if tag == "@float" and payload in ("nan", "inf", "-inf"):
            return float(payload)
        if tag == "@int":
            return int(_expect(payload, str))
        if tag == "@bytes":
            return base64.b64decode(_expect(payload, str), validate=True)
        if tag in ("@tuple", "@set", "@frozenset"):
            items = [self.decode(v, join_path(path, i)) for i, v in enumerate(_expect(payload, list))]
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
            not all(is_count(n) for n in shape)
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


