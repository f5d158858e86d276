"""Time training steps of DDP and FSDP2 against the lzero ZeRO strategies on CPU.

Trains DemoGPT (about 100M parameters by default, fp32) on 2 CPU processes with one
thread each, once per strategy, and reports rank 0's wall time per step, measured from
``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, communication and
optimizer step; no extra barriers). The first ``--warmup`` steps are not timed.

    python benchmarks/bench_step_time.py --strategies ddp,zero1,zero2,zero3,fsdp2
    python benchmarks/bench_step_time.py --strategies ddp --small   # seconds-long smoke test

Strategy names are Lightning registry names (``ddp``; ``zero1``/``zero2``/``zero3`` come
from lzero), except ``fsdp2``: torch's ``fully_shard`` applied per transformer block and
then to the whole GPT, through Lightning's ``ModelParallelStrategy`` (data-parallel size 2,
tensor-parallel size 1), see :class:`FSDP2DemoGPT`.

Lightning launches rank 1 by re-running this script with the same arguments, so both
ranks walk the strategy list in the same order and each ``Trainer.fit`` pairs up.
"""

from __future__ import annotations

import os

# Before importing torch, so every process (rank 1 inherits the environment) and
# Lightning's launcher, which respects an existing value, use one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import ctypes
import gc
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from typing_extensions import override

from lzero.demo import DemoGPT, TextDataModule

# GPT-2 small's width, 14 layers (~100M parameters), byte vocabulary; "small" is for smoke tests only.
MODEL_SHAPES = {
    "full": dict(n_layer=14, n_head=12, n_embd=768, block_size=128),
    "small": dict(n_layer=2, n_head=2, n_embd=64, block_size=32),
}
WORLD_SIZE = 2
DEFAULT_OUT = Path(__file__).with_name("results_step_time.md")


class FSDP2DemoGPT(DemoGPT):
    """DemoGPT sharded with FSDP2 in ``configure_model``, as ModelParallelStrategy requires.

    Like torchtitan: every transformer block is its own ``fully_shard`` group, then the
    GPT itself takes the rest (embeddings, the tied head weight, final LayerNorm). The last
    block keeps its parameters gathered after forward, because backward needs them first.
    DemoGPT's ``configure_optimizers`` runs after this hook, so AdamW gets the DTensor shards.
    """

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):  # Lightning calls this hook again on a later fit/test
            return
        mesh = self.device_mesh["data_parallel"]
        blocks = self.model.blocks
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(self.model, mesh=mesh)


def make_strategy(name: str) -> str | Strategy:
    """What to pass as ``Trainer(strategy=...)`` for a benchmark strategy name."""
    if name == "fsdp2":
        # "auto" would make the tensor-parallel dimension span the node's 2 processes;
        # here both processes are data-parallel (pure FSDP2). Nothing in the strategy
        # is tied to CUDA: on the CPU accelerator it uses gloo and a "cpu" device mesh.
        return ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1)
    return name


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


def reset_peak_rss() -> bool:
    """Restart the kernel's per-process RSS high-water mark; False where unsupported.

    Memory an earlier strategy freed is first handed back to the OS (glibc keeps freed
    heap pages otherwise), so the new mark starts near this run's own footprint.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim, the mark may include retained memory
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """VmHWM from /proc, or ru_maxrss (a high-water mark over the whole process) elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB -> MB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def gather_floats(value: float) -> list[float]:
    """``value`` from every rank, in rank order (the process group outlives Trainer.fit)."""
    if not dist.is_initialized():
        return [value]
    values: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def bench_trainer(strategy: Strategy | str, steps: int, callback: Callback | list[Callback],
                  accelerator: str = "cpu") -> Trainer:
    """A fp32 Trainer on WORLD_SIZE processes that only trains (no validation, checkpoints, logs or bars)."""
    callbacks = callback if isinstance(callback, list) else [callback]
    return Trainer(accelerator=accelerator, devices=WORLD_SIZE, strategy=strategy, precision="32-true",
                   max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
                   enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False)


def run_one(strategy: str, args: argparse.Namespace) -> Result:
    shape = MODEL_SHAPES["small" if args.small else "full"]
    seed_everything(0, verbose=False)
    model_class = FSDP2DemoGPT if strategy == "fsdp2" else DemoGPT
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


def lzero_revision() -> str:
    """Which lzero was imported: its git commit, marked when lzero/ has uncommitted changes."""
    import lzero

    package = Path(lzero.__file__).resolve().parent

    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package), *cmd], capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "lzero (not in a git checkout)"
        dirty = git("status", "--porcelain", "--", ".").stdout.strip()
    except OSError:
        return "lzero (git unavailable)"
    return f"lzero {head.stdout.strip()}" + (" + uncommitted changes" if dirty else "")


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
    parser.add_argument(
        "--out", type=Path, default=None, help=f"markdown output (default: {DEFAULT_OUT.name}, none with --small)"
    )
    args = parser.parse_args()
    if args.out is None and not args.small:
        args.out = DEFAULT_OUT
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
        f"DemoGPT {n_params:,} parameters ({shape}), fp32, {WORLD_SIZE} CPU processes x 1 thread,"
        f" batch {args.batch_size}/process, {args.warmup} warmup + {args.steps} timed steps;"
        f" {lzero_revision()}, torch {torch.__version__}, lightning {lightning.__version__}, {os.cpu_count()} CPUs."
    )
    table = format_table(results, header, rss_resettable)
    print(table)
    if args.out is not None:
        args.out.write_text(table)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
