"""Throughput of lzero's NVMe swap files (lzero/offload/nvme.py) against a raw O_DIRECT sequential write and read of the
same bytes in the same folder, in the same run: the comparison of issue 13's acceptance 3.

    python -m benchmarks.offload.bench_nvme_io                  # a temporary folder on the repository's disk
    python -m benchmarks.offload.bench_nvme_io --folder /mnt/nvme/tmp --total-mb 1024

For each ``threads`` x ``block_size`` x key size:

- ``lzero``: a fresh :class:`SwapFiles` (``queue_depth`` 8); ``--total-mb`` of random bytes in keys of the key
  size, all writes submitted at once and waited for, then all reads (into the same buffers). Throughput is
  bytes over the wall time from the first submit to the last completion.
- ``raw``: :func:`raw_throughput`: one file of the same bytes written then read with O_DIRECT by ``threads``
  threads each moving every ``threads``-th ``block_size`` block from its own aligned buffer.

Both write fresh files (the swap files of a training step overwrite blocks already allocated). The measurements
alternate for ``--rounds`` rounds and each keeps its best, so a slow moment of the shared machine does not land
on one side only. GB/s is 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, out_path, run_header, write_report
from lzero.offload.nvme import SwapFiles, aligned_empty
from lzero.offload.nvme_checks import raw_throughput

MiB = 1 << 20


def measure_lzero(folder: Path, buffers: list[torch.Tensor], threads: int, block_size: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) of all ``buffers`` through a fresh SwapFiles in ``folder``."""
    nbytes = sum(b.numel() for b in buffers)
    with SwapFiles(folder, rank=0, block_size=block_size, queue_depth=8, threads=threads) as files:
        assert files.direct, f"{folder} refused O_DIRECT: this benchmark measures direct I/O"
        start = time.perf_counter()
        futures = [files.write(f"k{i}", b) for i, b in enumerate(buffers)]
        for future in futures:
            future.result()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        futures = [files.read(f"k{i}", b) for i, b in enumerate(buffers)]
        for future in futures:
            future.result()
        read_s = time.perf_counter() - start
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def file_system(folder: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(folder)], capture_output=True, text=True, check=True).stdout
        device, kind = out.splitlines()[1].split()[:2]
        return f"{kind} on {device}"
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        return "unknown file system"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder"
                        " under the repository, on its disk)")
    parser.add_argument("--total-mb", type=int, default=256, help="MiB written and read per measurement")
    parser.add_argument("--key-mb", default="4,64", help="comma-separated key (file) sizes in MiB")
    parser.add_argument("--threads", default="1,2,8", help="comma-separated worker thread counts")
    parser.add_argument("--block-kib", default="1024,8192", help="comma-separated block sizes in KiB")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; each measurement keeps its best")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/offload/nvme_io.<machine>.<date>.md)")
    args = parser.parse_args()
    args.out = out_path(args.out, "offload", "nvme_io")

    folder = Path(tempfile.mkdtemp(prefix=".bench-nvme-", dir=args.folder or REPO))
    total = args.total_mb * MiB
    key_sizes = [int(k) * MiB for k in args.key_mb.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    blocks = [int(b) * 1024 for b in args.block_kib.split(",")]
    payload = torch.randint(0, 256, (total,), dtype=torch.uint8)
    best: dict[tuple, list[float]] = {}
    started = time.perf_counter()
    try:
        for round_ in range(args.rounds):
            for threads in threads_list:
                for block in blocks:
                    raw = raw_throughput(folder, total, block_size=block, threads=threads)
                    assert raw.direct, f"{folder} refused O_DIRECT"
                    runs = {("raw",): (raw.write_gbps, raw.read_gbps)}
                    for key_size in key_sizes:
                        buffers = [aligned_empty(min(key_size, total - at), torch.uint8).copy_(payload[at : at + key_size])
                                   for at in range(0, total, key_size)]
                        runs[("lzero", key_size)] = measure_lzero(folder, buffers, threads, block)
                        del buffers
                    for what, (write, read) in runs.items():
                        kept = best.setdefault((threads, block) + what, [0.0, 0.0])
                        kept[0], kept[1] = max(kept[0], write), max(kept[1], read)
            print(f"round {round_ + 1}/{args.rounds} done at {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        where = file_system(folder)
        shutil.rmtree(folder, ignore_errors=True)

    rows = []
    for threads in threads_list:
        for block in blocks:
            raw_w, raw_r = best[(threads, block, "raw")]
            for key_size in key_sizes:
                w, r = best[(threads, block, "lzero", key_size)]
                rows.append(f"| {threads} | {block // 1024:,} KiB | {key_size // MiB} MiB x {-(-total // key_size)} |"
                            f" {w:.2f} | {raw_w:.2f} | {w / raw_w:.2f} | {r:.2f} | {raw_r:.2f} | {r / raw_r:.2f} |")
    command = f"python -m {__spec__.name}" + "".join(f" {a}" for a in sys.argv[1:])
    table = "\n".join([
        run_header(),
        "",
        f"NVMe swap-file throughput: lzero SwapFiles (queue_depth 8) vs a raw O_DIRECT sequential write/read of the"
        f" same {total:,} bytes in the same folder ({where}), same run; best of {args.rounds} alternating rounds;"
        f" GB/s = 1e9 bytes/s; fresh files each time; {time.perf_counter() - started:.0f} s.",
        "",
        f"`{command}`",
        "",
        "| threads | block_size | keys | lzero write | raw write | write ratio | lzero read | raw read | read ratio |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    print(table)
    if args.out is not None:
        write_report(args.out, table)


if __name__ == "__main__":
    main()
