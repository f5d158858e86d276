"""``lzero export-hf`` of a 355M-parameter GPT-2 trained one step under zero3 at world size 2: peak memory and time.

    python -m benchmarks.checkpoint.bench_export [--folder /tmp/lzero-bench-gpt2-355m] [--out PATH]
    # default: results/checkpoint/export.<machine>.<date>.md

The model folder is the one benchmarks.loading.bench_pretrained_load writes. Step 1 (``fit``, a launched 2-rank run of
``lzero.demo.finetune.FinetuneHF``, byte tokens, one step) leaves a sharded checkpoint; step 2 exports it in a fresh
process with 500 MB output files and reports that process's peak resident memory growth (``VmHWM``) beside the
largest output file and the largest tensor: the export streams, so it should stay near one output file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import module_command, module_env, out_path, run_header, write_report


def fit(folder: str, out: str) -> None:
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lzero.demo import TextDataModule
    from lzero.demo.finetune import FinetuneHF

    torch.set_num_threads(1)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="zero3", max_steps=1, logger=False,
                      enable_progress_bar=False, limit_val_batches=0,
                      callbacks=[ModelCheckpoint(dirpath=out, save_last=True)])
    trainer.fit(FinetuneHF(folder), TextDataModule(block_size=16, batch_size=1, steps_per_epoch=1))
    import torch.distributed as dist

    dist.destroy_process_group()


def export(checkpoint: str, out: str, config: str) -> None:
    from lzero.hf import export_hf

    def hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    Path("/proc/self/clear_refs").write_text("5")
    before = hwm()
    start = time.perf_counter()
    export_hf(checkpoint, out, max_shard_size="500MB", config=config, overwrite=True)
    seconds = time.perf_counter() - start
    peak = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:"))
    print(f"RESULT {seconds:.2f} {peak - before}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default="/tmp/lzero-bench-gpt2-355m")
    parser.add_argument("--work", default="/tmp/lzero-bench-export")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/checkpoint/export.<machine>.<date>.md)")
    args = parser.parse_args()
    out = out_path(args.out, "checkpoint", "export")
    work = Path(args.work)
    subprocess.run(module_command(__spec__.name, "fit", args.folder, work / "ckpt"), check=True, env=module_env())
    done = subprocess.run(module_command(__spec__.name, "export", work / "ckpt" / "last.ckpt", work / "hf",
                                         args.folder), check=True, capture_output=True, text=True, env=module_env())
    seconds, growth = done.stdout.split("RESULT ")[1].split()
    files = sorted((work / "hf").glob("model-*.safetensors"))
    largest_file = max(f.stat().st_size for f in files)
    total = sum(f.stat().st_size for f in files)
    from safetensors import safe_open

    largest_tensor = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                shape = h.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                largest_tensor = max(largest_tensor, 4 * n)
    lines = ["# `lzero export-hf` of a sharded checkpoint (benchmarks.checkpoint.bench_export)", "", run_header(), "",
             f"GPT-2 355M (24 x 1024), one zero3 step at world size 2, exported in fp32 to {len(files)} files of at most"
             f" 500 MB ({total / 1e6:,.0f} MB in all), in a fresh process.", "",
             "| time s | peak RSS growth MB | largest output file MB | largest tensor MB |", "|---|---|---|---|",
             f"| {float(seconds):.2f} | {int(growth) / 1e6:,.0f} | {largest_file / 1e6:,.0f} | {largest_tensor / 1e6:,.0f} |"]
    print("\n".join(lines))
    if out is not None:
        write_report(out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fit":
        fit(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "export":
        export(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
