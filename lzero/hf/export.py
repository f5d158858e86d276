"""``lzero export-hf``: an lzero checkpoint written as a Hugging Face ``save_pretrained`` folder.

[Note: exporting to a Hugging Face folder]
The output is what ``save_pretrained`` writes: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
files of at most ``max_shard_size`` bytes with ``model.safetensors.index.json``; metadata ``{"format": "pt"}``;
keys without the LightningModule's attribute prefix (``model.``); a tied tensor saved once, under its first key
(the one transformers keeps: ``transformer.wte.weight``, not ``lm_head.weight``); ``config.json`` and
``generation_config.json`` (and tokenizer files) copied from ``--config``, with ``dtype`` set to the exported
dtype. It streams: tensors are read one at a time from the checkpoint's shards and a file is written once it is
full, so peak memory stays near one output file. It is written into a temporary folder beside the output and
renamed at the end: an interrupted export leaves no folder that looks complete. A peft LoRA model is written with
its adapters alone (``adapters_only``) or folded into its base (``merge``, see [Note: a merged export] in merge.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lzero.checkpoint import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                "added_tokens.json", "chat_template.jinja")


def parse_size(size: Any) -> int:
    """``5GB``, ``500MB``, ``20KB`` or a number of bytes (decimal units, as transformers reads them)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", str(size), re.IGNORECASE)
    if match is None:
        raise CheckpointError(f"max_shard_size {size!r} is not a size. HINT: write it like 5GB, 500MB or 1000000.")
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    return int(float(match.group(1)) * units.get((match.group(2) or "").lower(), 1))


class _Source:
    """The state dict of a checkpoint, key by key: a sharded lzero directory or a plain torch/Lightning file."""

    def __init__(self, path: Path) -> None:
        from lzero.checkpoint.consolidate import dtype_shape, source_kind

        self.kind = source_kind(path, "export")
        if self.kind == "sharded":
            from lzero.checkpoint.reader import ShardedCheckpoint

            reader = ShardedCheckpoint(path)
            self.keys: list[str] = list(reader.manifest["state_dict_keys"])
            self._same = lambda key: reader.param_name(key) or key
            self.read: Callable[[str], torch.Tensor] = reader.state_tensor
            self.dtype_shape = lambda key: (reader.dtype(f"param/{reader.param_name(key)}"),  # no tensor read
                                            tuple(reader.manifest["params"][reader.param_name(key)]["shape"])) \
                if reader.param_name(key) is not None else dtype_shape(reader, key)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            state = obj["state_dict"] if isinstance(obj, dict) and "state_dict" in obj else obj
            self.keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            self._same = lambda key: (state[key].untyped_storage().data_ptr(), state[key].storage_offset(),
                                      tuple(state[key].shape))
            self.read = lambda key: state[key]
            self.dtype_shape = lambda key: (state[key].dtype, tuple(state[key].shape))

    def first_keys(self) -> list[str]:
        """Every key whose tensor no earlier key holds: a tied tensor once, under its first key."""
        seen, out = set(), []
        for key in self.keys:
            if self._same(key) not in seen:
                seen.add(self._same(key))
                out.append(key)
        return out


