"""``lzero import-deepspeed SRC DST``: a DeepSpeed ZeRO checkpoint folder (read by deepspeed_checkpoint.py) written
as an lzero sharded checkpoint directory, in one process, without torch.distributed, one piece of one parameter in
memory at a time. See [Note: importing a DeepSpeed folder].

[Note: importing a DeepSpeed folder]
The output is what ``trainer.save_checkpoint`` writes under a ZeRO strategy ([Note: sharded checkpoint layout] in
sharded.py), at DeepSpeed's world size N: file ``r`` holds, of every parameter, the elements
``[r * ceil(numel / N), (r + 1) * ceil(numel / N))`` of its fp32 master and of each per-element optimizer state
(whatever DeepSpeed's stage; lzero reads any cut), and file 0 the 0-dim state (``step``) and everything else: the
folder's Lightning state (Lightning's own, or the one made for a raw folder: global step, epoch 0, fit loop, LR
scheduler), the buffers, the param groups and the precision state (``lzero/precision``: skipped steps, the fp16 loss
scaler). No RNG state: DeepSpeed's folders hold none. Each piece is read from DeepSpeed's mapped files only when the
writer reaches it, so memory holds one piece at a time, never the model and its optimizer.

The names stay DeepSpeed's, and the manifest's ``imported_from`` (``format: deepspeed``, the tag, DeepSpeed's
version) makes a load match them to the module's by one prefix (``prefix_renaming`` in pieces.py), as a load of the
folder itself does: ``Trainer.fit(ckpt_path=DST)`` resumes exactly as ``ckpt_path=SRC`` does.

It is written as lzero's saves are, the shard files first and the manifest (the commit) last, into a hidden folder
beside DST that is renamed to DST at the end: an interrupted import leaves no DST, nor one that looks complete.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from lzero.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from lzero.checkpoint.files import CheckpointError, fsync_dir, write_json_atomic, write_tensors
from lzero.checkpoint.pieces import PiecedCheckpoint
from lzero.checkpoint.reader import FORMAT, MANIFEST, VERSION, shard_name
from lzero.checkpoint.tree import encode_tree


class _Pending:
    """Elements ``[start, end)`` of a checkpoint's ``key``, read when the file writer reaches them."""

    def __init__(self, reader: PiecedCheckpoint, key: str, start: int, end: int) -> None:
        self.reader, self.key, self.start, self.end = reader, key, start, end
        self.dtype, self.shape = reader.dtype(key), (end - start,)

    def materialize(self) -> torch.Tensor:
        return self.reader.read_range(self.key, self.start, self.end, self.dtype)


