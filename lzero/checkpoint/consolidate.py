"""``lzero consolidate`` and ``lzero inspect``: one plain fp32 file from a sharded checkpoint (or a DeepSpeed ZeRO
checkpoint folder), streamed one tensor at a time; the checkpoint's metadata without loading a tensor. Given anything
but a sharded checkpoint directory (a plain ``.ckpt``, a file inside a checkpoint, a folder of checkpoints,
a missing path) they say what it is and what to do; a plain torch/Lightning file can be converted to
``.safetensors``. A bad output path is refused before anything is written.

``.ckpt``/``.pt``/``.pth`` outputs are torch's format (``torch.load(weights_only=True)`` and
``LightningModule.load_from_checkpoint`` read them): the module's state dict under ``state_dict``
with tied keys sharing one tensor, plus ``pytorch-lightning_version``, ``epoch``, ``global_step``
and ``hyper_parameters``. A Fabric save's is the module's state dict alone, as ``torch.save(model.state_dict())``
writes it (what ``fabric.load_raw`` and litgpt's ``lit_model.pth`` readers take). ``.safetensors`` outputs hold the flat state dict; safetensors cannot
share storage, so a tied key is stored once, under its first name, and the metadata entry
``aliases`` (JSON) maps every other key to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lzero.checkpoint import CheckpointError, SafetensorsStreamWriter, TensorFile, TorchStreamWriter
from lzero.checkpoint.deepspeed_files import deepspeed_tag_folder
from lzero.checkpoint.formats import open_reader
from lzero.checkpoint.pieces import PiecedCheckpoint
from lzero.checkpoint.reader import MANIFEST, ShardedCheckpoint

KEPT = ("pytorch-lightning_version", "epoch", "global_step", "loops", "hyper_parameters", "hparams_name")
"""What a consolidated file keeps besides the state dict: what ``load_from_checkpoint`` needs, and the loops'
progress, as DDP's ``save_checkpoint(weights_only=True)`` has them."""

SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors")


def consolidate(checkpoint_dir: Any, out: Any, progress: bool = False) -> Path:
    """Write ``checkpoint_dir`` (an lzero sharded checkpoint, or a DeepSpeed ZeRO checkpoint folder: its fp32 masters)
    as one plain fp32 file at ``out`` (``.ckpt``, ``.pt``, ``.pth`` or ``.safetensors``); peak memory stays near the
    largest tensor. A plain torch/Lightning file instead of a directory is converted to ``.safetensors`` (its state
    dict, read with ``weights_only=True``)."""
    source, out = Path(checkpoint_dir), Path(out)
    kind = source_kind(source, "consolidate")
    check_output(source, out)
    if kind == "torch":
        if out.suffix != ".safetensors":
            raise CheckpointError(_plain_file(source) + " It is already one full file and needs no consolidation."
                                  f" HINT: use `{source}` as it is"
                                  " (`torch.load(path, weights_only=True)`, `load_from_checkpoint`), or convert it"
                                  f" with an output ending in .safetensors: `lzero consolidate {source}"
                                  f" {out.with_suffix('.safetensors')}`.")
        return convert_to_safetensors(source, out)
    reader = open_reader(source)
    keys = reader.manifest["state_dict_keys"]
    first_key: dict[str, str] = {}  # what a key holds (its parameter, or itself) -> the first key holding it
    for key in keys:
        first_key.setdefault(reader.param_name(key) or key, key)
    bar = _progress(len(keys), progress)
    if out.suffix == ".safetensors":
        stored = list(first_key.values())
        entries = [(key, *dtype_shape(reader, key)) for key in stored]
        tied = {key: first for key in keys if (first := first_key[reader.param_name(key) or key]) != key}
        with SafetensorsStreamWriter(out, entries, {"aliases": json.dumps(tied), "format": "lzero-consolidated"}) as w:
            for key in stored:
                w.write(key, reader.state_tensor(key))
                bar.update(1)
        bar.close()
        return out
    with TorchStreamWriter(out) as writer:
        state: dict[str, Any] = {}
        for key in keys:
            first = first_key[reader.param_name(key) or key]
            state[key] = writer.add(reader.state_tensor(key)) if first == key else state[first]
            bar.update(1)
        if reader.manifest.get("front") == "fabric":  # no load_from_checkpoint to serve: the plain state dict
            writer.close(state)
        else:
            common = reader.lightning_state()
            writer.close({"state_dict": state, **{k: common[k] for k in KEPT if k in common}})
    bar.close()
    return out


# -------------------------------------------------------------------------------------- what the input is


