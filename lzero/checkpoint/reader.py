"""lzero's own committed sharded checkpoint directory, read by pieces (:class:`ShardedCheckpoint`: the manifest,
every shard file's header, and any flat range of any saved tensor; the reading by pieces is pieces.py's). Storage only
(no Lightning, no torch.distributed, nothing of the engine), so ``lzero consolidate`` / ``lzero inspect`` and any tool
can open a checkpoint without a process group. The layout is described in [Note: sharded checkpoint layout] in
sharded.py; formats.py opens a directory in whichever format it holds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Collection, Optional

from torch import Tensor

from lzero.checkpoint.base_files import (BaseTensor, base_pieces, check_record, state_again, state_keys,
                                         state_layout, whole_tensor)
from lzero.checkpoint.files import CheckpointError, TensorFile, read_json
from lzero.checkpoint.pieces import Piece, PiecedCheckpoint, param_of, prefix_renaming, whole_pieces
from lzero.checkpoint.tree import decode_tree
from lzero.engine.tensor_layout import layout_of

FORMAT = "lzero-sharded"
VERSION = 1
MANIFEST = "manifest.json"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a committed lzero sharded checkpoint: a directory holding its :data:`MANIFEST` (the last
    file a save writes). Whether it is also whole, :class:`ShardedCheckpoint` checks on open."""
    return (Path(path) / MANIFEST).is_file()


_SAVE_ID = re.compile(r"[0-9A-Za-z_]{1,64}")
_FILE_NAME = re.compile(r"shard-[0-9A-Za-z_]{1,64}-r\d{5}-of-\d{5}\.safetensors")  # never a path elsewhere


def shard_name(save_id: str, rank: int, world_size: int) -> str:
    return f"shard-{save_id}-r{rank:05d}-of-{world_size:05d}.safetensors"


class _FileEntry:
    """One tensor of a shard file, as a piece's source."""

    def __init__(self, file: TensorFile, key: str) -> None:
        self.file, self.key = file, key

    def read_flat_range(self, start: int, end: int) -> Tensor:
        return self.file.read_flat_range(self.key, start, end)


