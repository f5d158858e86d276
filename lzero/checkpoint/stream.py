"""Streaming writers for consolidated single-file outputs: peak memory near the largest tensor, not
the model. Both write to ``<path>.partial`` and rename on a complete close, so ``path`` never holds
half a file."""

from __future__ import annotations

import collections
import contextlib
import io
import math
import os
import pickle
import sys
import weakref
from typing import Any, BinaryIO, Iterable, NamedTuple

import torch
from torch import Tensor
from typing_extensions import override

from lzero.checkpoint.files import SafetensorsLayout, fsync_dir, refuse
from lzero.checkpoint.tree import cannot_store, join_path



def _commit(file: BinaryIO, partial: str, path: str) -> None:
    file.flush()
    os.fsync(file.fileno())
    file.close()
    os.replace(partial, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class _PartialFile:
    """A file written at ``<path>.partial`` and renamed onto ``path`` only when complete."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._partial = self.path + ".partial"
        self._file: BinaryIO | None = open(self._partial, "wb")

    def _live(self) -> BinaryIO:
        if self._file is None:
            raise refuse(self.path, "is already closed", "create a new writer")
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
        self._layout = SafetensorsLayout(os.fspath(path), entries, metadata)
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
            raise refuse(self.path, f"cannot hold a {t.layout} {t.dtype} tensor", "convert it to a dense tensor")
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
            raise refuse(path or "<root>", "is a tensor stored by another writer", "add() it to this writer")
        return
    if kind in (list, tuple):
        for i, v in enumerate(obj):
            _check_torch_tree(writer, v, join_path(path, i))
        return
    if kind in (dict, collections.OrderedDict):
        for k, v in obj.items():
            if type(k) not in _TORCH_LEAVES:
                raise refuse(join_path(path, k), "has a key that is not a str/int/float/bool/None", "use plain keys")
            _check_torch_tree(writer, v, join_path(path, k))
        return
    if isinstance(obj, Tensor):
        raise refuse(
            path or "<root>", "is a tensor that was not added", "pass writer.add(tensor) instead of the tensor"
        )
    raise cannot_store(path, obj)