def source_kind(path: Path, command: str) -> str:
    """"sharded" for a directory holding a manifest, "torch" for a torch.save file (a plain Lightning or
    DDP checkpoint); anything else is refused, saying what it is and what to pass instead. A directory
    whose save never finished is left to :class:`ShardedCheckpoint` to explain."""
    out_arg = " OUT.ckpt" if command == "consolidate" else ""
    if not path.exists():
        raise CheckpointError(f"`{path}` does not exist. HINT: check the path; lzero checkpoints are directories"
                              " such as `<log dir>/checkpoints/last.ckpt`.")
    if path.is_dir():
        inner = sorted(p.name for p in path.iterdir() if (p / MANIFEST).is_file())
        if not (path / MANIFEST).exists() and inner:
            listed = ", ".join(f"`{n}`" for n in inner[:5]) + (", ..." if len(inner) > 5 else "")
            raise CheckpointError(f"`{path}` is a folder of lzero checkpoints ({listed}), not one checkpoint."
                                  f" HINT: pass one of them: `lzero {command} {path / inner[-1]}{out_arg}`.")
        return "sharded"
    if (path.parent / MANIFEST).is_file():
        raise CheckpointError(f"`{path}` is a file inside the lzero checkpoint `{path.parent}`. HINT: pass the"
                              f" checkpoint directory itself: `lzero {command} {path.parent}{out_arg}`.")
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save: a zip archive, or a legacy pickle
        return "torch"
    try:
        TensorFile(path)
    except CheckpointError:
        raise CheckpointError(f"`{path}` is neither an lzero checkpoint (a directory holding {MANIFEST}) nor a"
                              " torch.save or safetensors file. HINT: pass a checkpoint directory an lzero"
                              " strategy wrote, e.g. `<log dir>/checkpoints/last.ckpt`.") from None
    raise CheckpointError(f"`{path}` is a safetensors file: already one full file, nothing to {command}. HINT: read"
                          " it with `safetensors.torch.load_file` or `lzero.checkpoint.TensorFile`.")


def _plain_file(path: Path) -> str:
    return f"`{path}` is a single torch.save file (a plain Lightning/DDP checkpoint), not an lzero sharded checkpoint."


def check_output(source: Path, out: Path) -> None:
    """Refuse an output path that could not be written, or would overwrite or sit inside the checkpoint."""
    if out.suffix not in SUFFIXES:
        raise CheckpointError(f"Cannot tell the format of `{out}`. HINT: end the output name with .ckpt, .pt,"
                              " .pth (torch.save) or .safetensors.")
    src, dst = source.resolve(), out.resolve()
    if dst == src:
        raise CheckpointError(f"The output `{out}` is the checkpoint itself. HINT: name another file, e.g."
                              f" `{dst.parent / ('consolidated' + out.suffix)}`.")
    if src.is_dir() and src in dst.parents:
        raise CheckpointError(f"The output `{out}` is inside the checkpoint `{source}` (a later save there deletes"
                              f" files it did not write). HINT: write it outside, e.g. `{src.parent / out.name}`.")
    if (dst / MANIFEST).is_file():
        raise CheckpointError(f"The output `{out}` is an lzero checkpoint directory. HINT: name a new file, e.g."
                              f" `{dst.parent / ('consolidated' + out.suffix)}`.")
    if dst.is_dir():
        raise CheckpointError(f"The output `{out}` is a directory. HINT: name a file, e.g."
                              f" `{out / ('model' + out.suffix)}`.")
    if not dst.parent.is_dir():
        raise CheckpointError(f"The output's folder `{out.parent}` does not exist. HINT: create it first"
                              f" (`mkdir -p {out.parent}`), or write somewhere else.")
    if not os.access(dst.parent, os.W_OK):
        raise CheckpointError(f"The output's folder `{out.parent}` is not writable. HINT: write somewhere else.")


