"""Sharded checkpoints, saved and loaded by the ranks of a run: every rank writes its own pieces, rank 0
commits a manifest; any world size and stage reads them back, each rank reading only the elements it
owns. No Lightning here; reading a checkpoint without a run (no process group) is reader.py's.

[Note: sharded checkpoint layout]
A checkpoint is a directory (``epoch=0-step=100.ckpt/``)::

    manifest.json                                     the commit (written last, atomically)
    shard-<save_id>-r00000-of-00002.safetensors       rank 0's pieces, Lightning's state, its RNG
    shard-<save_id>-r00001-of-00002.safetensors       rank 1's pieces and RNG

Pieces are keyed by parameter name, never by unit, so the partition (world size, stage, bucket
size) may differ at load: ``param/<name>`` holds the fp32 master elements ``[a, b)`` of the
flattened parameter that the rank owns; ``optim/<k>/<name>/<key>`` the same range of optimizer
``k``'s per-element state (``exp_avg``...), and 0-dim state (``step``) whole. An optimizer stepping whole tensors
([Note: per-tensor ownership] in lzero/engine/partition.py) writes each owned parameter's state from its owner:
parameter-shaped entries as the piece ``[0, numel)``, any other shape (Adafactor's factored rows and columns) whole,
as 0-dim state is. The ranges are in the file's ``__metadata__["pieces"]`` (JSON; a whole entry's is null). Rank 0's file also carries everything else Lightning put
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

import contextlib
import json
import math
import random
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lzero.engine import collectives
from lzero.engine.frozen_base import digest_tensor, fingerprint
from lzero.checkpoint.base_files import BaseTensor, base_record
from lzero.checkpoint.averages import add_average_pieces
from lzero.checkpoint.files import CheckpointError, write_json_atomic, write_tensors
from lzero.checkpoint.rank_state import (ShardedOptimizer, fill_shard, pack_param_groups, restore_param_groups,
                                         shard_pieces, tensor_state_value)
from lzero.checkpoint.pieces import PiecedCheckpoint
from lzero.checkpoint.reader import FORMAT, MANIFEST, VERSION, shard_name
from lzero.checkpoint.state_dict import ShardedTensor
from lzero.checkpoint.tree import encode_tree

if TYPE_CHECKING:
    from lzero.engine.engine import ZeroEngine
    from lzero.engine.flat_unit import FlatUnit

SHARDED_ENTRIES = ("state_dict", "optimizer_states")  # written from the engine, not from the dict


# --- save --------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@torch.no_grad()
def _local_pieces(engine: "ZeroEngine", optimizers: Sequence[ShardedOptimizer],
                  kept: Optional[Callable[[str], bool]] = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This rank's tensors by key, and each key's [a, b) range within its flattened parameter (None
    for 0-dim state); ``kept``: only the parameters whose name it accepts (a filtered save)."""
    tensors: dict[str, Tensor] = {}
    ranges: dict[str, Any] = {}
    owner = {u.spec.index: (k, z) for k, z in enumerate(optimizers) for u in z.units}
    for unit in engine.units:
        if unit.store.in_memory:
            _unit_pieces(unit, owner, tensors, ranges, kept=kept)
        else:  # NVMe: laid out from the placeholders' shapes, read when written (see _StreamedUnit)
            _StreamedUnit(unit, owner, kept).pieces_into(tensors, ranges)
    return tensors, ranges


class _Deferred:
    """A piece whose values are read only when the file writer reaches it (``write_tensors`` streams it)."""

    def __init__(self, source: "_StreamedUnit", name: str, like: Tensor) -> None:
        self.source, self.name = source, name
        self.dtype, self.shape = like.dtype, like.shape

    def materialize(self) -> Tensor:
        return self.source.take(self.name)


