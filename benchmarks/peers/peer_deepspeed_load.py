"""DeepSpeed's way of loading a pretrained model under ZeRO-3, for bench_pretrained_load.py: ``zero.Init`` through
transformers' ``HfDeepSpeedConfig`` + ``from_pretrained`` (rank 0 reads every file, every tensor is gathered,
written by rank 0 and re-partitioned). Runs in a separate environment with DeepSpeed (never a dependency of lzero):

    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python benchmarks/peer_deepspeed_load.py FOLDER

Prints one JSON line per rank: the same fields bench_pretrained_load.py measures.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_pretrained_load import _disk_read, _status  # noqa: E402 (torch only: no lzero in this environment)


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
    Path("/proc/self/clear_refs").write_text("5")
    rss0, disk0 = _status("VmRSS"), _disk_read()
    start = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
    seconds = time.perf_counter() - start
    held = sum(p.ds_tensor.numel() for p in model.parameters()) * 4
    torch.distributed.barrier()
    queue.put({"way": "DeepSpeed zero.Init + from_pretrained", "rank": rank, "seconds": seconds,
               "peak_growth": _status("VmHWM") - rss0, "owned_growth": _status("VmHWM") - rss0,
               "disk_read": _disk_read() - disk0, "asked": None, "held": held, "largest": 0})


def main() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, sys.argv[1], queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