def convert_to_safetensors(path: Path, out: Path) -> Path:
    """The state dict of a torch.save file (``["state_dict"]`` of a Lightning checkpoint, or a plain dict
    of tensors), read with ``weights_only=True``, written as safetensors; tied keys as in
    :func:`consolidate` (stored once, the others in the ``aliases`` metadata)."""
    import torch

    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as err:
        raise CheckpointError(
            f"`{path}` cannot be read with `torch.load(weights_only=True)`: {str(err).splitlines()[0]}. HINT: lzero"
            " never unpickles arbitrary objects; if you trust the file, save its state dict yourself"
            f" (`torch.save(torch.load(path, weights_only=False)['state_dict'], 'weights.pt')`) and convert that."
        ) from None
    state = obj["state_dict"] if isinstance(obj, dict) and "state_dict" in obj else obj
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"`{path}` holds no state dict (a dict of tensors, or one under 'state_dict'), it holds"
                              f" a {type(obj).__name__}. HINT: convert a file saved from `model.state_dict()` or"
                              " a Lightning checkpoint.")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"`{path}`: state dict entry {key!r} is a {type(value).__name__}, not a tensor"
                                  " under a str key; safetensors holds tensors only. HINT: drop that entry and save"
                                  " the rest with torch.save, then convert that file.")
    def same(t: torch.Tensor) -> tuple:  # tied keys are one tensor: same storage, offset, shape, stride, dtype
        return t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype

    first: dict[tuple, str] = {}  # a tensor -> the first key holding it
    for key, t in state.items():
        first.setdefault(same(t), key)
    stored = list(first.values())
    tied = {key: name for key, t in state.items() if (name := first[same(t)]) != key}
    entries = [(key, state[key].dtype, tuple(state[key].shape)) for key in stored]
    with SafetensorsStreamWriter(out, entries, {"aliases": json.dumps(tied), "format": "lzero-consolidated"}) as w:
        for key in stored:
            w.write(key, state[key])
    return out


def dtype_shape(reader: PiecedCheckpoint, key: str) -> tuple[Any, tuple[int, ...]]:
    import torch

    name = reader.param_name(key)
    if name is not None:
        return torch.float32, tuple(reader.manifest["params"][name]["shape"])
    if key in reader.derived_keys():
        return reader.derived_layout(key)
    rest = reader.lightning_state()["lzero/module_state"][key]
    return rest.dtype, tuple(rest.shape)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="consolidating", disable=not enabled)


def inspect(checkpoint_dir: Any) -> dict[str, Any]:
    """The checkpoint's metadata (validated, as for loading), without reading a tensor. Parameters are
    counted twice: the trainable ones (sharded, what the optimizer steps) and all of the module's
    (plus frozen parameters and buffers, which a checkpoint does not tell apart)."""
    source = Path(checkpoint_dir)
    if source_kind(source, "inspect") == "torch":
        raise CheckpointError(_plain_file(source) + " `lzero inspect` reads sharded checkpoint directories. HINT:"
                              " look inside with"
                              f" `torch.load('{source}', weights_only=True, mmap=True)`.")
    if deepspeed_tag_folder(source) is not None:
        raise CheckpointError(f"`{source}` is a DeepSpeed checkpoint folder; `lzero inspect` reads lzero's. HINT: write"
                              f" it as one with `lzero import-deepspeed {source} DST`, then `lzero inspect DST`.")
    reader = ShardedCheckpoint(source)
    m = reader.manifest
    trainable = sum(p["numel"] for p in m["params"].values() if not p.get("frozen"))
    frozen = sum(p["numel"] for p in m["params"].values() if p.get("frozen"))
    other = reader.module_state_numel() + frozen
    needs = _resume_needs(reader, trainable, frozen)
    tensor = m.get("tensor_parallel")  # [Note: tensor-parallel checkpoints] in lzero/engine/tensor_layout.py
    saved = needs.get((m.get("stage"), m["world_size"]))
    if tensor is not None:
        split = sum(m["params"][name]["numel"] for name in tensor["params"])
        saved = _saved_layout_needs(reader, trainable, frozen, split, tensor["size"])
    return {
        "path": str(reader.path), "save_id": m["save_id"], "world_size": m["world_size"], "stage": m.get("stage"),
        "precision": m.get("precision"), "global_step": m.get("global_step"), "epoch": m.get("epoch"),
        "trainable_parameters": trainable, "frozen_parameters_and_buffers": other,
        "total_parameters": trainable + other,
        "state_dict_keys": len(m["state_dict_keys"]), "optimizer_state": not m.get("weights_only", False),
        "tensor_parallel": None if tensor is None else (
            f"{tensor['size']} ({len(tensor['params'])} of {len(m['params'])} parameters, {split:,} of {trainable:,}"
            " trainable elements, split over the tensor ranks)"),
        "model_states_bytes_per_rank": saved,
        "resume_needs": needs,
        "files": [(f["name"], f["bytes"]) for f in m["files"]],
        "frozen_base": None if "base" not in m else {
            "tensors": len(m["base"]["tensors"]) + len(m["base"].get("whole", {})),
            "files": {path: info["bytes"] for path, info in m["base"]["files"].items()}},
    }


