"""DeepSpeed's pipeline engine on CPU: a peer reference for ``benchmarks.step_time.bench_pipeline``.

DeepSpeed is never a dependency of lzero. This script runs only in a separate environment that has DeepSpeed and a
CPU build of torch, and it imports neither lzero nor lightning:

    DS_ACCELERATOR=cpu /work/peers/deepspeed/bin/python -m benchmarks.peers.peer_deepspeed_pipeline \\
        [--microbatches 4] [--steps 6] [--warmup 2]      # from the repository root

Two processes (``torch.multiprocessing.spawn``, gloo, one thread each) train the GPT of ``bench_pipeline`` (its
blocks from ``benchmarks/step_time/pipeline_model.py``, plain torch; the same widths and seed 0) as a
``deepspeed.pipe.PipelineModule`` of 2 stages, partitioned by parameters, at ZeRO stage 1 (DeepSpeed's pipeline engine
refuses stages 2 and 3), fp32, ``torch.optim.AdamW(lr=1e-4)``,
``gradient_accumulation_steps`` = m micro-batches of ``--micro`` sequences per ``train_batch()``. Rank 0 times each
``train_batch()`` with ``time.perf_counter``, skips ``--warmup`` and prints one JSON line per m to stdout:
``{"strategy": "deepspeed_pipe_zero1", "m": m, "times": [seconds...], "deepspeed": "<version>"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn

from benchmarks.step_time.pipeline_model import Block  # torch only: the same blocks as lzero's run


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, seq: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import PipelineModule

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [Embed(args.vocab, args.width, args.seq), *(Block(args.width, args.heads) for _ in range(args.layers)),
              Head(args.vocab, args.width)]
    for m in [int(m) for m in args.microbatches.split(",")]:
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="parameters")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
        config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": m,
                  "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, args.vocab, (args.steps * args.micro * m, args.seq + 1), generator=g)
        batches = iter([(tokens[i:i + args.micro, :-1], tokens[i:i + args.micro, 1:])
                        for i in range(0, len(tokens), args.micro)])
        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            engine.train_batch(data_iter=batches)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        if rank == 0:
            print(json.dumps({"strategy": "deepspeed_pipe_zero1", "m": m, "times": times,
                              "deepspeed": deepspeed.__version__}), flush=True)
        engine.destroy() if hasattr(engine, "destroy") else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    mp.spawn(worker, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
