"""Time training steps of DDP and FSDP2 against the lzero ZeRO strategies on CPU.

Trains DemoGPT (about 100M parameters by default, fp32) on 2 CPU processes with one
thread each, once per strategy, and reports rank 0's wall time per step, measured from
``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, communication and
optimizer step; no extra barriers). The first ``--warmup`` steps are not timed.

    python -m benchmarks.step_time.bench_step_time --strategies ddp,zero1,zero2,zero3,fsdp2
    python -m benchmarks.step_time.bench_step_time --strategies ddp --small   # seconds-long smoke test
    python -m benchmarks.step_time.bench_step_time --strategies zero2,zero2+monitor --out monitor_overhead

Strategy names are Lightning registry names (``ddp``; ``zero1``/``zero2``/``zero3`` come
from lzero), except ``fsdp2``: torch's ``fully_shard`` applied per transformer block and
then to the whole GPT, through Lightning's ``ModelParallelStrategy`` (data-parallel size 2,
tensor-parallel size 1), see ``benchmarks.common.fsdp2_demo_gpt``.

Lightning launches rank 1 by re-running this module with the same arguments, so both
ranks walk the strategy list in the same order and each ``Trainer.fit`` pairs up.
"""

from __future__ import annotations

import os

# Before importing torch, so every process (rank 1 inherits the environment) and
# Lightning's launcher, which respects an existing value, use one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything
from typing_extensions import override

from benchmarks.common import (WORLD_SIZE, bench_trainer, fsdp2_demo_gpt, gather_floats, make_strategy, out_path,
                               peak_rss_mb, reset_peak_rss, run_header, write_report)
from lzero.demo import DemoGPT, TextDataModule

# GPT-2 small's width, 14 layers (~100M parameters), byte vocabulary; "small" is for smoke tests only.
MODEL_SHAPES = {
    "full": dict(n_layer=14, n_head=12, n_embd=768, block_size=128),
    "small": dict(n_layer=2, n_head=2, n_embd=64, block_size=32),
}


class StepTimer(Callback):
    """Wall time of each training step after the first ``warmup`` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


@dataclass
class Result:
    strategy: str
    """Benchmark strategy name (a registry name, or ``fsdp2``)."""
    times: list[float]
    """Rank 0's timed step durations in seconds."""
    peak_rss_mb: list[float]
    """Peak resident memory of each rank during this strategy's run, indexed by rank."""


def run_one(strategy: str, args: argparse.Namespace) -> Result:
    shape = MODEL_SHAPES["small" if args.small else "full"]
    seed_everything(0, verbose=False)
    model_class = fsdp2_demo_gpt() if strategy == "fsdp2" else DemoGPT
    model = model_class(vocab_size=256, **shape)
    data = TextDataModule(
        block_size=shape["block_size"], batch_size=args.batch_size, steps_per_epoch=args.warmup + args.steps
    )
    timer = StepTimer(args.warmup)
    callbacks: list[Callback] = [timer]
    name = strategy
    if strategy.endswith("+monitor"):  # lzero's memory monitor measuring at every step (its worst case)
        from lzero import MemoryMonitor

        strategy = strategy.removesuffix("+monitor")
        callbacks.insert(0, MemoryMonitor(every_n_steps=1))  # before the timer: its work falls inside the step
    trainer = bench_trainer(make_strategy(strategy), args.warmup + args.steps, callbacks)
    reset_peak_rss()
    trainer.fit(model, datamodule=data)
    result = Result(name, timer.times, gather_floats(peak_rss_mb()))
    monitors = [c for c in callbacks if hasattr(c, "cost_s")]
    if monitors and monitors[0].cost_s and trainer.is_global_zero:
        costs = monitors[0].cost_s[args.warmup:] or monitors[0].cost_s
        print(f"{name}: the memory monitor took {statistics.mean(costs) * 1e3:.1f} ms per step on rank 0", flush=True)
    del trainer, model, data
    return result


def format_table(results: list[Result], header: str, rss_resettable: bool) -> str:
    base = next((statistics.mean(r.times) for r in results if r.strategy == "ddp"), None)
    lines = [
        header,
        "",
        "| strategy | s/step mean | s/step median | ratio vs ddp | peak RSS MB per rank (0 / 1) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        mean, median = statistics.mean(r.times), statistics.median(r.times)
        ratio = f"{mean / base:.2f}" if base else "n/a"
        rss = " / ".join(f"{m:.0f}" for m in r.peak_rss_mb)
        lines.append(f"| {r.strategy} | {mean:.3f} | {median:.3f} | {ratio} | {rss} |")
    lines.append("")
    if rss_resettable:
        lines.append(
            "Peak RSS is VmHWM since the start of that strategy's fit: freed memory is"
            " returned with malloc_trim, then the mark is reset through /proc/self/clear_refs."
        )
    else:
        lines.append(
            "Peak RSS is ru_maxrss, a high-water mark over the whole process, so each row"
            " also includes every earlier strategy's peak."
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time DDP, FSDP2 and lzero ZeRO steps on 2 CPU processes.")
    parser.add_argument(
        "--strategies",
        default="ddp,zero1,zero2",
        help="comma-separated names: Lightning registry names (ddp, zero1, zero2, zero3, ...) or fsdp2; a"
        " '+monitor' suffix (zero2+monitor) adds lzero's MemoryMonitor measuring at every step",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--small", action="store_true", help="tiny model for a quick smoke test")
    parser.add_argument("--out", default=None, help="markdown output: a path, a result name (monitor_overhead), or"
                        " none (default: results/step_time/step_time.<machine>.<date>.md; none with --small)")
    args = parser.parse_args()
    args.out = out_path("none" if args.out is None and args.small else args.out, "step_time", "step_time")
    return args


def main() -> None:
    import lzero  # noqa: F401  registers the zero1/zero2/zero3 strategy names

    args = parse_args()
    torch.set_num_threads(1)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    shape = MODEL_SHAPES["small" if args.small else "full"]
    n_params = DemoGPT(vocab_size=256, **shape).model.num_parameters()
    rss_resettable = reset_peak_rss()
    results = [run_one(strategy, args) for strategy in strategies]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    header = (
        f"{run_header()}\n\nDemoGPT {n_params:,} parameters ({shape}), fp32, {WORLD_SIZE} CPU processes x 1 thread,"
        f" batch {args.batch_size}/process, {args.warmup} warmup + {args.steps} timed steps."
    )
    table = format_table(results, header, rss_resettable)
    print(table)
    if args.out is not None:
        write_report(args.out, table)


if __name__ == "__main__":
    main()