def _resume_needs(reader: ShardedCheckpoint, trainable: int, frozen: int) -> dict[tuple[int, int], int]:
    """(stage, world size) -> the model-state bytes per rank between steps (lzero.memory.estimate), for stages 1-3 at world
    sizes 1, 2, 4, 8 and the saved one: what resuming this checkpoint at another stage or world size needs. The
    optimizer's per-element state is counted from the checkpoint (4 bytes per fp32 state tensor). Frozen parameters
    count only where the checkpoint marks them (zero3 saves); zero1/2 saves keep them with the buffers."""
    from lzero.memory.estimate import ModelCount

    kept = _kept_states(reader)
    return {(stage, world): _between_steps(stage, ModelCount(trainable, frozen if stage == 3 else 0), world, *kept)
            for world in sorted({1, 2, 4, 8, reader.manifest["world_size"]}) for stage in (1, 2, 3)}


def _saved_layout_needs(reader: ShardedCheckpoint, trainable: int, frozen: int, split: int, size: int) -> int:
    """The saving tensor-parallel run's model states per rank: ``split`` elements over the ``size`` tensor ranks, ZeRO
    over the world's data ranks."""
    from lzero.memory.estimate import ModelCount

    m = reader.manifest
    stage = m.get("stage") or 1
    count = ModelCount(trainable, frozen if stage == 3 else 0, tensor_sharded=split).per_tensor_rank(size)
    return _between_steps(stage, count, m["world_size"] // size, *_kept_states(reader))


def _kept_states(reader: ShardedCheckpoint) -> tuple[str, float]:
    """The checkpoint's precision as the estimate names it, and its optimizer's per-element bytes (4 per fp32 state
    tensor it holds)."""
    m = reader.manifest
    first = next((n for n, p in m["params"].items() if not p.get("frozen")), None)
    keys = reader.optimizer_keys(0, first) if first is not None and not m.get("weights_only") else []
    optimizer_bytes = 4 * sum(1 for k in keys if not reader.is_scalar(f"optim/0/{first}/{k}"))
    return ("bf16-mixed" if m.get("precision") in ("bf16-mixed", "16-mixed") else "32-true"), optimizer_bytes


def _between_steps(stage: int, count: Any, world: int, precision: str, optimizer_bytes: float) -> int:
    """A rank's model-state bytes between steps (gradients not held) at ``stage`` over ``world`` data ranks."""
    from lzero.config import ZeroConfig
    from lzero.memory.estimate import model_states

    per_rank = model_states(ZeroConfig(stage=stage), count, world, precision, optimizer_bytes)
    return sum(v for kinds in per_rank.values() for k, v in kinds.items() if k != "gradients")


def consolidate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lzero consolidate", description=consolidate.__doc__)
    parser.add_argument("checkpoint_dir", help="a sharded checkpoint directory, a DeepSpeed ZeRO checkpoint folder"
                                               " (or a plain .ckpt, for .safetensors)")
    parser.add_argument("out", help="output file: .ckpt, .pt, .pth or .safetensors (replaced if it exists)")
    args = parser.parse_args(argv)
    try:
        out = consolidate(args.checkpoint_dir, args.out, progress=sys.stderr.isatty())
    except CheckpointError as err:
        print(f"lzero consolidate: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def inspect_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lzero inspect", description=inspect.__doc__)
    parser.add_argument("checkpoint_dir")
    args = parser.parse_args(argv)
    try:
        info = inspect(args.checkpoint_dir)
    except CheckpointError as err:
        print(f"lzero inspect: {err}", file=sys.stderr)
        return 1
    for key, value in info.items():
        if key not in ("files", "resume_needs", "frozen_base") and not (key == "tensor_parallel" and value is None):
            print(f"{key}: {value}")
    base = info["frozen_base"]
    if base is not None:  # [Note: a checkpoint without its frozen base] in base_files.py
        print(f"frozen_base: {base['tensors']} tensors read from {len(base['files'])} pretrained files (checked:"
              " sizes and SHA-256):")
        for path, size in base["files"].items():
            print(f"  {path}  {size} bytes")
    worlds = sorted({world for _, world in info["resume_needs"]})
    print("model states per rank between steps, by stage and world size (lzero.memory.estimate; activations not included):")
    print("  " + "stage".ljust(7) + "".join(f"N={w}".rjust(14) for w in worlds))
    for stage in (1, 2, 3):
        print("  " + f"zero{stage}".ljust(7) + "".join(f"{info['resume_needs'][(stage, w)]:,}".rjust(14) for w in worlds))
    print("files:")
    for name, size in info["files"]:
        print(f"  {name}  {size} bytes")
    return 0
