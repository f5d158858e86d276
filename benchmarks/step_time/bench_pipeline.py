"""The pipeline bubble, measured: step time of lzero's pipeline schedules against the number of micro-batches.

    torchrun --nproc_per_node 2 -m benchmarks.step_time.bench_pipeline [--rounds 2] [--steps 6] [--out none]

Two CPU processes (one thread each) form pp2 x dp1 under ``ZeroStrategy(stage=1, pipeline_parallel_size=2)``, the
Trainer's door, on a GPT of ``--layers`` pre-norm blocks (width ``--width``, untied head: the model of
``benchmarks/peers/peer_deepspeed_pipeline.py``, so DeepSpeed's ``PipelineModule`` runs the same one). For each
schedule and m in ``--microbatches`` (each micro-batch ``--micro`` sequences of ``--seq`` tokens, so a step's work
grows with m), rank 0's median wall time per step after ``--warmup`` steps. A pipeline of p stages with equal stages
takes (m + p - 1) stage-times per step, so T(m) = a m + b with b / a = p - 1 and a bubble fraction (p - 1) / (m + p - 1);
the table fits a and b to the GPipe times (least squares) and gives each measured fraction 1 - m a / T(m) beside it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import out_path, run_header, write_report


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (torch's SDPA), then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.out(a)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class StepTimer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.start = warmup, [], 0.0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.start)


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
    args = parser.parse_args()
    torch.set_num_threads(1)
    ms = [int(m) for m in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    times: dict[tuple[str, int], list[float]] = {(s, m): [] for s in schedules for m in ms}
    for _ in range(args.rounds):
        for schedule in schedules:
            for m in ms:
                if schedule == "interleaved_1f1b" and m % 2:
                    continue  # torch's interleaved schedule wants m a multiple of the pipeline's ranks
                times[(schedule, m)].extend(fit(schedule, m, args))
    if dist.get_rank() == 0:
        medians = {k: statistics.median(v) for k, v in times.items() if v}
        fit_ms = [m for m in ms if (schedules[0], m) in medians]
        mean_m = statistics.fmean(fit_ms)
        mean_t = statistics.fmean(medians[(schedules[0], m)] for m in fit_ms)
        a = sum((m - mean_m) * (medians[(schedules[0], m)] - mean_t) for m in fit_ms) / \
            sum((m - mean_m) ** 2 for m in fit_ms)
        b = mean_t - a * mean_m
        params = sum(p.numel() for p in GPT(args.vocab, args.width, args.layers, args.heads, args.seq).parameters())
        lines = ["# The pipeline bubble: step time against micro-batches, pp2 x dp1", "", run_header(), "",
                 f"GPT {params / 1e6:.1f}M parameters ({args.layers} blocks of width {args.width}, vocab {args.vocab}),"
                 f" fp32, micro-batches of {args.micro} x {args.seq} tokens, lzero zero1 under the Trainer, 2 CPU"
                 f" processes with 1 thread each, {args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up"
                 f" steps not timed per fit). Fit to {schedules[0]}: T(m) = {a:.3f} m + {b:.3f} s, b / a ="
                 f" {b / a:.2f} (p - 1 = 1 for equal stages).", "",
                 "| schedule | m | median step (s) | per micro-batch (s) | bubble 1 - m a / T | (p - 1) / (m + p - 1) |",
                 "|---|---|---|---|---|---|"]
        for (schedule, m), median in medians.items():
            lines.append(f"| {schedule} | {m} | {median:.3f} | {median / m:.3f} | {1 - m * a / median:.2f} |"
                         f" {1 / (m + 1):.2f} |")
        path = out_path(args.out, "step_time", "pipeline")
        print("\n".join(lines), flush=True)
        if path is not None:
            write_report(path, "\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