class _StreamedUnit:
    """The pieces of one unit whose master and optimizer state live in files: the unit becomes resident when
    the writer reaches its first piece and is released after its last, so a save holds one unit's state in
    memory at a time, never the rank's whole state."""

    def __init__(self, unit: "FlatUnit", owner: dict[int, tuple[int, ShardedOptimizer]],
                 kept: Optional[Callable[[str], bool]] = None) -> None:
        self.unit, self.owner, self.kept = unit, owner, kept
        self.stack: Optional[contextlib.ExitStack] = None
        self.values: dict[str, Tensor] = {}
        self.left: set[str] = set()

    def pieces_into(self, tensors: dict[str, Any], ranges: dict[str, Any]) -> None:
        layout: dict[str, Tensor] = {}
        _unit_pieces(self.unit, self.owner, layout, ranges, kept=self.kept)  # the placeholders' shapes and dtypes
        for name, like in layout.items():
            tensors[name] = _Deferred(self, name, like)
        self.left = set(layout)

    def take(self, name: str) -> Tensor:
        if self.stack is None:
            self.stack = contextlib.ExitStack()
            self.stack.enter_context(self.unit.resident())
            _unit_pieces(self.unit, self.owner, self.values, {}, copy=False, kept=self.kept)
        value = self.values.pop(name)
        self.left.discard(name)
        if not self.left:
            value = value.clone()  # the unit's buffers go back to the store's pool, to be read into again
            self.values = {}
            self.stack.close()
        return value


def _unit_pieces(unit: "FlatUnit", owner: dict[int, tuple[int, ShardedOptimizer]], tensors: dict[str, Tensor],
                 ranges: dict[str, Any], copy: bool = False, kept: Optional[Callable[[str], bool]] = None) -> None:
    """One unit's pieces into ``tensors`` and ``ranges``: views of its shards (``copy``: copies); ``kept``: only the
    parameters whose name it accepts."""
    keep = (lambda t: t.clone()) if copy else (lambda t: t)
    wanted = kept if kept is not None else (lambda name: True)
    master = unit.master_shard.detach()
    for spec, a, b, piece in shard_pieces(unit, master):
        if not wanted(spec.name):
            continue
        tensors[f"param/{spec.name}"], ranges[f"param/{spec.name}"] = keep(piece), [a, b]
    if unit.spec.index not in owner:  # a frozen unit: no optimizer state
        return
    k, zopt = owner[unit.spec.index]
    if unit.spec.per_tensor:
        _owned_state_pieces(unit, k, zopt, tensors, ranges, keep, wanted)
        return
    state = zopt.shard_optimizer(unit).state.get(unit.master_shard, {})
    for key, value in state.items():
        if isinstance(value, Tensor) and value.shape == master.shape:  # per element: this rank's pieces
            for spec, a, b, piece in shard_pieces(unit, value):
                if not wanted(spec.name):
                    continue
                name = f"optim/{k}/{spec.name}/{key}"
                tensors[name], ranges[name] = keep(piece), [a, b]
            continue
        for spec, _, _ in unit.spec.param_ranges():  # 0-dim (``step``): whole, under every parameter
            if not wanted(spec.name):
                continue
            name = f"optim/{k}/{spec.name}/{key}"
            tensors[name] = value.detach().clone() if isinstance(value, Tensor) else torch.tensor(value)
            ranges[name] = None


def _owned_state_pieces(unit: "FlatUnit", k: int, zopt: ShardedOptimizer, tensors: dict[str, Tensor],
                        ranges: dict[str, Any], keep: Callable[[Tensor], Tensor], wanted: Callable[[str], bool]) -> None:
    """A per-tensor unit's state of the parameters this rank owns, each entry whole (see the Note above)."""
    inner = zopt.shard_optimizer(unit)
    for t in zopt.owned_tensors(unit):
        if not wanted(t.spec.name):
            continue
        for key, value in inner.state.get(t.param, {}).items():
            name = f"optim/{k}/{t.spec.name}/{key}"
            if not isinstance(value, Tensor):
                tensors[name], ranges[name] = torch.tensor(value), None
            elif value.dim() and value.shape == t.param.shape:
                tensors[name], ranges[name] = keep(value.detach().reshape(-1)), [0, value.numel()]
            else:
                tensors[name], ranges[name] = value.detach().clone(), None


