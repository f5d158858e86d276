"""DeepSpeed's way of loading a pretrained model under ZeRO-3, for benchmarks.loading.bench_pretrained_load:
``zero.Init`` through transformers' ``HfDeepSpeedConfig`` + ``from_pretrained`` (rank 0 reads every file, every
tensor is gathered, written by rank 0 and re-partitioned). Runs in a separate environment with DeepSpeed (never a
dependency of lzero):

    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python -m benchmarks.peers.peer_deepspeed_load FOLDER

Prints one JSON line per rank: the same fields bench_pretrained_load measures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.multiprocessing as mp

from benchmarks.common import proc_bytes, proc_io, require, reset_peak  # the standard library only: no lzero here


def _rank(rank: int, world: int, port: int, folder: str, queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    from transformers import GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (transformers sees ZeRO-3 while it lives)
    torch.distributed.barrier()
    reset_peak()
    rss0, disk0 = proc_bytes("VmRSS"), proc_io("read_bytes")
    start = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
    seconds = time.perf_counter() - start
    held = sum(p.ds_tensor.numel() for p in model.parameters()) * 4
    torch.distributed.barrier()
    queue.put({"way": "DeepSpeed zero.Init + from_pretrained", "rank": rank, "seconds": seconds,
               "peak_growth": proc_bytes("VmHWM") - rss0, "owned_growth": proc_bytes("VmHWM") - rss0,
               "disk_read": proc_io("read_bytes") - disk0, "asked": None, "held": held, "largest": 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the model folder benchmarks.loading.bench_pretrained_load writes")
    args = parser.parse_args()
    require("deepspeed", "run this with the python of an environment that has DeepSpeed (--deepspeed-python)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.folder, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
