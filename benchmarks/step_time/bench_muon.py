"""Muon under ZeRO on CPU: step time against DDP and FSDP2, and how the Newton-Schulz work splits across ranks.

    torchrun --nproc_per_node 2 -m benchmarks.step_time.bench_muon [--steps 8] [--out none]
    torchrun --nproc_per_node 4 -m benchmarks.step_time.bench_muon              # world size 4: a report of its own

Each process (one thread) trains the demo GPT (``--layers`` blocks of width ``--width``, vocabulary 256, sequences of
``--seq``, ``--batch`` per rank) under Fabric with ``torch.optim.Muon`` on the blocks' matrices and ``AdamW`` on the
rest, for each strategy in ``--strategies`` one after another: ``ddp`` (every rank orthogonalizes every matrix),
lzero's ``zero1``/``zero2``/``zero3`` (each matrix orthogonalized by the rank owning it: [Note: per-tensor
ownership] in lzero/engine/partition.py), and ``fsdp2`` (torch's ``fully_shard`` per block and on the root;
torch.optim.Muon then steps the DTensor shards, whose ops gather each matrix so that every rank computes every
matrix's update). Reported: rank 0's median wall time per step after ``--warmup`` steps (forward, backward,
communication, both optimizers' steps), and each rank's median time inside ``torch.optim.Muon.step`` (the
Newton-Schulz work and momentum), with its share of the ranks' total.

``--deepspeed-python PATH`` (a separate environment with DeepSpeed; never a dependency of lzero): rank 0 also runs
``benchmarks/peers/peer_deepspeed_muon.py`` there at the same world size (DeepSpeed's own ``Muon`` optimizer type,
ZeRO stages 1 and 2, the same model and batch) while the other ranks wait, and the table puts it beside.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import module_command, module_env, out_path, run_header, write_report
from benchmarks.peers.peer_deepspeed_muon import run_arguments
from lzero.demo.model import GPT, GPTConfig

VOCAB = 256
MUON_SECONDS: list[float] = []  # this process's time inside each torch.optim.Muon.step call


def _timed_muon() -> None:
    """Time every ``torch.optim.Muon.step`` in this process (lzero's inner optimizers are Muon instances too)."""
    step = torch.optim.Muon.step

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            MUON_SECONDS.append(time.perf_counter() - start)

    torch.optim.Muon.step = timed


def optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "blocks." in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "blocks." in n)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-3)]


def run(name: str, args: argparse.Namespace, world: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64,
                          n_embd=args.width))
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        fabric = None
        opts = optimizers(model)
    else:
        from lzero.lightning.fabric_strategy import ZeroFabricStrategy

        strategy = "ddp" if name == "ddp" else ZeroFabricStrategy(stage=int(name[-1]), log_memory=False)
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = fabric.setup_module(model)
        opts = [fabric.setup_optimizers(o) for o in optimizers(model)]
    gen = torch.Generator().manual_seed(1 + rank)
    times, muon = [], []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen)
        start, MUON_SECONDS[:] = time.perf_counter(), []
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        fabric.backward(loss) if fabric is not None else loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            muon.append(sum(MUON_SECONDS))
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, statistics.median(muon))
    return {"strategy": name, "step_s": statistics.median(times), "muon_s": shares}


def peer(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    """DeepSpeed's rows, from its own environment (rank 0 only)."""
    cmd = module_command("benchmarks.peers.peer_deepspeed_muon", "--world", world, "--layers", args.layers, "--width",
                         args.width, "--seq", args.seq, "--batch", args.batch, "--warmup", args.warmup, "--steps",
                         args.steps, python=args.deepspeed_python)
    launched = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
    env = {k: v for k, v in module_env(DS_ACCELERATOR="cpu").items()  # not torchrun's: the peer makes its own group
           if k not in launched and not k.startswith("TORCHELASTIC")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        return [{"strategy": "deepspeed", "error": done.stderr.strip().splitlines()[-1:]}]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(rows: list[dict[str, Any]], world: int, args: argparse.Namespace) -> str:
    ddp = next((r["step_s"] for r in rows if r["strategy"] == "ddp" and "step_s" in r), None)
    lines = [f"### World size {world}", "",
             "| strategy | step (s, rank 0, median) | vs DDP | Muon.step per rank (s, median) | share of the ranks' Muon"
             " time |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | refused: {r['error']} | | | |")
            continue
        if "muon_s" in r:
            total = sum(r["muon_s"]) or 1.0
            per_rank = ", ".join(f"{s:.3f}" for s in r["muon_s"])
            shares = ", ".join(f"{s / total:.0%}" for s in r["muon_s"])
        else:  # DeepSpeed orthogonalizes inside its gradient partitioning, not in an optimizer step
            per_rank = shares = "(inside DeepSpeed's reduction)"
        ratio = f"{r['step_s'] / ddp:.2f}x" if ddp else "-"
        lines.append(f"| {r['strategy']} | {r['step_s']:.3f} | {ratio} | {per_rank} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp2")
    run_arguments(parser)
    parser.add_argument("--deepspeed-python", default=None)
    parser.add_argument("--out", default=None, help="the report's path; none: print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _timed_muon()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for name in args.strategies.split(","):
        try:
            rows.append(run(name, args, world, rank))
        except Exception as err:  # noqa: BLE001 - a strategy that cannot run this optimizer is a result
            rows.append({"strategy": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"})
        dist.barrier()
    if args.deepspeed_python and rank == 0:
        rows += peer(args, world)
    dist.barrier()
    if rank == 0:
        text = table(rows, world, args)
        print(text)
        path = out_path(args.out, "step_time", f"muon_ws{world}")
        if path is not None:
            peers = sorted({r["deepspeed"] for r in rows if "deepspeed" in r})
            command = " ".join(["torchrun", "--nproc_per_node", str(world), "-m", "benchmarks.step_time.bench_muon",
                                *sys.argv[1:]])
            write_report(path, "\n".join([
                f"# Muon under ZeRO, world size {world}", "", run_header(),
                *([f"DeepSpeed {', '.join(peers)} in its own environment (benchmarks/peers/peer_deepspeed_muon.py)."]
                  if peers else []), "",
                f"`{command}`: the demo GPT of {args.layers} blocks, width {args.width}, sequences of {args.seq}, batch"
                f" {args.batch} per rank, fp32, one thread per process; Muon (lr 0.02) on the blocks' matrices, AdamW"
                " on the rest. Step: rank 0's median wall time of forward, backward, communication and both"
                " optimizers' steps. Muon.step: each rank's median time inside torch.optim.Muon.step (DDP: every"
                " rank orthogonalizes every matrix; lzero: each matrix on its owner; FSDP2: every rank every matrix,"
                " through DTensor ops that gather it). DeepSpeed runs its own Muon type (MuonWithAuxAdam), which"
                " orthogonalizes while it fills its gradient partitions, so its Muon time is inside its step."
                + (f" {world} processes on {os.cpu_count()} cores: every time is inflated by the oversubscription,"
                   " the ratios less so." if world > (os.cpu_count() or 1) else ""), "", text, ""]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