class ShardedCheckpoint(PiecedCheckpoint):
    """A committed sharded checkpoint, validated in full on open (manifest, every file's header, size
    and save id, and that the pieces of every parameter cover it), before any tensor is read. ``names``: the
    module's parameter names; one imported from DeepSpeed (:attr:`from_deepspeed`) is read under them when its names
    differ from them by one prefix, as the DeepSpeed folder itself is."""

    def __init__(self, path: Any, names: Optional[Collection[str]] = None) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise CheckpointError(
                f"`{self.path}` has no {MANIFEST}: it is not an lzero checkpoint, or its save never finished."
                " HINT: resume from an earlier checkpoint; an interrupted save is cleaned up by the next one."
            )
        self.manifest = read_json(manifest_path, "checkpoint manifest")
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT \
                or self.manifest.get("version") != VERSION:
            raise CheckpointError(f"`{manifest_path}` is not an {FORMAT} v{VERSION} manifest."
                                  " HINT: it was written by another tool or a newer lzero.")
        _check_manifest(self.manifest, manifest_path)
        self.save_id = self.manifest["save_id"]
        self._rename = prefix_renaming(list(self.manifest["params"]), set(names)) \
            if names is not None and self.from_deepspeed else None
        """A saved name -> the module's name; None: the same."""
        if self._rename is not None:
            self.manifest = _renamed_manifest(self.manifest, self._rename)
        self._common: Optional[dict[str, Any]] = None
        self.base: dict[str, BaseTensor] = {}
        """The parameters this checkpoint reads from pretrained files (:mod:`lzero.checkpoint.base_files`)."""
        self.files: list[TensorFile] = []
        for entry in self.manifest["files"]:
            file = TensorFile(self.path / entry["name"], save_id=self.save_id)
            size = os.stat(file.path).st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"`{file.path}` has {size} bytes, the manifest says {entry['bytes']}."
                                      " HINT: this checkpoint is damaged; resume from an earlier one.")
            self.files.append(file)
        pieces: dict[str, list[Piece]] = defaultdict(list)
        scalars: dict[str, Callable[[], Tensor]] = {}
        tensor = self.manifest.get("tensor_parallel")  # see [Note: tensor-parallel checkpoints] in tensor_layout.py
        layouts = {name: layout_of(record, tensor["size"], self.manifest["params"][name]["shape"])
                   for name, record in tensor["params"].items()} if tensor else {}
        for entry, file in zip(self.manifest["files"], self.files):
            tensor_rank = entry["rank"] % tensor["size"] if tensor else 0
            for saved_key, span in json.loads(file.metadata["pieces"]).items():
                key = _renamed_key(saved_key, self._rename) if self._rename else saved_key
                if span is None:
                    scalars.setdefault(key, functools.partial(file.read, saved_key))
                    continue
                piece = Piece(span[0], span[1], _FileEntry(file, saved_key))
                layout = layouts.get(param_of(key))
                pieces[key].extend([piece] if layout is None else whole_pieces(piece, layout, tensor_rank))
        self._state_keys: dict[str, tuple[str, str]] = {}
        self._whole: dict[str, tuple[BaseTensor, str]] = {}  # state key -> a whole frozen tensor's file, its hash
        self._states: dict[str, dict[str, Tensor]] = {}  # a weight's quantization state computed again
        if "base" in self.manifest:  # the frozen base, read from its pretrained files: see base_files.py
            self.base, self._whole = check_record(self.manifest["base"], manifest_path)
            self._state_keys = state_keys(self.base)
            for key, found in base_pieces(self.base, self.manifest["params"]).items():
                pieces[key].extend(found)
        self._index(pieces, scalars)

    def tree(self, name: str, rank: int = 0) -> Any:
        file = self.files[rank]
        prefix = f"{name}/"
        tensors = {k[len(prefix):]: file.read(k) for k in file.names if k.startswith(prefix)}
        return decode_tree(json.loads(file.metadata[name]), tensors, source=file.path)

    def lightning_state(self) -> dict[str, Any]:
        """Everything Lightning saved besides the model and optimizer tensors (read once)."""
        if self._common is None:
            self._common = self.tree("common", 0)
            rename = self._rename
            if rename is not None:
                common = self._common
                common["lzero/module_state"] = {rename(k): v for k, v in common["lzero/module_state"].items()}
                common["lzero/param_groups"] = [[{**g, "params": [rename(n) for n in g["params"]]} for g in groups]
                                                for groups in common["lzero/param_groups"]]
        return self._common

    def rng_state(self, rank: int) -> Optional[dict[str, Any]]:
        return self.tree("rng", rank)

    def module_state_numel(self) -> int:
        """Elements of the module's tensors outside every unit (frozen parameters, buffers), a tensor shared by
        several keys counted once; from rank 0's header, without reading a tensor."""
        file = self.files[0]
        refs = json.loads(file.metadata["common"])["lzero/module_state"]
        if isinstance(refs, dict) and all(isinstance(r, dict) and list(r) == ["@tensor"] for r in refs.values()):
            stored = {r["@tensor"] for r in refs.values()}  # the codec stores a shared tensor once
            return sum(math.prod(file.entry(f"common/{name}").shape) for name in stored) + self._derived_numel()
        return super().module_state_numel()  # a key the codec had to tag: decode it

    def derived_keys(self) -> dict[str, Any]:
        return {**self._state_keys, **self._whole}

    def derived_tensor(self, key: str) -> Tensor:
        """A tensor of the frozen base outside every unit, read from its file; or a quantization state tensor,
        computed again from the files (once per weight)."""
        if key in self._whole:
            return whole_tensor(*self._whole[key], key, self.path)
        name, sub = self._state_keys[key]
        if name not in self._states:
            self._states[name] = state_again(self.base[name], self.path)
        return self._states[name][sub]

    def derived_layout(self, key: str) -> tuple[Any, tuple[int, ...]]:
        if key in self._whole:
            return self._whole[key][0].dtype, self._whole[key][0].shape
        name, sub = self._state_keys[key]
        return state_layout(self.base[name], sub)

    def derived_digest(self, key: str) -> Optional[str]:
        if key in self._whole:
            return self._whole[key][1]
        name, sub = self._state_keys[key]
        return self.base[name].quantized["state"]["tensors"][sub]["sha256"]


