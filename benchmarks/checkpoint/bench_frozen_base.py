"""The bytes of a LoRA and a QLoRA checkpoint with and without the frozen base, zero3, world size 2.

    python -m benchmarks.checkpoint.bench_frozen_base [--out PATH]
    # default: results/checkpoint/frozen_base.<machine>.<date>.md

Two fine-tunes of about 355M parameters, each built by ``from_pretrained`` in ``configure_model``
(``lzero.demo.finetune.FinetuneHF``) and trained two steps (byte tokens, blocks of 16, batch 1 per rank), one
checkpoint per step:

- ``LoRA``: the GPT-2 355M of benchmarks.loading.bench_pretrained_load (24 x 1024, fp32, random weights written with
  ``save_pretrained``), LoRA r=16 on the attention (``c_attn``), ``32-true``, AdamW;
- ``QLoRA``: a Llama of the same size (24 x 1024, MLP 2816, vocabulary 32000, bf16 files), loaded 4-bit NF4 with
  double quantization and bf16 quant storage, LoRA r=16 on ``q_proj``/``v_proj``, ``bf16-true``, AdamW.

Each runs once with ``save_frozen=True`` (the base in every checkpoint, as before issue 57) and once with the
default (``save_frozen=False``: the base read back from the files, [Note: a checkpoint without its frozen base]).
Reported per checkpoint: its bytes on disk (every file of the directory), the bytes of the tensors training changes
(the adapters and their optimizer state, summed from the shard files' headers), the bytes of the manifest's record
of the base, and the checkpoint's size over those two together; and the wall time of the fit (2 steps, 2 saves; the first save without
the base hashes the base files, once per process).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import module_command, module_env, out_path, run_header, write_report

LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False)


def make_llama(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "model.safetensors.index.json").exists():
        return
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size="500MB")


def fit(kind: str, folder: str, out: str, whole: str) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lzero.demo import TextDataModule
    from lzero.demo.finetune import FinetuneHF
    from lzero.lightning.trainer_strategy import ZeroStrategy

    torch.set_num_threads(1)
    strategy = ZeroStrategy(stage=3, save_frozen=whole == "1")
    module = FinetuneHF(folder, lora_rank=16, lora_targets=("c_attn",)) if kind == "lora" else \
        FinetuneHF(folder, dtype="bfloat16", quantization="nf4", lora_rank=16)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                      precision="32-true" if kind == "lora" else "bf16-true", enable_progress_bar=False,
                      limit_val_batches=0, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1)])
    start = time.perf_counter()
    trainer.fit(module, TextDataModule(block_size=16, batch_size=1, steps_per_epoch=2))
    if trainer.is_global_zero:
        print(f"RESULT {time.perf_counter() - start:.1f}")
    dist.destroy_process_group()


def tensor_bytes(checkpoint: Path, prefixes: tuple[str, ...]) -> int:
    """Bytes of the shard files' tensors whose keys start with one of ``prefixes`` (from the headers)."""
    from lzero.checkpoint import TensorFile

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    total = 0
    for f in manifest["files"]:
        file = TensorFile(checkpoint / f["name"])
        for key in file.names:
            if key.startswith(prefixes):
                entry = file.entry(key)
                total += math.prod(entry.shape) * entry.dtype.itemsize
    return total


def measure(checkpoint: Path) -> dict:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    on_disk = sum(p.stat().st_size for p in checkpoint.iterdir())
    trained = tensor_bytes(checkpoint, ("param/", "optim/"))
    frozen = {n for n, p in manifest["params"].items() if p.get("frozen")}
    written_frozen = tensor_bytes(checkpoint, tuple(f"param/{n}" for n in frozen)) if frozen else 0
    record = len(json.dumps(manifest.get("base", {}))) if "base" in manifest else 0
    return {"bytes": on_disk, "trained": trained - written_frozen, "frozen_written": written_frozen,
            "record": record, "base_tensors": len(manifest.get("base", {}).get("tensors", {}))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpt2", default="/tmp/lzero-bench-gpt2-355m")
    parser.add_argument("--llama", default="/tmp/lzero-bench-llama-355m")
    parser.add_argument("--work", default="/tmp/lzero-bench-frozen-base")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/checkpoint/frozen_base.<machine>.<date>.md)")
    args = parser.parse_args()
    out = out_path(args.out, "checkpoint", "frozen_base")
    from benchmarks.loading.bench_pretrained_load import make_model

    make_model(Path(args.gpt2), 24, 1024)
    make_llama(Path(args.llama))
    rows = []
    for kind, folder in (("lora", args.gpt2), ("qlora", args.llama)):
        for whole in ("1", "0"):
            work = Path(args.work) / f"{kind}-{'whole' if whole == '1' else 'lean'}"
            subprocess.run(["rm", "-rf", str(work)], check=True)
            done = subprocess.run(module_command(__spec__.name, "fit", kind, folder, work, whole), check=True,
                                  capture_output=True, text=True, env=module_env())
            seconds = float(done.stdout.split("RESULT ")[1].split()[0])
            for checkpoint in sorted(work.glob("*.ckpt")):
                rows.append({"kind": kind, "save_frozen": whole == "1", "name": checkpoint.name, "fit_s": seconds,
                             **measure(checkpoint)})
    lines = ["# Checkpoints with and without the frozen base (benchmarks.checkpoint.bench_frozen_base)", "",
             run_header(), "", __doc__.split("\n\n", 2)[2].strip(), "",
             "| fine-tune | save_frozen | checkpoint | bytes on disk | adapters + optimizer state | base record |"
             " frozen tensors written | bytes / (trained + record) | fit s (2 steps, 2 saves) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["bytes"] / (r["trained"] + r["record"])
        lines.append(f"| {'LoRA GPT-2 355M' if r['kind'] == 'lora' else 'QLoRA Llama 355M'} | {r['save_frozen']} |"
                     f" {r['name']} | {r['bytes']:,} | {r['trained']:,} | {r['record']:,} | {r['frozen_written']:,} |"
                     f" {ratio:.3f}x | {r['fit_s']:.0f} |")
    print("\n".join(lines))
    if out is not None:
        write_report(out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fit":
        fit(*sys.argv[2:6])
    else:
        main()