def export_hf(checkpoint: Any, out_dir: Any, dtype: Optional[str] = None, max_shard_size: Any = "5GB",
              config: Any = None, prefix: Optional[str] = None, overwrite: bool = False,
              adapters_only: bool = False, merge: bool = False, adapter_config: Any = None) -> dict[str, Any]:
    """Write ``checkpoint`` (an lzero checkpoint directory, or a plain Lightning/torch file) as a Hugging Face
    folder at ``out_dir``; see [Note: exporting to a Hugging Face folder]. ``dtype``: ``fp32``, ``bf16`` or
    ``fp16`` for the floating tensors (default: as stored, fp32 for lzero's masters). ``prefix``: the
    LightningModule attribute holding the model, with its dot (default: the one prefix every key shares).
    ``adapters_only``: a peft model's LoRA adapters alone, as peft's ``save_pretrained`` writes them
    (``adapter_model.safetensors``, keys without the adapter name, ``adapter_config.json`` from ``config``).
    ``merge``: the plain model peft's ``merge_and_unload()`` gives, the adapters folded into the base (a quantized
    base dequantized, into bf16 unless ``dtype`` says otherwise); ``adapter_config``: the adapter's configuration,
    a folder holding ``adapter_config.json`` (default: ``config``, when it holds one), or a peft ``LoraConfig`` (or
    its dict). See [Note: a merged export] in merge.py. Returns what was written: files, keys, the prefix, the keys
    left out (outside the prefix), and with ``merge`` how many weights were merged and dequantized."""
    source_path, out = Path(checkpoint), Path(out_dir)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}. HINT: --dtype bf16, fp16 or fp32.")
    if merge and adapters_only:
        raise CheckpointError("--merge and --adapters-only ask for two different exports. HINT: pass one: --merge"
                              " for the base with the adapters folded in, --adapters-only for the adapters alone.")
    limit = parse_size(max_shard_size)
    _check_out(out, overwrite)
    wanted = "adapter_config.json" if adapters_only else "config.json"
    if (config is not None or adapters_only) and not (Path(config or ".") / wanted).is_file():
        raise CheckpointError(f"--config `{config}` holds no {wanted}. HINT: pass the folder "
                              + ("peft's `save_pretrained` wrote (or where `peft_config['default'].save_pretrained`"
                                 " put adapter_config.json)." if adapters_only else
                                 "the model was loaded from (the pretrained model's folder)."))
    source = _Source(source_path)
    keys = source.first_keys()
    if prefix is None:  # a peft model saved on its own: its keys begin with base_model.model., which merge removes
        peft = merge and all(k.startswith("base_model.model.") for k in source.keys)
        prefix = "" if peft else _prefix(source.keys)
    kept = [k for k in keys if k.startswith(prefix) and (not adapters_only or _ADAPTER.search(k))]
    left_out = [k for k in keys if not k.startswith(prefix)]
    if adapters_only:
        _refuse_modules_to_save(keys)
    elif not merge and any(_ADAPTER.search(k) for k in kept):
        raise CheckpointError(
            f"`{source_path}` holds peft LoRA adapters ({next(k for k in kept if _ADAPTER.search(k))}, ...). HINT:"
            " pass --merge (with --adapter-config DIR_WITH_adapter_config.json) for the base with the adapters folded"
            " in, or --adapters-only for the adapters alone (then `PeftModel.from_pretrained(base, OUT_DIR)`).")
    if not kept:
        raise CheckpointError(f"No key of `{source_path}` starts with the prefix {prefix!r}; its keys start with"
                              f" {sorted({k.split('.')[0] + '.' for k in keys})}. HINT: pass --prefix with the"
                              " LightningModule attribute that holds the model, e.g. --prefix model.")
    target = DTYPES[dtype] if dtype else None
    merged = None
    if merge and kept:
        from lzero.hf.merge import MergedSource

        settings = _lora_settings(adapter_config, config) if any(_ADAPTER.search(k) for k in kept) else None
        merged = MergedSource(source.read, source.dtype_shape, kept, prefix, settings, target)
        if merged.quantized and target is None:  # codes have no dtype of their own to keep
            target = merged.dtype = torch.bfloat16
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    try:
        if adapters_only:
            files = _write_adapters(source, kept, prefix, target, staging)
            shutil.copy2(Path(config) / "adapter_config.json", staging / "adapter_config.json")
        elif merged is not None:
            files = _write_weights(merged, merged.keys, "", target, limit, staging)
            if config is not None:
                _copy_config(Path(config), staging, target, plain=True)
        else:
            files = _write_weights(source, kept, prefix, target, limit, staging)
            if config is not None:
                _copy_config(Path(config), staging, target)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    done = {"files": files, "keys": len(kept), "prefix": prefix, "left_out": left_out}
    if merged is not None:
        done.update(keys=len(merged.keys), merged=merged.merged, dequantized=merged.quantized)
    return done


def _lora_settings(adapter_config: Any, config: Any) -> Any:
    """The adapter's configuration for a merge: a ``LoraConfig`` (or its dict) as given, else ``adapter_config.json``
    from ``adapter_config`` or, without it, from ``config``. None when neither folder holds one."""
    from lzero.hf.merge import LoraSettings

    if adapter_config is not None and not isinstance(adapter_config, (str, os.PathLike)):
        return LoraSettings.of(adapter_config, "The adapter configuration")
    if adapter_config is not None:
        if not (Path(adapter_config) / "adapter_config.json").is_file():
            raise CheckpointError(f"--adapter-config `{adapter_config}` holds no adapter_config.json. HINT: pass the"
                                  " folder peft's `save_pretrained` (or `ExportHF(adapters_only=True)`) wrote, or where"
                                  " `peft_config['default'].save_pretrained(DIR)` put it.")
        return LoraSettings.read(adapter_config)
    if config is not None and (Path(config) / "adapter_config.json").is_file():
        return LoraSettings.read(config)
    return None


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"The output `{out}` is a file. HINT: name a folder to create.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"The output folder `{out}` is not empty. HINT: name a new folder, or pass --overwrite"
                              " to replace it (it is replaced only once the export is complete).")


def _prefix(keys: list[str]) -> str:
    """The attribute prefix every key shares (``model.``), or none."""
    firsts = {k.split(".")[0] for k in keys}
    return f"{firsts.pop()}." if len(firsts) == 1 and all("." in k for k in keys) else ""


