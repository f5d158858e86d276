"""Sharded checkpoints: every rank writes its own pieces, rank 0 commits a manifest; any world size
and stage reads them back, each rank reading only the elements it owns. No Lightning here.

[Note: sharded checkpoint layout]
A checkpoint is a directory (``epoch=0-step=100.ckpt/``)::

    manifest.json                                     the commit (written last, atomically)
    shard-<save_id>-r00000-of-00002.safetensors       rank 0's pieces, Lightning's state, its RNG
    shard-<save_id>-r00001-of-00002.safetensors       rank 1's pieces and RNG

Pieces are keyed by parameter name, never by unit, so the partition (world size, stage, bucket
size) may differ at load: ``param/<name>`` holds the fp32 master elements ``[a, b)`` of the
flattened parameter that the rank owns; ``optim/<k>/<name>/<key>`` the same range of optimizer
``k``'s per-element state (``exp_avg``...), and 0-dim state (``step``) whole. The ranges are in the
file's ``__metadata__["pieces"]`` (JSON). Rank 0's file also carries everything else Lightning put
in the checkpoint (loops, callbacks, LR schedulers, precision/loss-scaler state, hyperparameters),
the module's tensors outside every unit (buffers, frozen parameters) and the optimizers' param
groups, through the pickle-free tree codec (tree.py). Every file carries the save id.

A save: each rank writes its file under a new save id; one all-reduce tells every rank whether
every rank succeeded and how large each file is; rank 0 checks each file is visible with that size,
writes ``manifest.json`` with ``os.replace`` (the commit), and only then deletes files of other save
ids (the checkpoint this one replaces, or leftovers of an interrupted save). A crash at any moment
leaves either the old manifest with its files or the new one with its files.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import threading
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lzero import collectives
from lzero.checkpoint import (CheckpointError, TensorFile, decode_tree, encode_tree, read_json, write_json_atomic,
                               write_tensors)

if TYPE_CHECKING:
    from lzero.engine import ZeroEngine
    from lzero.optimizer import ZeroOptimizer

FORMAT = "lzero-sharded"
VERSION = 1
MANIFEST = "manifest.json"
SHARDED_ENTRIES = ("state_dict", "optimizer_states")  # written from the engine, not from the dict


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir()


def shard_name(save_id: str, rank: int, world_size: int) -> str:
    return f"shard-{save_id}-r{rank:05d}-of-{world_size:05d}.safetensors"


# --- save --------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@torch.no_grad()
def _local_pieces(engine: "ZeroEngine", optimizers: Sequence["ZeroOptimizer"]) -> tuple[dict[str, Tensor],
                                                                                          dict[str, Any]]:
    """This rank's tensors by key, and each key's [a, b) range within its flattened parameter (None
    for 0-dim state)."""
    tensors: dict[str, Tensor] = {}
    ranges: dict[str, Any] = {}
    owner = {u.spec.index: (k, z) for k, z in enumerate(optimizers) for u in z.units}
    for unit in engine.units:
        pieces = list(unit.spec.owned_pieces(engine.rank))
        master = unit.master_shard.detach()
        for spec, a, b, s in pieces:
            tensors[f"param/{spec.name}"] = master[s : s + (b - a)]
            ranges[f"param/{spec.name}"] = [a, b]
        k, zopt = owner[unit.spec.index]
        state = zopt.shard_optimizer(unit).state.get(unit.master_shard, {})
        for key, value in state.items():
            elementwise = isinstance(value, Tensor) and value.shape == master.shape
            for spec, a, b, s in pieces if elementwise else ((sp, 0, 0, 0) for sp, _, _ in unit.spec.param_ranges()):
                name = f"optim/{k}/{spec.name}/{key}"
                if elementwise:
                    tensors[name], ranges[name] = value[s : s + (b - a)], [a, b]
                else:
                    tensors[name] = value.detach().clone() if isinstance(value, Tensor) else torch.tensor(value)
                    ranges[name] = None
    return tensors, ranges


def describe(engine: "ZeroEngine", checkpoint: dict[str, Any], **fields: Any) -> tuple[dict[str, Tensor],
                                                                                      dict[str, Any]]:
    """The module's tensors outside every unit (buffers, frozen parameters), and the manifest's
    description of the model: parameter shapes, the state dict's keys in order, tied keys (``aliases``:
    key -> the parameter name it shares), step and epoch, plus ``fields``. ``checkpoint["state_dict"]``
    is the sharded form (:func:`lzero.state_dict.sharded_state_dict`)."""
    from lzero.state_dict import ShardedTensor

    state = checkpoint.get("state_dict", {})
    params = {spec.name: {"shape": list(spec.shape), "numel": spec.numel}
              for unit in engine.units for spec in unit.spec.params}
    manifest = {
        **fields, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
        "pytorch-lightning_version": checkpoint.get("pytorch-lightning_version"),
        "parameter_count": sum(p["numel"] for p in params.values()), "params": params,
        "state_dict_keys": list(state),
        "aliases": {k: v.spec.name for k, v in state.items() if isinstance(v, ShardedTensor) and v.spec.name != k},
    }
    return {k: v for k, v in state.items() if not isinstance(v, ShardedTensor)}, manifest


class SaveJob:
    """One save, prepared on the training thread and written by :meth:`run` (on it, or on a background
    thread for asynchronous saves). An error while preparing is kept and reported at the status
    exchange, so that no rank is left waiting for another."""

    def __init__(self, path: Any, engine: "ZeroEngine", optimizers: Sequence["ZeroOptimizer"],
                 checkpoint: dict[str, Any], module_state: dict[str, Tensor], extra_manifest: dict[str, Any],
                 group: Optional[dist.ProcessGroup], snapshot: bool) -> None:
        self.directory = Path(path)
        self.rank, self.world = engine.rank, engine.world_size
        self.group = group
        self.extra_manifest = extra_manifest
        self.removals: list[Callable[[], None]] = []  # run on rank 0 after the commit
        self.lock = threading.Lock()
        self.committed = False
        self.save_id = _common_save_id(engine)
        self.error: Optional[BaseException] = None
        self.tensors: dict[str, Tensor] = {}
        self.metadata: dict[str, str] = {}
        try:
            self._prepare(engine, optimizers, checkpoint, module_state, snapshot)
        except BaseException as err:  # reported at the status exchange
            self.error = err

    def _prepare(self, engine: "ZeroEngine", optimizers: Sequence["ZeroOptimizer"], checkpoint: dict[str, Any],
                 module_state: dict[str, Tensor], snapshot: bool) -> None:
        tensors, ranges = _local_pieces(engine, optimizers)
        metadata = {"save_id": self.save_id, "rank": str(self.rank), "world_size": str(self.world),
                    "pieces": json.dumps(ranges)}
        trees = {"rng": _rng_state()}
        if self.rank == 0:
            common = {k: v for k, v in checkpoint.items() if k not in SHARDED_ENTRIES}
            common["lzero/module_state"] = module_state
            common["lzero/param_groups"] = [_packed_groups(z) for z in optimizers]
            trees["common"] = common
        for tree_name, tree in trees.items():
            encoded, tree_tensors = encode_tree(tree)
            metadata[tree_name] = json.dumps(encoded, allow_nan=False)
            tensors.update({f"{tree_name}/{k}": v for k, v in tree_tensors.items()})
        if snapshot:  # training goes on and changes the shards: write from a copy in CPU memory
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        self.tensors, self.metadata = tensors, metadata

    def run(self) -> str:
        """Write this rank's file, exchange every rank's status and size (one all-reduce on ``group``),
        and on rank 0 check the files, commit the manifest, remove other saves' files, then run the
        removals waiting for this commit. A collective on ``group``. Returns the save id."""
        size = 0
        if self.error is None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                file = self.directory / shard_name(self.save_id, self.rank, self.world)
                write_tensors(file, self.tensors, self.metadata)
                size = file.stat().st_size
            except BaseException as err:  # every rank must reach the status exchange, or the others hang
                self.error = err
        self.tensors = {}
        sizes = torch.zeros(self.world, dtype=torch.float64)
        sizes[self.rank] = -1.0 if self.error is not None else float(size)
        collectives.all_reduce(sizes, group=self.group)
        failed = [r for r in range(self.world) if sizes[r] < 0]
        if self.error is not None:
            raise self.error
        if failed:
            raise CheckpointError(f"Rank(s) {failed} could not write their shard of `{self.directory}`; it was not"
                                  " committed. HINT: see those ranks' errors; the previous checkpoint is untouched.")
        if self.rank == 0:
            _commit(self.directory, self.save_id, self.world, [int(s) for s in sizes.tolist()], self.extra_manifest)
            with self.lock:
                self.committed = True
                removals, self.removals = self.removals, []
            for remove in removals:
                remove()
        collectives.barrier(self.group)
        return self.save_id


class AsyncSaver:
    """At most one save in flight on a background thread, its collectives on its own process group
    (they would otherwise interleave with training's). Removals asked for while a save is in flight
    (``ModelCheckpoint`` removes the previous checkpoint right after ``save_checkpoint`` returns) run
    only after that save commits, so a crash never leaves neither checkpoint."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self._thread: Optional[threading.Thread] = None
        self._job: Optional[SaveJob] = None
        self._error: Optional[BaseException] = None

    def submit(self, job: SaveJob) -> None:
        self.wait()
        self._job = job

        def write() -> None:
            try:
                job.run()
            except BaseException as err:
                self._error = err

        self._thread = threading.Thread(target=write, name="lzero-async-save", daemon=True)
        self._thread.start()

    def after_commit(self, action: Callable[[], None]) -> bool:
        """Run ``action`` (rank 0) once the save in flight commits; False if none is in flight."""
        job = self._job
        if job is None:
            return False
        with job.lock:
            if not job.committed:
                job.removals.append(action)
                return True
        return False  # committed already: the caller removes at once

    def wait(self) -> None:
        """Block until the save in flight has committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._job = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """The end of a clean fit: the last save commits, then the saver's process group goes. A collective."""
        try:
            self.wait()
        finally:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None


def _common_save_id(engine: "ZeroEngine") -> str:
    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    collectives.broadcast_([token], src=0, group=engine.group)
    return f"{int(token.item()):016x}"


def _packed_groups(zopt: "ZeroOptimizer") -> list[dict[str, Any]]:
    """Hyperparameters of every group, and its parameters by name."""
    names = zopt.engine.param_names()
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names.get(id(p), "") for p in g["params"]]}
            for g in zopt.param_groups]


