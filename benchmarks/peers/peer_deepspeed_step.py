"""Plain DeepSpeed ZeRO step times on CPU: a peer reference for ``benchmarks.step_time.bench_speed``.

DeepSpeed is never a dependency of lzero. This script runs only in a separate environment that has DeepSpeed,
transformers and a CPU build of torch, and it imports neither lzero nor lightning:

    DS_ACCELERATOR=cpu /work/peers/deepspeed/bin/python -m benchmarks.peers.peer_deepspeed_step \\
        --model wide|deep --stages 1,2,3 --warmup 2 --steps 5      # from the repository root

Two processes (``torch.multiprocessing.spawn``, gloo, one thread each) train a randomly initialised
``transformers.GPT2LMHeadModel`` (seed 0, dropout 0) in fp32 with ``deepspeed.initialize`` and a
``torch.optim.AdamW(lr=1e-4)`` object (so no DeepSpeed op has to be compiled), at each ZeRO stage asked for, one
after another in the same processes with a fresh model and engine per stage. Models:

* ``wide``: 8 layers, width 512, 8 heads, vocabulary 8000, sequences of 128, batch 4 per process;
* ``deep``: 24 layers, width 64, 4 heads, vocabulary 8000, sequences of 32, batch 2 per process.

Step ``i`` of rank ``r`` feeds random token ids from a ``torch.Generator`` seeded ``1000 * i + r``, so every run
sees the same data. Rank 0 times forward + backward + optimizer step with ``time.perf_counter`` (no extra
barriers), skips ``--warmup`` steps and keeps ``--steps``. For each stage rank 0 prints one JSON line to stdout:

    {"strategy": "deepspeed<N>", "model": ..., "times": [seconds...], "peak_rss_mb": [rank0, rank1],
     "deepspeed": "<version>"}

``peak_rss_mb`` is each rank's ``VmHWM`` (MB = KiB / 1024) over that stage, the mark being reset before the stage
(``gc.collect``, ``malloc_trim(0)``, then ``5`` written to ``/proc/self/clear_refs``). DeepSpeed's own log lines
(and the line ``init_distributed`` prints about its shared-memory comm op) are sent to stderr so that stdout holds
only the JSON lines.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.common import require  # the standard library only: no lzero in this environment
from benchmarks.peers.ds_rank import start_rank

WORLD = 2

MODELS = {
    # name: (GPT2Config keywords, sequence length, micro batch per process)
    "wide": (dict(n_layer=8, n_embd=512, n_head=8, vocab_size=8000, n_positions=128), 128, 4),
    "deep": (dict(n_layer=24, n_embd=64, n_head=4, vocab_size=8000, n_positions=32), 32, 2),
}


def _reset_peak_rss() -> None:
    """Hand freed heap back to the OS, then restart the kernel's resident-memory high-water mark."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ds_config(stage: int, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": int(5e8),
            "allgather_bucket_size": int(5e8),
            "stage3_prefetch_bucket_size": int(5e7),
            "stage3_param_persistence_threshold": int(1e5),
        },
    }


def _run_stage(deepspeed, stage: int, model_name: str, warmup: int, steps: int, rank: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    _reset_peak_rss()
    shape, seq_len, batch = MODELS[model_name]
    config = GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(stage, batch))

    times: list[float] = []
    loss = None
    for step in range(warmup + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
        start = time.perf_counter()
        loss = engine(input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)

    peaks: list = [None] * WORLD
    torch.distributed.all_gather_object(peaks, _peak_rss_mb())
    if rank == 0:
        print(json.dumps({"strategy": f"deepspeed{stage}", "model": model_name, "times": times,
                          "peak_rss_mb": peaks, "deepspeed": deepspeed.__version__}), flush=True)
    del engine, optimizer, model, loss
    gc.collect()


def _rank(rank: int, port: int, model_name: str, stages: list[int], warmup: int, steps: int) -> None:
    deepspeed = start_rank(rank, WORLD, port)
    for stage in stages:
        _run_stage(deepspeed, stage, model_name, warmup, steps, rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="wide")
    parser.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages, run in this order")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    if any(s not in (1, 2, 3) for s in stages):
        parser.error("stages must be among 1, 2, 3")
    require("deepspeed", "run this with the python of an environment that has DeepSpeed and transformers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.model, stages, args.warmup, args.steps), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
