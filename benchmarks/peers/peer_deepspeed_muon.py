"""DeepSpeed's own Muon on CPU: a peer reference for ``benchmarks.step_time.bench_muon``.

DeepSpeed is never a dependency of lzero. This runs only in a separate environment with DeepSpeed and a CPU build of
torch, and imports neither lzero nor lightning (the demo GPT's file, which imports torch alone, is loaded by path):

    DS_ACCELERATOR=cpu /work/peers/deepspeed/bin/python -m benchmarks.peers.peer_deepspeed_muon --world 2

``--world`` processes (``torch.multiprocessing.spawn``, gloo, one thread each) train the demo GPT of
``bench_muon`` (seed 0) in fp32 under ``deepspeed.initialize`` with the optimizer type ``"muon"`` (DeepSpeed's
``MuonWithAuxAdam``: the blocks' matrices tagged ``use_muon``, Adam for the rest), at ZeRO stages 1 and 2 (DeepSpeed's
Muon runs at those stages; its ZeRO-1/2 orthogonalizes each matrix while the gradient partitions are filled). Rank 0
times forward + backward + step after ``--warmup`` steps and prints one JSON line per stage:

    {"strategy": "deepspeed<N>", "step_s": <median seconds>, "deepspeed": "<version>"}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.common import require  # the standard library only: no lzero in this environment
from benchmarks.peers.ds_rank import start_rank

VOCAB = 256


def run_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and run arguments ``bench_muon`` and this peer share."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)


def _gpt(args: argparse.Namespace) -> torch.nn.Module:
    path = Path(__file__).resolve().parents[2] / "lzero" / "demo" / "model.py"
    spec = importlib.util.spec_from_file_location("demo_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_model"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.GPT(module.GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers,
                                       n_head=args.width // 64, n_embd=args.width))


def _run_stage(deepspeed, stage: int, args: argparse.Namespace, rank: int) -> None:
    model = _gpt(args)
    for name, p in model.named_parameters():
        p.use_muon = p.dim() == 2 and "blocks." in name
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01,
                                                      "adam_lr": 3e-3}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)
        start = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"strategy": f"deepspeed{stage}", "step_s": statistics.median(times),
                          "deepspeed": deepspeed.__version__}), flush=True)


def _rank(rank: int, port: int, args: argparse.Namespace) -> None:
    deepspeed = start_rank(rank, args.world, port)
    for stage in (1, 2):
        _run_stage(deepspeed, stage, args, rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    run_arguments(parser)
    args = parser.parse_args()
    require("deepspeed", "run this with the python of an environment that has DeepSpeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
