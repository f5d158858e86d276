"""Time gloo's collectives and lzero's pairwise ones (collectives.py) on flat fp32 buffers, 2 and 4 ranks: why lzero
runs its reduce-scatters and all-gathers point to point on gloo.

    python -m benchmarks.collectives.bench_collectives   # writes results/collectives/collectives.<machine>.<date>.md
    python -m benchmarks.collectives.bench_collectives --sizes 100000 --ranks 2 --out none   # a quick look
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import out_path, publish, run_header
from lzero.engine import collectives

SIZES = "5000000,50000000"  # elements
REPEATS = 5


def _time(fn) -> float:
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / REPEATS


def _rank(rank: int, world_size: int, port: int, sizes: list[int], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = []
    for n in sizes:
        flat, shard, full = torch.randn(n), torch.empty(n // world_size), torch.empty(n)
        rows.append((n, {
            "all_reduce": _time(lambda: dist.all_reduce(flat)),
            "reduce_scatter": _time(lambda: dist.reduce_scatter_single(shard, flat)),
            "all_gather": _time(lambda: dist.all_gather_single(full, shard)),
            "lzero_reduce_scatter": _time(lambda: collectives.reduce_scatter(shard, flat)),
            "lzero_all_gather": _time(lambda: collectives.all_gather(full, shard)),
        }))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _measure(world_size: int, sizes: list[int]) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, sizes, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=SIZES, help="comma-separated buffer sizes, in elements")
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/collectives/collectives.<machine>.<date>.md)")
    args = parser.parse_args()
    out = out_path(args.out, "collectives", "collectives")
    sizes = [int(n) for n in args.sizes.split(",")]
    lines = [run_header(), "",
             f"gloo, 1 thread per rank, fp32, mean of {REPEATS}. gloo's own collectives, then lzero's"
             " (lzero/engine/collectives.py: point to point on gloo).", "",
             "| ranks | elements | MB | gloo all_reduce ms | gloo reduce_scatter ms | gloo all_gather ms"
             " | lzero reduce_scatter ms | lzero all_gather ms |", "|---|---|---|---|---|---|---|---|"]
    for world_size in (int(r) for r in args.ranks.split(",")):
        for n, t in _measure(world_size, sizes):
            lines.append(f"| {world_size} | {n:,} | {4 * n / 1e6:.0f} | " + " | ".join(
                f"{1e3 * t[k]:.0f}" for k in ("all_reduce", "reduce_scatter", "all_gather", "lzero_reduce_scatter",
                                              "lzero_all_gather")) + " |")
    publish(lines, out)


if __name__ == "__main__":
    main()