def _commit(directory: Path, save_id: str, world: int, sizes: list[int], extra: dict[str, Any]) -> None:
    files = []
    for r in range(world):
        name = shard_name(save_id, r, world)
        on_disk = (directory / name).stat().st_size if (directory / name).exists() else None
        if on_disk != sizes[r]:
            raise CheckpointError(
                f"`{directory / name}` is not visible to rank 0 with the {sizes[r]} bytes rank {r} wrote (found"
                f" {on_disk}); the checkpoint was not committed. HINT: multi-node runs need a checkpoint directory on"
                " a filesystem shared by every node."
            )
        files.append({"name": name, "rank": r, "bytes": sizes[r]})
    manifest = {"format": FORMAT, "version": VERSION, "save_id": save_id, "world_size": world, "files": files, **extra}
    write_json_atomic(directory / MANIFEST, manifest)
    for entry in directory.iterdir():  # the checkpoint this one replaces, and leftovers of interrupted saves
        if entry.name != MANIFEST and entry.name not in {f["name"] for f in files} and entry.is_file():
            entry.unlink()


# --- load --------------------------------------------------------------------------------------


class ShardedCheckpoint:
    """A committed sharded checkpoint, validated in full on open (manifest, every file's header, size
    and save id, and that the pieces of every parameter cover it), before any tensor is read."""

    def __init__(self, path: Any) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise CheckpointError(
                f"`{self.path}` has no {MANIFEST}: it is not an lzero checkpoint, or its save never finished."
                " HINT: resume from an earlier checkpoint; an interrupted save is cleaned up by the next one."
            )
        self.manifest = read_json(manifest_path, "checkpoint manifest")
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise CheckpointError(f"`{manifest_path}` is not an {FORMAT} v{VERSION} manifest."
                                  " HINT: it was written by another tool or a newer lzero.")
        self.save_id = self.manifest["save_id"]
        self._common: Optional[dict[str, Any]] = None
        self.files: list[TensorFile] = []
        for entry in self.manifest["files"]:
            file = TensorFile(self.path / entry["name"], save_id=self.save_id)
            size = os.stat(file.path).st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"`{file.path}` has {size} bytes, the manifest says {entry['bytes']}."
                                      " HINT: this checkpoint is damaged; resume from an earlier one.")
            self.files.append(file)
        self._pieces: dict[str, list[tuple[int, int, TensorFile]]] = defaultdict(list)
        self._scalars: dict[str, TensorFile] = {}
        for file in self.files:
            for key, span in json.loads(file.metadata["pieces"]).items():
                if span is None:
                    self._scalars.setdefault(key, file)
                else:
                    self._pieces[key].append((span[0], span[1], file))
        for key in self._pieces:
            self._pieces[key].sort(key=lambda t: t[0])
        self._optimizer_keys: dict[tuple[str, str], set[str]] = defaultdict(set)  # (k, name) -> state keys
        for key in list(self._pieces) + list(self._scalars):
            parts = key.split("/")  # optim/<k>/<name>/<state>; names use dots, never slashes
            if parts[0] == "optim":
                self._optimizer_keys[(parts[1], parts[2])].add(parts[3])
        self._check_coverage()

    def _check_coverage(self) -> None:
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

    def read_range(self, key: str, start: int, end: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Elements [start, end) of the flattened ``key``, assembled from the files that hold them."""
        pieces = self._pieces.get(key)
        if not pieces:
            raise CheckpointError(f"`{self.path}` holds no `{key}`. HINT: the checkpoint belongs to another model"
                                  " or optimizer setup.")
        out: Optional[Tensor] = None
        for a, b, file in pieces:
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            chunk = file.read_flat_range(key, lo - a, hi - a)
            if out is None:
                out = torch.empty(end - start, dtype=dtype or chunk.dtype)
            out[lo - start : hi - start].copy_(chunk)
        if out is None:
            out = torch.empty(0, dtype=dtype or torch.float32)
        return out

    def is_scalar(self, key: str) -> bool:
        return key in self._scalars

    def scalar(self, key: str) -> Tensor:
        return self._scalars[key].read(key)

    def optimizer_keys(self, index: int, name: str) -> list[str]:
        return sorted(self._optimizer_keys.get((str(index), name), ()))

    def tree(self, name: str, rank: int = 0) -> Any:
        file = self.files[rank]
        prefix = f"{name}/"
        tensors = {k[len(prefix):]: file.read(k) for k in file.names if k.startswith(prefix)}
        return decode_tree(json.loads(file.metadata[name]), tensors, source=file.path)

    def lightning_state(self) -> dict[str, Any]:
        """Everything Lightning saved besides the model and optimizer tensors (read once)."""
        if self._common is None:
            self._common = self.tree("common", 0)
        return self._common

    def module_state_numel(self) -> int:
        """Elements of the module's tensors outside every unit (frozen parameters, buffers), a tensor
        shared by several keys counted once; from rank 0's header, without reading a tensor."""
        file = self.files[0]
        refs = json.loads(file.metadata["common"])["lzero/module_state"]
        if isinstance(refs, dict) and all(isinstance(r, dict) and list(r) == ["@tensor"] for r in refs.values()):
            stored = {r["@tensor"] for r in refs.values()}  # the codec stores a shared tensor once
            return sum(math.prod(file.entry(f"common/{name}").shape) for name in stored)
        tensors = self.lightning_state()["lzero/module_state"]  # a key the codec had to tag: decode it
        return sum(t.numel() for t in {id(t): t for t in tensors.values()}.values())

    def restore_rng(self, rank: int, world_size: int) -> bool:
        """This rank's RNG states, when the checkpoint was saved at the same world size."""
        if world_size != self.world_size:
            return False
        _restore_rng(self.tree("rng", rank))
        return True

    def full_param(self, name: str) -> Tensor:
        info = self.manifest["params"][name]
        return self.read_range(f"param/{name}", 0, info["numel"]).view(info["shape"])

    def param_name(self, key: str) -> Optional[str]:
        """The sharded parameter a state-dict key holds (tied keys name the same one), or None for a
        tensor outside every unit (a buffer, a frozen parameter)."""
        name = self.manifest["aliases"].get(key, key)
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


def fetch_full(state_dict: dict[str, Tensor]) -> Callable[[str, int, int], Tensor]:
    """A piece reader over a plain (DDP/Lightning) state dict, for :meth:`ZeroEngine.load_params`."""
    def fetch(name: str, start: int, end: int) -> Tensor:
        if name not in state_dict:
            raise CheckpointError(f"The checkpoint's state_dict has no `{name}`. HINT: it belongs to another model.")
        return state_dict[name].detach().reshape(-1)[start:end]
    return fetch


@torch.no_grad()
def load_optimizer_shards(zopt: "ZeroOptimizer", index: int, reader: ShardedCheckpoint) -> None:
    """Fill this rank's shard optimizer state from ``reader``: only the owned elements are read."""
    groups = reader.lightning_state()["lzero/param_groups"][index]
    if len(groups) != len(zopt.param_groups):
        raise CheckpointError(f"Optimizer {index} was saved with {len(groups)} param groups and now has"
                              f" {len(zopt.param_groups)}. HINT: `configure_optimizers` must build the same groups.")
    for outer, saved in zip(zopt.param_groups, groups):
        params = outer["params"]
        outer.update({k: v for k, v in saved.items() if k != "params"})
        outer["params"] = params
    for unit in zopt.units:
        inner = zopt.shard_optimizer(unit)
        first = unit.spec.params[0].name
        keys = reader.optimizer_keys(index, first)
        if not keys:
            inner.state.pop(unit.master_shard, None)
            continue
        state: dict[str, Any] = {}
        for key in keys:
            if reader.is_scalar(f"optim/{index}/{first}/{key}"):
                state[key] = reader.scalar(f"optim/{index}/{first}/{key}").to(unit.master_shard.device)
                continue
            shard = torch.zeros(unit.spec.shard_numel, dtype=unit.master_shard.dtype, device=unit.master_shard.device)
            for spec, a, b, s in unit.spec.owned_pieces(unit.rank):
                shard[s : s + (b - a)].copy_(reader.read_range(f"optim/{index}/{spec.name}/{key}", a, b))
            state[key] = shard
        inner.state[unit.master_shard] = state
