"""Time gloo collectives on flat fp32 buffers, 2 ranks: why lzero reduces by all-reduce on gloo.

    python benchmarks/bench_collectives.py     # writes benchmarks/results_collectives.md
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (5_000_000, 50_000_000)  # elements
REPEATS = 5
OUT = Path(__file__).with_name("results_collectives.md")


def _time(fn) -> float:
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / REPEATS


def _rank(rank: int, world_size: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = []
    for n in SIZES:
        flat, shard, full = torch.randn(n), torch.empty(n // world_size), torch.empty(n)
        rows.append((n, {
            "all_reduce": _time(lambda: dist.all_reduce(flat)),
            "reduce_scatter": _time(lambda: dist.reduce_scatter_single(shard, flat)),
            "all_gather": _time(lambda: dist.all_gather_single(full, shard)),
        }))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    lines = [f"gloo, 2 ranks on this machine ({os.cpu_count()} CPUs), 1 thread each, fp32, mean of {REPEATS}; torch {torch.__version__}.",
             "", "| elements | MB | all_reduce ms | reduce_scatter ms | all_gather ms |", "|---|---|---|---|---|"]
    for n, t in rows:
        lines.append(f"| {n:,} | {4 * n / 1e6:.0f} | {1e3 * t['all_reduce']:.0f} | {1e3 * t['reduce_scatter']:.0f}"
                     f" | {1e3 * t['all_gather']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
