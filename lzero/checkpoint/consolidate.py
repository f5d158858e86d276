"""``lzero consolidate`` and ``lzero inspect``: one plain fp32 file from a sharded checkpoint, streamed
one tensor at a time; the checkpoint's metadata without loading a tensor.

``.ckpt``/``.pt`` outputs are torch's format (``torch.load(weights_only=True)`` and
``LightningModule.load_from_checkpoint`` read them): the module's state dict under ``state_dict``
with tied keys sharing one tensor, plus ``pytorch-lightning_version``, ``epoch``, ``global_step``
and ``hyper_parameters``. ``.safetensors`` outputs hold the flat state dict; safetensors cannot
share storage, so a tied key is stored once, under its first name, and the metadata entry
``aliases`` (JSON) maps every other key to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lzero.checkpoint import CheckpointError, SafetensorsStreamWriter, TorchStreamWriter
from lzero.checkpoint.sharded import ShardedCheckpoint

KEPT = ("pytorch-lightning_version", "epoch", "global_step", "hyper_parameters", "hparams_name")
"""What a consolidated file keeps besides the state dict: what ``load_from_checkpoint`` needs."""


def consolidate(checkpoint_dir: Any, out: Any, progress: bool = False) -> Path:
    """Write ``checkpoint_dir`` as one plain fp32 file at ``out`` (``.ckpt``, ``.pt`` or ``.safetensors``);
    peak memory stays near the largest tensor."""
    out = Path(out)
    reader = ShardedCheckpoint(checkpoint_dir)
    if out.suffix not in (".ckpt", ".pt", ".safetensors"):
        raise CheckpointError(f"Cannot tell the format of `{out}`. HINT: end the output name with .ckpt, .pt or"
                              " .safetensors.")
    keys = reader.manifest["state_dict_keys"]
    first_key: dict[str, str] = {}  # what a key holds (its parameter, or itself) -> the first key holding it
    for key in keys:
        first_key.setdefault(reader.param_name(key) or key, key)
    bar = _progress(len(keys), progress)
    if out.suffix == ".safetensors":
        stored = list(first_key.values())
        entries = [(key, *_dtype_shape(reader, key)) for key in stored]
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
        common = reader.lightning_state()
        writer.close({"state_dict": state, **{k: common[k] for k in KEPT if k in common}})
    bar.close()
    return out


def _dtype_shape(reader: ShardedCheckpoint, key: str) -> tuple[Any, tuple[int, ...]]:
    import torch

    name = reader.param_name(key)
    if name is not None:
        return torch.float32, tuple(reader.manifest["params"][name]["shape"])
    rest = reader.lightning_state()["lzero/module_state"][key]
    return rest.dtype, tuple(rest.shape)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="consolidating", disable=not enabled)


def inspect(checkpoint_dir: Any) -> dict[str, Any]:
    """The checkpoint's metadata (validated, as for loading), without reading a tensor."""
    reader = ShardedCheckpoint(checkpoint_dir)
    m = reader.manifest
    return {
        "path": str(reader.path), "save_id": m["save_id"], "world_size": m["world_size"], "stage": m.get("stage"),
        "precision": m.get("precision"), "global_step": m.get("global_step"), "epoch": m.get("epoch"),
        "parameter_count": m.get("parameter_count"), "parameters": len(m["params"]),
        "optimizer_state": not m.get("weights_only", False),
        "files": [(f["name"], f["bytes"]) for f in m["files"]],
    }


def consolidate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lzero consolidate", description=consolidate.__doc__)
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out", help="output file: .ckpt, .pt or .safetensors")
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
        if key != "files":
            print(f"{key}: {value}")
    print("files:")
    for name, size in info["files"]:
        print(f"  {name}  {size} bytes")
    return 0