def _write_weights(source: _Source, keys: list[str], prefix: str, target: Optional[torch.dtype], limit: int,
                   folder: Path) -> list[str]:
    """Safetensors files of at most ``limit`` bytes (one tensor larger than that gets a file of its own)."""
    from safetensors.torch import save_file

    groups: list[list[str]] = [[]]
    size, sizes = 0, {}
    for key in keys:  # the plan, from shapes and dtypes only
        nbytes = _nbytes(source, key, target)
        sizes[key] = nbytes
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, group in zip(names, groups):
        tensors = {}
        for key in group:
            t = source.read(key)
            if target is not None and t.is_floating_point():
                t = t.to(target)
            tensors[key[len(prefix):]] = t.contiguous()
            weight_map[key[len(prefix):]] = name
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


_ADAPTER = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)(\.|$)")
"""A peft LoRA tensor's key: the adapter's name follows the LoRA module's (``lora_A.default.weight``)."""


def _refuse_modules_to_save(keys: list[str]) -> None:
    saved = [k for k in keys if ".modules_to_save." in k]
    if saved:
        raise CheckpointError(f"The peft model also trains whole modules (`modules_to_save`: {saved[:3]}...), which"
                              " --adapters-only does not write. HINT: export the merged model with --merge instead"
                              " of --adapters-only.")


def _write_adapters(source: _Source, keys: list[str], prefix: str, target: Optional[torch.dtype],
                    folder: Path) -> list[str]:
    """``adapter_model.safetensors`` with peft's keys: the adapter's name removed (``lora_A.weight``)."""
    from safetensors.torch import save_file

    tensors = {}
    for key in keys:
        t = source.read(key)
        name = _ADAPTER.sub(lambda m: f".{m.group(1)}{m.group(3)}", key[len(prefix):])
        tensors[name] = (t.to(target) if target is not None and t.is_floating_point() else t).contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return ["adapter_model.safetensors"]


def _nbytes(source: _Source, key: str, target: Optional[torch.dtype]) -> int:
    dtype, shape = source.dtype_shape(key)
    if target is not None and dtype.is_floating_point:
        dtype = target
    return math.prod(shape) * dtype.itemsize


def _copy_config(config: Path, folder: Path, target: Optional[torch.dtype], plain: bool = False) -> None:
    """The configuration files, config.json with the exported dtype (``plain``: and no ``quantization_config``, so
    that ``from_pretrained`` builds unquantized layers for the merged weights)."""
    for name in CONFIG_FILES:
        if (config / name).is_file():
            shutil.copy2(config / name, folder / name)
    data = json.loads((folder / "config.json").read_text())
    edited = dict(data)
    if target is not None:  # from_pretrained(dtype="auto") then loads what was written
        edited["dtype"] = str(target).removeprefix("torch.")
        edited.pop("torch_dtype", None)
    if plain:
        edited.pop("quantization_config", None)
    if edited != data:
        (folder / "config.json").write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")


def export_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lzero export-hf", description=export_hf.__doc__)
    parser.add_argument("checkpoint", help="an lzero checkpoint directory (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (must be new or empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the floating tensors (default: as stored;"
                                                               " bf16 for a quantized base under --merge)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest weight file (default 5GB)")
    parser.add_argument("--config", help="the pretrained model's folder: config.json, generation_config.json and"
                                         " tokenizer files are copied from it")
    parser.add_argument("--prefix", help="the LightningModule attribute holding the model, with its dot (default:"
                                         " the prefix every key shares, e.g. model.)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    parser.add_argument("--adapters-only", action="store_true", help="a peft model's LoRA adapters alone"
                        " (adapter_model.safetensors; --config names the folder holding adapter_config.json)")
    parser.add_argument("--merge", action="store_true", help="a peft model's LoRA adapters folded into its base, as"
                        " peft's merge_and_unload() does: a plain model (a bitsandbytes-quantized base dequantized,"
                        " config.json without quantization_config)")
    parser.add_argument("--adapter-config", help="with --merge: the folder holding the adapter's adapter_config.json"
                                                 " (default: --config, when it holds one)")
    args = parser.parse_args(argv)
    try:
        done = export_hf(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.config, args.prefix,
                         args.overwrite, args.adapters_only, args.merge, args.adapter_config)
    except CheckpointError as err:
        print(f"lzero export-hf: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir}: {done['keys']} tensors in {len(done['files'])} file(s), prefix {done['prefix']!r}"
          " removed")
    if done["left_out"]:
        print(f"left out (outside the prefix): {done['left_out']}")
    if args.merge:
        print(f"merged the LoRA adapters of {done['merged']} weight(s), dequantized {done['dequantized']}"
              if done["merged"] or done["dequantized"] else
              "note: --merge found no LoRA adapters and no quantized weight: the model was exported as it is")
    if args.config is None and not args.adapters_only:
        print("note: no --config given, so the folder has no config.json; `from_pretrained` needs one. HINT: pass"
              " --config with the pretrained model's folder.")
    return 0
