"""Sharded checkpoint throughput and consolidation memory for a ~100M-parameter model.

    python -m benchmarks.checkpoint.bench_checkpoint [--layers 25 --width 2000] [--out PATH]
    # default: results/checkpoint/checkpoint.<machine>.<date>.md

One process (world size 1: the figures are per-rank bandwidth), AdamW state present, so the
checkpoint holds 3 fp32 values per parameter. Measured: the sharded save (SaveJob: pieces, file,
fsync, manifest commit), the load into a fresh engine (validation, parameters and optimizer state
read into the shards), a plain copy of the same bytes (read + write + fsync, the bound a save or a
load could reach on this disk), and `lzero consolidate` to a .ckpt with its peak memory growth.
Each timing is the best of --repeats runs; the page cache is warm for every reader alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.checkpoint.ckpt_model import build, save
from benchmarks.common import out_path, publish, run_header
from lzero.checkpoint.reader import ShardedCheckpoint
from lzero.checkpoint.sharded import load_optimizer_shards
from lzero.checkpoint.state_dict import load_params


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_with_fsync(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def read_all(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


CONSOLIDATE = r"""
import sys
from lzero.checkpoint.consolidate import consolidate
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
consolidate(sys.argv[1], sys.argv[2])
print("GROWN", hwm() - before)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--width", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/checkpoint/checkpoint.<machine>.<date>.md)")
    args = parser.parse_args()
    out = out_path(args.out, "checkpoint", "checkpoint")
    torch.set_num_threads(os.cpu_count() or 1)
    model, engine, zopt = build(args.layers, args.width, adam_state=True)
    psi = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        counter = iter(range(1000))

        def do_save() -> None:
            save(root / f"s{next(counter)}.ckpt", model, engine, zopt)

        t_save = best(do_save, args.repeats)
        directory = root / "s0.ckpt"
        shard = next(directory.glob("shard-*"))
        nbytes = shard.stat().st_size

        def do_load() -> None:
            reader = ShardedCheckpoint(directory)
            load_params(engine, lambda name, a, b: reader.read_range(f"param/{name}", a, b))
            load_optimizer_shards(zopt, 0, reader)

        t_load = best(do_load, args.repeats)
        t_copy = best(lambda: copy_with_fsync(shard, root / "copy.bin"), args.repeats)
        t_read = best(lambda: read_all(shard), args.repeats)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CONSOLIDATE, str(directory), str(root / "model.ckpt")],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        t_consolidate = time.perf_counter() - start
        grown = int(proc.stdout.split("GROWN")[1])
        out_bytes = (root / "model.ckpt").stat().st_size
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    lines = [
        f"# Sharded checkpoint throughput ({psi / 1e6:.1f}M parameters, AdamW state, world size 1)",
        "",
        run_header(),
        "",
        f"`python -m {__spec__.name} --layers {args.layers} --width {args.width}`; shard file"
        f" {nbytes / 1e9:.2f} GB; best of {args.repeats}.",
        "",
        "| operation | seconds | GB/s | time vs its plain-file bound |",
        "|---|---|---|---|",
        f"| plain copy of the shard file (read + write + fsync): the bound for a save | {t_copy:.2f} |"
        f" {gbps(t_copy):.2f} | |",
        f"| plain read of the shard file (64 MB reads): the bound for a load | {t_read:.2f} | {gbps(t_read):.2f} | |",
        f"| sharded save (pieces, write, fsync, manifest commit) | {t_save:.2f} | {gbps(t_save):.2f} |"
        f" {t_save / t_copy:.2f}x the copy |",
        f"| sharded load (validate, read params + optimizer state into the shards) | {t_load:.2f} |"
        f" {gbps(t_load):.2f} | {t_load / t_read:.2f}x the read |",
        "",
        f"`lzero consolidate` to .ckpt (parameters only, {out_bytes / 1e6:.0f} MB, fresh process):"
        f" {t_consolidate:.2f} s including start-up; peak memory grew {grown / 1e6:.1f} MB, largest tensor"
        f" {largest / 1e6:.1f} MB ({grown / largest:.2f}x).",
    ]
    publish(lines, out)


if __name__ == "__main__":
    main()
