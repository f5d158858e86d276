"""The pipeline bubble, measured: step time of lzero's pipeline schedules against the number of micro-batches.

    torchrun --nproc_per_node 2 -m benchmarks.step_time.bench_pipeline [--rounds 2] [--steps 6] [--out none]

Two CPU processes (one thread each) form pp2 x dp1 under ``ZeroStrategy(stage=1, pipeline_parallel_size=2)``, the
Trainer's door, on a GPT of ``--layers`` pre-norm blocks (width ``--width``, untied head: ``pipeline_model.py``,
which DeepSpeed's ``PipelineModule`` runs too). For each
schedule and m in ``--microbatches`` (each micro-batch ``--micro`` sequences of ``--seq`` tokens, so a step's work
grows with m), rank 0's median wall time per step after ``--warmup`` steps. A pipeline of p stages with equal stages
takes (m + p - 1) stage-times per step, so T(m) = a m + b with b / a = p - 1 and a bubble fraction
(p - 1) / (m + p - 1);
the table fits a and b to the GPipe times (least squares) and gives each measured fraction 1 - m a / T(m) beside it.

``--deepspeed-python PATH`` (a separate environment with DeepSpeed; never a dependency of lzero): in each round, after
lzero's fits, rank 0 runs ``benchmarks/peers/peer_deepspeed_pipeline.py`` there (DeepSpeed's ``PipelineModule`` at
ZeRO-1, the same model, m and micro-batches) while rank 1 waits, and the table puts lzero's 1F1B beside it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import statistics
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import module_command, module_env, out_path, run_header, write_report
from benchmarks.step_time.bench_tensor_parallel import StepTimer
from benchmarks.step_time.pipeline_model import GPT


class Module(LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=False)


def fit(schedule: str, m: int, args: argparse.Namespace) -> list[float]:
    from lzero import ZeroStrategy

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.steps * args.micro * m, args.seq + 1), generator=g)
    timer = StepTimer(args.warmup)
    strategy = ZeroStrategy(stage=1, pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_microbatches=m)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[timer])
    trainer.fit(Module(args), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.micro * m))
    return timer.times


def deepspeed_times(args: argparse.Namespace) -> dict[int, list[float]]:
    """The peer's step times by m (rank 0 only; the torchrun variables left out of its environment)."""
    cmd = module_command("benchmarks.peers.peer_deepspeed_pipeline", "--microbatches", args.microbatches, "--steps",
                         args.steps, "--warmup", args.warmup, "--width", args.width, "--layers", args.layers, "--heads",
                         args.heads, "--vocab", args.vocab, "--seq", args.seq, "--micro", args.micro,
                         python=args.deepspeed_python)
    launcher = ("TORCHELASTIC", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "ROLE_", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=module_env(env, DS_ACCELERATOR="cpu",
                                                                               OMP_NUM_THREADS="1"))
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not found:
        print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"DeepSpeed peer run failed: exit {done.returncode}")
    return {f["m"]: f["times"] for f in found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="a result name in step_time, a path, or none")
    parser.add_argument("--deepspeed-python", default=None, help="a DeepSpeed environment's python: its rows too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ms = [int(m) for m in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    times: dict[tuple[str, int], list[float]] = {(s, m): [] for s in schedules for m in ms}
    deepspeed: dict[int, list[float]] = {m: [] for m in ms}
    for _ in range(args.rounds):
        for schedule in schedules:
            for m in ms:
                if schedule != "gpipe" and m < 2:
                    continue  # 1F1B schedules need at least as many micro-batches as pipeline ranks
                times[(schedule, m)].extend(fit(schedule, m, args))
        if args.deepspeed_python:
            dist.barrier()
            if dist.get_rank() == 0:
                for m, peer in deepspeed_times(args).items():
                    deepspeed[m].extend(peer)
            dist.barrier()
    if dist.get_rank() == 0:
        medians = {k: statistics.median(v) for k, v in times.items() if v}
        fit_ms = [m for m in ms if (schedules[0], m) in medians]
        mean_m = statistics.fmean(fit_ms)
        mean_t = statistics.fmean(medians[(schedules[0], m)] for m in fit_ms)
        spread = sum((m - mean_m) ** 2 for m in fit_ms)
        a = sum((m - mean_m) * (medians[(schedules[0], m)] - mean_t) for m in fit_ms) / spread if spread else math.nan
        b = mean_t - a * mean_m
        params = sum(p.numel() for p in GPT(args.vocab, args.width, args.layers, args.heads, args.seq).parameters())
        lines = ["# The pipeline bubble: step time against micro-batches, pp2 x dp1", "", run_header(), "",
                 f"GPT {params / 1e6:.1f}M parameters ({args.layers} blocks of width {args.width}, vocab {args.vocab}),"
                 f" fp32, micro-batches of {args.micro} x {args.seq} tokens, lzero zero1 under the Trainer, 2 CPU"
                 f" processes with 1 thread each, {args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up"
                 f" steps not timed per fit). Fit to {schedules[0]}: T(m) = {a:.3f} m + {b:.3f} s, b / a ="
                 f" {b / a:.2f} (p - 1 = 1 for equal stages).", "",
                 "| schedule | m | median step (s) | per micro-batch (s) | bubble 1 - m a / T |"
                 " (p - 1) / (m + p - 1) |",
                 "|---|---|---|---|---|---|"]
        for (schedule, m), median in medians.items():
            lines.append(f"| {schedule} | {m} | {median:.3f} | {median / m:.3f} | {1 - m * a / median:.2f} |"
                         f" {1 / (m + 1):.2f} |")
        if args.deepspeed_python:
            lines += ["", "Beside DeepSpeed's pipeline engine (`PipelineModule`, 2 stages partitioned by parameters,"
                      " ZeRO-1: it refuses 2 and 3), the same model and micro-batches, each round right after"
                      " lzero's:", "",
                      "| m | DeepSpeed median step (s) | lzero 1f1b median step (s) | lzero / DeepSpeed |",
                      "|---|---|---|---|"]
            for m in ms:
                if deepspeed[m] and ("1f1b", m) in medians:
                    theirs = statistics.median(deepspeed[m])
                    lines.append(f"| {m} | {theirs:.3f} | {medians[('1f1b', m)]:.3f} |"
                                 f" {medians[('1f1b', m)] / theirs:.3f}x |")
        path = out_path(args.out, "step_time", "pipeline")
        print("\n".join(lines), flush=True)
        if path is not None:
            write_report(path, "\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