def describe(engine: "ZeroEngine", checkpoint: dict[str, Any], kept: Optional[Callable[[str], bool]] = None,
             **fields: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The module's tensors outside every unit (buffers, frozen parameters), and the manifest's
    description of the model: parameter shapes, the state dict's keys in order, tied keys (``aliases``:
    key -> the parameter name it shares), step and epoch, plus ``fields``. ``checkpoint["state_dict"]``
    is the sharded form (:func:`lzero.checkpoint.state_dict.sharded_state_dict`)."""
    state = checkpoint.get("state_dict", {})
    layouts = engine.tensor_layouts  # tensor parallel: the whole shapes ([Note: tensor-parallel checkpoints])
    params = {spec.name: {"shape": list(spec.whole_shape), "numel": math.prod(spec.whole_shape),
                          **({"frozen": True} if spec.frozen else {})}
              for unit in engine.units for spec in unit.spec.params if kept is None or kept(spec.name)}
    manifest = {
        **fields, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"),
        "pytorch-lightning_version": checkpoint.get("pytorch-lightning_version"),
        "parameter_count": sum(p["numel"] for p in params.values() if not p.get("frozen")), "params": params,
        "state_dict_keys": list(state),
        "aliases": {k: v.spec.name for k, v in state.items() if isinstance(v, ShardedTensor) and v.spec.name != k},
    }
    if engine.tensor_group is not None:
        cut = {name: {"dim": layouts[name].dim} for name in params if name in layouts}
        manifest["tensor_parallel"] = {"size": collectives.world_size(engine.tensor_group), "params": cut}
    return {k: v for k, v in state.items() if not isinstance(v, ShardedTensor)}, manifest


def save_sharded(path: Any, engine: "ZeroEngine", optimizers: Sequence[ShardedOptimizer], checkpoint: dict[str, Any],
                 saver: Optional["AsyncSaver"], kept: Optional[Callable[[str], bool]] = None, **fields: Any) -> None:
    """Write ``checkpoint`` (its ``state_dict`` in the sharded form) as a checkpoint directory at ``path``,
    with the state of ``optimizers`` (none: a weights-only checkpoint) and ``fields`` in the manifest:
    at once (a collective on the engine's group), or with ``saver`` on its background thread. ``kept``: only the
    parameters whose name it accepts, and their optimizer state (Fabric's ``filter=``). Under hybrid sharding the
    first shard group writes it, the others hold the same shards ([Note: hybrid sharding] in lzero/engine/mesh.py)."""
    if engine.mesh.replica_index != 0:
        return
    if engine.tensor_group is not None:  # see [Note: tensor-parallel checkpoints] in lzero/engine/tensor_layout.py
        if engine.mesh.hybrid or saver is not None:
            raise CheckpointError(
                "A checkpoint of a tensor-parallel run with "
                + ("hybrid sharding (`shard_group_size`)" if engine.mesh.hybrid else "`async_save=True`")
                + " is not built yet. HINT: save without it (drop `shard_group_size` / `async_save`), or train with"
                " `enable_checkpointing=False`.")
        kept = _tensor_rank_writes(engine, kept)
    if engine.pipeline_group is not None:  # see [Note: pipeline checkpoints]
        if saver is not None:
            raise CheckpointError("A checkpoint of a pipeline-parallel run with `async_save=True` is not built yet."
                                  " HINT: save without `async_save`.")
        kept = _first_copies(engine, kept)
    module_state, extra = describe(engine, checkpoint, kept, weights_only=not optimizers, **fields)
    if engine.pipeline_group is not None:
        module_state, extra = _every_stage(engine, module_state, extra)
    written, base = _without_base(engine, kept)
    whole = _without_whole_base(engine, module_state, kept) if engine.rank == 0 else {}
    if (base or whole) and engine.rank == 0:  # the manifest's writer alone hashes the files
        base = _without_base_states(base, module_state)
        extra["base"] = base_record(base, whole)
    if saver is None:
        SaveJob(path, engine, optimizers, checkpoint, module_state, extra, _writers(engine)[2], snapshot=False,
                kept=written).run()
        return
    saver.submit(SaveJob(path, engine, optimizers, checkpoint, module_state, extra, saver.group, snapshot=True,
                         kept=written))


def _tensor_rank_writes(engine: "ZeroEngine", kept: Optional[Callable[[str], bool]]) -> Callable[[str], bool]:
    """Under tensor parallel, the parameters this rank writes (of those ``kept`` accepts): its tensor-sharded ones,
    and the replicated ones at tensor coordinate 0 only."""
    first = engine.tensor_rank == 0
    return lambda name: (first or name in engine.tensor_layouts) and (kept is None or kept(name))


def _first_copies(engine: "ZeroEngine", kept: Optional[Callable[[str], bool]]) -> Callable[[str], bool]:
    """Under pipeline parallel, the parameters this rank writes (of those ``kept`` accepts): a weight two stages hold
    (tied) is written by the first stage only, under its name there."""
    return lambda name: name not in engine.tie_aliases and (kept is None or kept(name))


def _every_stage(engine: "ZeroEngine", module_state: dict[str, Tensor], extra: dict[str, Any]
                 ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """[Note: pipeline checkpoints]
    A pipeline run's checkpoint is the whole model's, in the same format as any other: every rank of every stage
    writes its pieces (file r is global rank r), and the manifest rank 0 commits describes every stage's parameters,
    state-dict keys (stage after stage: the model's own order), tensors outside the units and tied keys, gathered over
    the pipeline group. A weight two stages hold (embeddings tied to the head) is written once, by the first stage,
    the last stage's name for it an alias, as a one-process checkpoint names the tied key. So it resumes at any
    pipeline, tensor or data size, world size 1 included, and consolidates and exports as one."""
    mine = {"module_state": {k: v.detach().cpu() for k, v in module_state.items()}, "params": extra["params"],
            "keys": extra["state_dict_keys"], "aliases": {**extra["aliases"], **engine.tie_aliases},
            "cut": extra.get("tensor_parallel", {}).get("params", {})}
    stages: list[Any] = [None] * collectives.world_size(engine.pipeline_group)
    dist.all_gather_object(stages, mine, group=engine.pipeline_group)
    params, keys, aliases, cut, state = {}, [], {}, {}, {}
    for stage in stages:
        params.update(stage["params"])
        keys += [k for k in stage["keys"] if k not in keys]
        aliases.update(stage["aliases"])
        cut.update(stage["cut"])
        state.update({k: v for k, v in stage["module_state"].items() if k not in state})
    extra = {**extra, "params": params, "state_dict_keys": keys, "aliases": aliases,
             "parameter_count": sum(p["numel"] for p in params.values() if not p.get("frozen"))}
    if "tensor_parallel" in extra:
        extra["tensor_parallel"] = {**extra["tensor_parallel"], "params": cut}
    extra["pipeline_parallel"] = {"size": len(stages)}
    return state, extra


def _writers(engine: "ZeroEngine") -> tuple[int, int, Optional[dist.ProcessGroup]]:
    """This rank's file number, the number of files a save writes, and the group that agrees on them: the shard
    group's, or under tensor or pipeline parallel every rank of the run (file ``p * N * T + d * T + t`` for pipeline
    rank p, data rank d and tensor rank t: the run's own rank)."""
    if engine.tensor_group is None and engine.pipeline_group is None:
        return engine.rank, engine.world_size, engine.group
    size = collectives.world_size(engine.tensor_group) if engine.tensor_group is not None else 1
    stages = collectives.world_size(engine.pipeline_group) if engine.pipeline_group is not None else 1
    stage = collectives.rank(engine.pipeline_group) if engine.pipeline_group is not None else 0
    per_stage = engine.world_size * size
    return stage * per_stage + engine.rank * size + engine.tensor_rank, per_stage * stages, None


def _without_base(engine: "ZeroEngine", kept: Optional[Callable[[str], bool]]
                  ) -> tuple[Optional[Callable[[str], bool]], dict[str, BaseTensor]]:
    """The parameters whose pieces this save writes, and those it reads back from pretrained files instead (of those
    ``kept`` accepts): see [Note: a checkpoint without its frozen base] in base_files.py. A collective on the
    engine's group when the engine tracks a frozen base."""
    if not engine.frozen_base or engine.tensor_group is not None:  # a tensor-parallel run writes its whole base
        return kept, {}
    base = {name: t for name, t in engine.frozen_base.unchanged(engine.group).items() if kept is None or kept(name)}
    if not base:
        return kept, {}
    return (lambda name: name not in base and (kept is None or kept(name))), base


def _without_whole_base(engine: "ZeroEngine", module_state: dict[str, Any], kept: Optional[Callable[[str], bool]]
                        ) -> dict[str, tuple[BaseTensor, str]]:
    """The frozen tensors outside every unit that are still their pretrained files' (``engine.outside_base``, their
    fingerprint unchanged), taken out of ``module_state`` (in place), each with its SHA-256. Rank 0, which writes the
    module's state."""
    out: dict[str, tuple[BaseTensor, str]] = {}
    same: dict[int, bool] = {}  # a tied tensor fingerprinted once
    for key, whole in engine.outside_base.items():
        value = module_state.get(key)
        if not isinstance(value, Tensor) or (kept is not None and not kept(key)):
            continue
        if id(value) not in same:
            same[id(value)] = fingerprint(value) == whole.fingerprint
        if same[id(value)]:
            out[key] = (whole.where, whole.sha256)
            del module_state[key]
    return out


def _without_base_states(base: dict[str, BaseTensor], module_state: dict[str, Any]) -> dict[str, BaseTensor]:
    """The quantization state of each 4-bit weight of ``base`` taken out of ``module_state`` (in place) where it is
    still the one its record computes again; the record of any other says nothing of its state, which stays."""
    out = dict(base)
    for name, t in base.items():
        state = (t.quantized or {}).get("state")
        if state is None:
            continue
        keys = {f"{name}.{k}": info["sha256"] for k, info in state["tensors"].items()}
        if all(k in module_state and isinstance(module_state[k], Tensor) and digest_tensor(module_state[k]) == h
               for k, h in keys.items()):
            for k in keys:
                del module_state[k]
        else:
            out[name] = t._replace(quantized={k: v for k, v in t.quantized.items() if k != "state"})
    return out


class SaveJob:
    """One save, prepared on the training thread and written by :meth:`run` (on it, or on a background
    thread for asynchronous saves). An error while preparing is kept and reported at the status
    exchange, so that no rank is left waiting for another."""

    def __init__(self, path: Any, engine: "ZeroEngine", optimizers: Sequence[ShardedOptimizer],
                 checkpoint: dict[str, Any], module_state: dict[str, Tensor], extra_manifest: dict[str, Any],
                 group: Optional[dist.ProcessGroup], snapshot: bool,
                 kept: Optional[Callable[[str], bool]] = None) -> None:
        self.directory = Path(path)
        self.rank, self.world, writers = _writers(engine)
        self.group = group
        self.extra_manifest = extra_manifest
        self.removals: list[Callable[[], None]] = []  # run on rank 0 after the commit
        self.lock = threading.Lock()
        self.committed = False
        # on the training thread's group: an asynchronous save's group may still carry the previous save's exchange
        self.save_id = _common_save_id(writers)
        self.error: Optional[BaseException] = None
        self.tensors: dict[str, Tensor] = {}
        self.metadata: dict[str, str] = {}
        try:
            self._prepare(engine, optimizers, checkpoint, module_state, snapshot, kept)
        except BaseException as err:  # reported at the status exchange
            self.error = err

    def _prepare(self, engine: "ZeroEngine", optimizers: Sequence[ShardedOptimizer], checkpoint: dict[str, Any],
                 module_state: dict[str, Tensor], snapshot: bool, kept: Optional[Callable[[str], bool]] = None) -> None:
        tensors, ranges = _local_pieces(engine, optimizers, kept)
        add_average_pieces(engine, tensors, ranges, kept)  # weight averaging: lzero/checkpoint/averages.py
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
        if snapshot:  # training goes on and changes the shards: write from a copy in CPU memory (refused with NVMe)
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        self.tensors, self.metadata = tensors, metadata

    def run(self) -> str:
        """Write this rank's file, exchange every rank's status and size (one all-reduce on ``group``),
        and on rank 0 check the files, commit the manifest, remove other saves' files, then run the
        removals waiting for this commit. A collective on ``group``. Returns the save id."""
        size = 0
        file = self.directory / shard_name(self.save_id, self.rank, self.world)
        if self.error is None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                write_tensors(file, self.tensors, self.metadata)
                size = file.stat().st_size
            except OSError as err:  # a full disk, a lost mount: name the file
                self.error = CheckpointError(
                    f"Rank {self.rank} could not write its shard `{file}`: {err}. The checkpoint `{self.directory}`"
                    " was not committed; the previous checkpoint is untouched. HINT: free space on that disk, or save to"
                    " another folder (`ModelCheckpoint(dirpath=...)`), and save again.")
                self.error.__cause__ = err
            except BaseException as err:  # every rank must reach the status exchange, or the others hang
                self.error = err
        self.tensors = {}
        sizes = torch.zeros(self.world, dtype=torch.float64)
        sizes[self.rank] = -1.0 if self.error is not None else float(size)
        collectives.all_reduce(sizes, group=self.group)
        failed = [r for r in range(self.world) if sizes[r] < 0]
        if failed:  # nothing will commit this save: its files only take space (on a disk that may be full)
            with contextlib.suppress(OSError):
                file.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.directory.rmdir()  # only if empty: another rank's file, or an older save, keeps it
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
        """The end of a clean fit: the last save commits (its owner then destroys the process group). A
        collective."""
        try:
            self.wait()
        finally:
            self.group = None


def _common_save_id(group: Optional[dist.ProcessGroup]) -> str:
    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    collectives.broadcast_([token], src=0, group=group)
    return f"{int(token.item()):016x}"


def _packed_groups(zopt: ShardedOptimizer) -> list[dict[str, Any]]:
    """Hyperparameters of every group, and its parameters by name."""
    names = zopt.engine.param_names()
    return pack_param_groups(zopt, lambda p: names.get(id(p), ""))


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


def restore_rng(reader: PiecedCheckpoint, rank: int, world_size: int) -> bool:
    """This rank's RNG states, when the checkpoint was saved at the same world size and holds them."""
    state = reader.rng_state(rank) if world_size == reader.world_size else None
    if state is None:
        return False
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


@torch.no_grad()
def load_optimizer_shards(zopt: ShardedOptimizer, index: int, reader: PiecedCheckpoint) -> None:
    """Fill this rank's shard optimizer state from ``reader``: only the owned elements are read."""
    groups = reader.lightning_state()["lzero/param_groups"][index]
    if len(groups) != len(zopt.param_groups):
        raise CheckpointError(f"Optimizer {index} was saved with {len(groups)} param groups and now has"
                              f" {len(zopt.param_groups)}. HINT: `configure_optimizers` must build the same groups.")
    restore_param_groups(zopt, groups)
    for unit in zopt.units:
        with unit.resident(write=True):
            _load_unit_state(zopt, unit, index, reader)


def _load_unit_state(zopt: ShardedOptimizer, unit: "FlatUnit", index: int, reader: PiecedCheckpoint) -> None:
    """Fill one unit's shard optimizer state from ``reader`` (the unit resident)."""
    if unit.spec.per_tensor:
        _load_owned_state(zopt, unit, index, reader)
        return
    inner = zopt.shard_optimizer(unit)
    first = reader.saved_name(unit.spec.params[0].name)
    keys = reader.optimizer_keys(index, first)
    if not keys:
        inner.state.pop(unit.master_shard, None)
        return
    state: dict[str, Any] = {}
    for key in keys:
        if reader.is_scalar(f"optim/{index}/{first}/{key}"):
            state[key] = reader.scalar(f"optim/{index}/{first}/{key}").to(unit.master_shard.device)
            continue
        shard = torch.zeros(unit.spec.shard_numel, dtype=unit.master_shard.dtype, device=unit.master_shard.device)
        state[key] = fill_shard(shard, unit, _optimizer_reader(reader, index, key))
    inner.state[unit.master_shard] = state


def _load_owned_state(zopt: ShardedOptimizer, unit: "FlatUnit", index: int, reader: PiecedCheckpoint) -> None:
    """A per-tensor unit's owned parameters take their whole state from ``reader``, whoever saved it: each entry's
    whole pieces (written at any world size or layout), or its whole tensor."""
    inner = zopt.shard_optimizer(unit)
    for t in zopt.owned_tensors(unit):
        saved = reader.saved_name(t.spec.name)
        state: dict[str, Any] = {}
        for key in reader.optimizer_keys(index, saved):
            name = f"optim/{index}/{saved}/{key}"
            value = reader.scalar(name) if reader.is_scalar(name) else \
                reader.read_range(name, 0, t.spec.numel).view(t.param.shape)
            state[key] = tensor_state_value(key, value, t.param)
        if state:
            inner.state[t.param] = state
        else:
            inner.state.pop(t.param, None)


def _optimizer_reader(reader: PiecedCheckpoint, index: int, key: str) -> Callable[[Any, int, int], Tensor]:
    """Elements [a, b) of optimizer ``index``'s state ``key`` for one parameter, for :func:`fill_shard`."""
    return lambda spec, a, b: reader.read_range(f"optim/{index}/{reader.saved_name(spec.name)}/{key}", a, b)
