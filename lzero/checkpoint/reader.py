"""Reading a checkpoint by pieces (:class:`PiecedCheckpoint`, see [Note: a checkpoint read by pieces]), and
lzero's own committed sharded checkpoint directory as one (:class:`ShardedCheckpoint`: the manifest, every shard
file's header, and any flat range of any saved tensor). Storage only (no Lightning, no torch.distributed, nothing
of the engine), so ``lzero consolidate`` / ``lzero inspect`` and any tool can open a checkpoint without a process
group. The layout is described in [Note: sharded checkpoint layout] in sharded.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Collection, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from lzero.checkpoint.files import CheckpointError, TensorFile, read_json
from lzero.checkpoint.tree import decode_tree

FORMAT = "lzero-sharded"
VERSION = 1
MANIFEST = "manifest.json"


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir()


_SAVE_ID = re.compile(r"[0-9A-Za-z_]{1,64}")
_FILE_NAME = re.compile(r"shard-[0-9A-Za-z_]{1,64}-r\d{5}-of-\d{5}\.safetensors")  # never a path elsewhere


def shard_name(save_id: str, rank: int, world_size: int) -> str:
    return f"shard-{save_id}-r{rank:05d}-of-{world_size:05d}.safetensors"


class RangeSource(Protocol):
    """Where one piece's elements are stored: reads them by offset from the piece's first element."""

    def read_flat_range(self, start: int, end: int) -> Tensor: ...


class Piece(NamedTuple):
    """Elements ``[start, end)`` of a flattened tensor, held by ``source`` (its element 0 is element ``start``)."""

    start: int
    end: int
    source: RangeSource


class _FileEntry:
    """One tensor of a shard file, as a piece's source."""

    def __init__(self, file: TensorFile, key: str) -> None:
        self.file, self.key = file, key

    def read_flat_range(self, start: int, end: int) -> Tensor:
        return self.file.read_flat_range(self.key, start, end)