def _renamed_key(key: str, rename: Callable[[str], str]) -> str:
    """``param/<name>`` or ``optim/<k>/<name>/<state>`` with the parameter's name renamed (names never hold "/")."""
    parts = key.split("/")
    at = 1 if parts[0] == "param" else 2
    return "/".join([*parts[:at], rename(parts[at]), *parts[at + 1:]])


def _renamed_manifest(m: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    return {**m, "params": {rename(n): p for n, p in m["params"].items()},
            "state_dict_keys": [rename(k) for k in m["state_dict_keys"]],
            "aliases": {rename(k): rename(v) for k, v in m.get("aliases", {}).items()}}


def _check_manifest(m: dict, path: Path) -> None:
    """Every field the reader and its users depend on, with its type, before any is used: a damaged or hand-edited
    manifest is refused naming the field, never met later as a KeyError or TypeError."""

    def bad(field: str, wanted: str) -> CheckpointError:
        return CheckpointError(f"`{path}`: `{field}` must be {wanted}, found {m.get(field.split('[')[0].split('.')[0])!r:.80}."
                               " HINT: this checkpoint's manifest is damaged; resume from an earlier checkpoint.")

    def whole(value: Any, low: int = 0) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    if not isinstance(m.get("save_id"), str) or not _SAVE_ID.fullmatch(m["save_id"]):
        raise bad("save_id", "a save id (letters and digits)")
    if not whole(m.get("world_size"), 1):
        raise bad("world_size", "a whole number >= 1")
    files = m.get("files")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and _FILE_NAME.fullmatch(f["name"])
            and whole(f.get("rank")) and whole(f.get("bytes")) for f in files):
        raise bad("files", "a list of {name: shard-<save id>-r<rank>-of-<world>.safetensors, rank, bytes}")
    params = m.get("params")
    if not isinstance(params, dict) or not all(
            isinstance(name, str) and isinstance(p, dict) and isinstance(p.get("shape"), list)
            and all(whole(d) for d in p["shape"]) and whole(p.get("numel")) and p["numel"] == math.prod(p["shape"])
            for name, p in params.items()):
        raise bad("params", "a mapping of parameter name -> {shape: [sizes], numel: their product}")
    keys = m.get("state_dict_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise bad("state_dict_keys", "a list of names")
    aliases = m.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise bad("aliases", "a mapping of name -> name")
    for field in ("stage", "global_step", "epoch"):
        if m.get(field) is not None and not whole(m[field]):
            raise bad(field, "a whole number")
    if not isinstance(m.get("weights_only", False), bool):
        raise bad("weights_only", "true or false")
    if not isinstance(m.get("imported_from", {}), dict):
        raise bad("imported_from", "a mapping (the source a checkpoint was imported from)")
    tensor = m.get("tensor_parallel")
    if tensor is not None and not (
            isinstance(tensor, dict) and whole(tensor.get("size"), 1) and m["world_size"] % tensor["size"] == 0
            and isinstance(tensor.get("params"), dict) and all(
                name in params and isinstance(record, dict) and whole(record.get("dim"))
                and record["dim"] < len(params[name]["shape"]) for name, record in tensor["params"].items())):
        raise bad("tensor_parallel", "{size: T dividing world_size, params: {name of `params`: {dim: its sharded"
                                     " dimension}}}")