def import_deepspeed(source: Any, out: Any) -> dict[str, Any]:
    """Write the DeepSpeed checkpoint folder ``source`` (the directory given to ``engine.save_checkpoint``, whose
    ``latest`` tag is read; a tag folder; or a Lightning ``DeepSpeedStrategy`` ``.ckpt`` directory) as an lzero
    sharded checkpoint at ``out``, which must not exist or be empty. Returns its manifest. See [Note: importing a
    DeepSpeed folder]."""
    source, out = Path(source), Path(out)
    _check_output(out)
    reader = DeepSpeedCheckpoint(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.importing-{secrets.token_hex(6)}"
    staging.mkdir()
    try:
        manifest = _write(reader, staging)
        try:
            os.replace(staging, out)  # replaces an empty directory
        except OSError as err:
            raise CheckpointError(f"Cannot move the imported checkpoint into `{out}`: {err}. HINT: something wrote into"
                                  f" `{out}` meanwhile; name a new directory.") from err
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(str(out.parent))
    return manifest


def _check_output(out: Path) -> None:
    if out.is_file():
        raise CheckpointError(f"The output `{out}` is a file. HINT: name a new directory for the lzero checkpoint.")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held:
            listed = ", ".join(f"`{n}`" for n in held[:3]) + (", ..." if len(held) > 3 else "")
            raise CheckpointError(f"The output `{out}` exists and is not empty (it holds {listed}). HINT: name a new"
                                  " directory, or remove this one first.")


def _write(reader: DeepSpeedCheckpoint, folder: Path) -> dict[str, Any]:
    """The shard files, then the manifest; the manifest."""
    save_id, world = f"{secrets.randbits(62):016x}", reader.world_size
    common = reader.lightning_state()
    files = []
    for rank in range(world):
        tensors, ranges = _pieces(reader, rank, world)
        metadata = {"save_id": save_id, "rank": str(rank), "world_size": str(world), "pieces": json.dumps(ranges),
                    "rng": "null"}  # DeepSpeed's folders keep no RNG state
        if rank == 0:
            encoded, tree_tensors = encode_tree(common)
            metadata["common"] = json.dumps(encoded, allow_nan=False)
            tensors.update({f"common/{k}": v for k, v in tree_tensors.items()})
        path = folder / shard_name(save_id, rank, world)
        write_tensors(path, tensors, metadata)
        files.append({"name": path.name, "rank": rank, "bytes": path.stat().st_size})
    m = reader.manifest
    manifest = {
        "format": FORMAT, "version": VERSION, "save_id": save_id, "world_size": world, "files": files,
        "stage": m["stage"], "precision": _precision(reader.files.model_states.get("ds_config")),
        "global_step": m["global_step"], "epoch": m["epoch"],
        "pytorch-lightning_version": common.get("pytorch-lightning_version"),
        "parameter_count": sum(p["numel"] for p in m["params"].values() if not p.get("frozen")),
        "params": m["params"], "state_dict_keys": m["state_dict_keys"], "aliases": m["aliases"],
        "weights_only": False,
        "imported_from": {"format": "deepspeed", "tag": m["tag"], "deepspeed_version": m["deepspeed_version"]},
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def _pieces(reader: PiecedCheckpoint, rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """File ``rank``'s pieces (read when written) and their ranges: its cut of every parameter and its optimizer
    state; with the first cut, the 0-dim state (range None)."""
    tensors: dict[str, Any] = {}
    ranges: dict[str, Any] = {}
    for name, info in reader.manifest["params"].items():
        part = -(-info["numel"] // world)
        a, b = rank * part, min(info["numel"], (rank + 1) * part)
        keys = [f"param/{name}"] + [f"optim/0/{name}/{k}" for k in reader.optimizer_keys(0, name)]
        for key in keys:
            if reader.is_scalar(key):
                if rank == 0:
                    tensors[key], ranges[key] = reader.scalar(key), None
            elif a < b:
                tensors[key], ranges[key] = _Pending(reader, key, a, b), [a, b]
    return tensors, ranges


def _precision(config: Any) -> str:
    """lzero's name for the precision DeepSpeed trained in (what ``lzero inspect`` sizes a resume with)."""
    config = config if isinstance(config, dict) else {}
    enabled = lambda key: isinstance(config.get(key), dict) and config[key].get("enabled") is True  # noqa: E731
    return "bf16-mixed" if enabled("bf16") or enabled("bfloat16") else "16-mixed" if enabled("fp16") else "32-true"


def import_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lzero import-deepspeed",
        description="Write a DeepSpeed ZeRO checkpoint folder (stages 1-3, any data-parallel world size) as an lzero"
                    " sharded checkpoint: fp32 masters, the optimizer's state and step, param groups, LR scheduler,"
                    " loss scale, global step and Lightning's state where the folder has it. Resume it with"
                    " Trainer.fit(ckpt_path=OUT) or fabric.load(OUT, ...), or pass it to lzero consolidate / export-hf.")
    parser.add_argument("source", help="a DeepSpeed checkpoint folder: the directory engine.save_checkpoint wrote"
                                       " (its `latest` tag), a tag folder, or a Lightning DeepSpeedStrategy .ckpt dir")
    parser.add_argument("out", help="the lzero checkpoint directory to write (must not exist, or be empty)")
    args = parser.parse_args(argv)
    try:
        m = import_deepspeed(args.source, args.out)
    except CheckpointError as err:
        print(f"lzero import-deepspeed: {err}", file=sys.stderr)
        return 1
    size = sum(f["bytes"] for f in m["files"])
    print(f"wrote {args.out} ({len(m['files'])} files, {size} bytes): DeepSpeed stage {m['stage']}"
          f" `{m['imported_from']['tag']}`, global step {m['global_step']}, {m['parameter_count']:,} parameters"
          f" in {len(m['params'])} tensors, with their optimizer state")
    return 0