class PiecedCheckpoint:
    """[Note: a checkpoint read by pieces]
    What loading into shards reads of any checkpoint, whoever wrote it: every parameter (``param/<name>``, the fp32
    master) and every per-element optimizer state (``optim/<k>/<name>/<state>``) held as pieces, each a flat range of
    the flattened parameter and the source that reads it, so that a rank reads only the elements it owns whatever
    partition wrote them; 0-dim optimizer state (``step``) whole per parameter; ``manifest`` describes the model
    (``params``: name -> shape and numel, ``state_dict_keys`` in order, ``aliases``: tied key -> parameter name,
    ``world_size``, ``stage``, ``global_step``, ``epoch``, ``weights_only``); ``lightning_state()`` is everything else,
    with ``lzero/module_state`` (the tensors outside every unit: buffers, frozen parameters) and ``lzero/param_groups``
    (each optimizer's groups, hyperparameters and parameter names). :class:`ShardedCheckpoint` (lzero's own) and
    ``DeepSpeedCheckpoint`` (deepspeed_checkpoint.py) build the pieces from their files; the reading is here."""

    path: Path
    manifest: dict[str, Any]

    def _index(self, pieces: dict[str, list[Piece]], scalars: dict[str, Callable[[], Tensor]]) -> None:
        """Take the pieces and the 0-dim entries (read when asked for), and check that they cover every parameter."""
        self._pieces = {key: sorted(found, key=lambda p: p.start) for key, found in pieces.items()}
        self._scalars = scalars
        self._optimizer_keys: dict[tuple[str, str], set[str]] = defaultdict(set)  # (k, name) -> state keys
        for key in list(self._pieces) + list(self._scalars):
            parts = key.split("/")  # optim/<k>/<name>/<state>; names use dots, never slashes
            if parts[0] == "optim":
                self._optimizer_keys[(parts[1], parts[2])].add(parts[3])
        self._check_coverage()

    def _check_coverage(self) -> None:  # noqa: C901 - one pass over the pieces
        """Every parameter, and every per-element optimizer state, is covered from 0 to its numel."""
        params = self.manifest["params"]
        for name in params:
            if f"param/{name}" not in self._pieces:
                raise CheckpointError(f"`{self.path}`: no file holds `param/{name}`. HINT: a shard file is missing"
                                      " or from another save.")
        for key, pieces in self._pieces.items():
            parts = key.split("/")  # param/<name> or optim/<k>/<name>/<state>; names use dots, never slashes
            name = parts[1] if parts[0] == "param" else parts[2]
            covered = 0
            for a, b, _ in pieces:  # sorted by start
                if a > covered:
                    break
                covered = max(covered, b)
            if name not in params or covered < params[name]["numel"]:
                raise CheckpointError(f"`{self.path}`: the shards hold elements [0, {covered}) of `{key}`, which has"
                                      f" {params.get(name, {}).get('numel', '?')}. HINT: a shard file is missing or from"
                                      " another save.")

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def from_deepspeed(self) -> bool:
        """Whether this holds a DeepSpeed run: its folder, or an lzero checkpoint ``lzero import-deepspeed`` wrote
        from one. Its names are matched to the module's by one prefix (:func:`prefix_renaming`), and Fabric's
        ``load`` puts its one module and optimizer into the state's."""
        imported = self.manifest.get("imported_from") or {}
        return self.manifest.get("format") == "deepspeed" or imported.get("format") == "deepspeed"

    def dtype(self, key: str) -> torch.dtype:
        """The dtype ``key``'s pieces hold, without reading an element."""
        return self._pieces[key][0].source.read_flat_range(0, 0).dtype

    def read_range(self, key: str, start: int, end: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Elements [start, end) of the flattened ``key``, assembled from the pieces that hold them."""
        pieces = self._pieces.get(key)
        if not pieces:
            raise CheckpointError(f"`{self.path}` holds no `{key}`. HINT: the checkpoint belongs to another model"
                                  " or optimizer setup.")
        out: Optional[Tensor] = None
        for a, b, source in pieces:
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            chunk = source.read_flat_range(lo - a, hi - a)
            if out is None:
                out = torch.empty(end - start, dtype=dtype or chunk.dtype)
            out[lo - start : hi - start].copy_(chunk)
        if out is None:
            out = torch.empty(0, dtype=dtype or torch.float32)
        return out

    def is_scalar(self, key: str) -> bool:
        return key in self._scalars

    def scalar(self, key: str) -> Tensor:
        return self._scalars[key]()

    def optimizer_keys(self, index: int, name: str) -> list[str]:
        return sorted(self._optimizer_keys.get((str(index), name), ()))

    def lightning_state(self) -> dict[str, Any]:
        """Everything besides the model and optimizer tensors, as Lightning's checkpoint dict has it (read once)."""
        raise NotImplementedError

    def rng_state(self, rank: int) -> Optional[dict[str, Any]]:
        """``rank``'s RNG states (``torch``, ``numpy``, ``python``, maybe ``cuda``), None when not saved."""
        return None

    def module_state_numel(self) -> int:
        """Elements of the module's tensors outside every unit (frozen parameters, buffers), a tensor shared by
        several keys counted once."""
        tensors = self.lightning_state()["lzero/module_state"]
        return sum(t.numel() for t in {id(t): t for t in tensors.values()}.values())

    def full_param(self, name: str) -> Tensor:
        info = self.manifest["params"][name]
        return self.read_range(f"param/{name}", 0, info["numel"]).view(info["shape"])

    def param_name(self, key: str) -> Optional[str]:
        """The sharded parameter a state-dict key holds (tied keys name the same one), or None for a
        tensor outside every unit (a buffer, a frozen parameter)."""
        name = self.manifest.get("aliases", {}).get(key, key)
        return name if name in self.manifest["params"] else None

    def state_tensor(self, key: str) -> Tensor:
        """The whole tensor of one state-dict key."""
        name = self.param_name(key)
        return self.full_param(name) if name is not None else self.lightning_state()["lzero/module_state"][key]

    def full_state_dict(self) -> dict[str, Tensor]:
        """The module's whole state dict in its saved key order; tied keys share one tensor."""
        by_name: dict[str, Tensor] = {}
        out = {}
        for key in self.manifest["state_dict_keys"]:
            name = self.param_name(key)
            if name is None:
                out[key] = self.state_tensor(key)
                continue
            if name not in by_name:
                by_name[name] = self.full_param(name)
            out[key] = by_name[name]
        return out


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
        for file in self.files:
            for saved_key, span in json.loads(file.metadata["pieces"]).items():
                key = _renamed_key(saved_key, self._rename) if self._rename else saved_key
                if span is None:
                    scalars.setdefault(key, functools.partial(file.read, saved_key))
                else:
                    pieces[key].append(Piece(span[0], span[1], _FileEntry(file, saved_key)))
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
            return sum(math.prod(file.entry(f"common/{name}").shape) for name in stored)
        return super().module_state_numel()  # a key the codec had to tag: decode it


def prefix_renaming(saved: list[str], names: set[str]) -> Optional[Callable[[str], str]]:
    """How the saved parameter names become the module's, when they are not all among ``names``: the one prefix
    that, added to every saved name (DeepSpeed trained ``GPT()``, Lightning holds it as ``self.model``) or removed
    from every one (the reverse), makes each of them one of ``names``. None when no prefix, or several, do."""
    if not saved or all(n in names for n in saved):
        return None
    first = saved[0]
    added = {t[: len(t) - len(first)] for t in names if t.endswith("." + first)}
    removed = {first[: i + 1] for i, c in enumerate(first) if c == "."}
    fits = [(lambda n, p=p: p + n) for p in sorted(added) if all(p + n in names for n in saved)]
    fits += [(lambda n, p=p: n[len(p):] if n.startswith(p) else n) for p in sorted(removed)
             if all(n.startswith(p) and n[len(p):] in names for n in saved)]
    return fits[0] if len(fits) == 1 else None


def open_reader(path: Any, names: Optional[Collection[str]] = None) -> PiecedCheckpoint:
    """A checkpoint directory's reader: a DeepSpeed checkpoint folder's, else lzero's sharded checkpoint's.
    ``names``: the module's parameter names, which a DeepSpeed run's are matched to (:func:`prefix_renaming`)."""
    from lzero.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint  # both build on this module
    from lzero.checkpoint.deepspeed_files import deepspeed_tag_folder

    if deepspeed_tag_folder(path) is not None:
        return DeepSpeedCheckpoint(path, names)
    return ShardedCheckpoint(path, names)


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
