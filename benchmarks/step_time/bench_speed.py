"""Step time of lzero against DDP, FSDP2 and DeepSpeed on two Hugging Face GPT-2 shapes, one table (``make bench``).

Every row trains a ``transformers.GPT2LMHeadModel`` (random init, seed 0, no dropout, fp32, AdamW lr 1e-4) on 2 CPU
processes with one thread each, gloo:

- ``wide``: 8 layers x 512, vocab 8000, sequence 128, batch 4 per process (compute dominates);
- ``deep``: 24 layers x 64, vocab 8000, sequence 32, batch 2 per process (per-step fixed costs dominate).

Rows: ``ddp``, ``zero1``-``zero3`` and the offload presets through Lightning (``Trainer(strategy=name)``), ``fsdp2``
(torch's ``fully_shard`` per block then on the whole model, through Lightning's ``ModelParallelStrategy``), and,
with ``--deepspeed-python``, DeepSpeed ZeRO-1/2/3 run by ``benchmarks.peers.peer_deepspeed_step`` in its own
environment (plain DeepSpeed engine loop: Lightning's DeepSpeed strategy refuses the CPU accelerator).

For each lzero row the table also counts, on rank 0 over the timed steps:
- optimizer calls per step: ``step()`` calls of optimizers other than lzero's outer ``ZeroOptimizer`` (a global
  torch optimizer hook), i.e. the calls that actually update tensors;
- gradient-hook calls per step: Python calls of lzero's gradient hooks;
- bytes that rank 0 put into collectives per step (the input of each reduce-scatter, all-gather, all-reduce and
  broadcast through ``lzero.engine.collectives``).

    python -m benchmarks.step_time.bench_speed   # every model and strategy: results/step_time/speed.<machine>.<date>.md
    python -m benchmarks.step_time.bench_speed --models deep --strategies ddp,zero3 --out none
    python -m benchmarks.step_time.bench_speed --deepspeed-python /work/peers/deepspeed/bin/python

Lightning launches rank 1 by re-running this module with the same arguments; both ranks walk the same list.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import (gather_floats, module_command, module_env, out_path, peak_rss_mb, reset_peak_rss,
                               run_header, write_report)

MODELS = {
    "wide": dict(config=dict(n_layer=8, n_embd=512, n_head=8, vocab_size=8000, n_positions=128), seq=128, batch=4),
    "deep": dict(config=dict(n_layer=24, n_embd=64, n_head=4, vocab_size=8000, n_positions=32), seq=32, batch=2),
}
ALIASES = {  # rows that are a preset with overrides (``preset:key=value;key=value``)
    # the memory-minimal schedule (FSDP's; lzero's default before schedule="auto"): every block gathered twice a step
    "zero3+min_memory": "zero3:schedule=min_memory",
    # runs of small consecutive blocks all-gathered together (ZeroConfig.gather_bucket_size), on that schedule
    "zero3+runs": "zero3:schedule=min_memory;gather_bucket_size=5000000",
    # DeepSpeed's own stage-3 defaults (stage3_param_persistence_threshold 1e5, stage3_prefetch_bucket_size 5e7),
    # which the DeepSpeed rows run with, nothing else kept
    "zero3+ds_defaults": "zero3:schedule=min_memory;param_persistence_threshold=100000;prefetch_bucket_size=50000000",
}
DEFAULT_STRATEGIES = ("ddp,zero1,zero2,zero3,zero3+min_memory,zero3+runs,zero3+ds_defaults,zero2_offload,zero3_offload,"
                      "fsdp2")
WORLD_SIZE = int(os.environ.get("BENCH_WORLD_SIZE", "2"))  # --world-size sets it (rank 1.. inherit it)


def gpt2(config: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**config, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class RandomTokens(Dataset):
    """The same ids for every strategy: item ``i`` of rank ``r`` seeded with 1000 * i + r."""

    def __init__(self, n: int, seq: int, vocab: int, batch: int) -> None:
        self.n, self.seq, self.vocab, self.batch = n, seq, vocab, batch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        g = torch.Generator().manual_seed(1000 * i + rank)
        return torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)


class GPT2Module(LightningModule):
    def __init__(self, model: str, fsdp2: bool = False) -> None:
        super().__init__()
        self.shape = MODELS[model]
        self.fsdp2 = fsdp2
        self.model = gpt2(self.shape["config"])

    def configure_model(self) -> None:
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        blocks = self.model.transformer.h
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


@dataclass
class Counters:
    optimizer_calls: int = 0
    hook_calls: int = 0
    units: int = 0  # units of the last engine built
    comm_bytes: int = 0
    counting: bool = False


COUNTS = Counters()


def install_counters() -> None:
    """Count inner optimizer steps, lzero gradient-hook calls and collective bytes (see the module docstring)."""
    from lzero.engine import collectives
    from lzero.engine.engine import ZeroEngine
    from lzero.optimizer import ZeroOptimizer

    def on_step(optimizer, args, kwargs) -> None:
        if COUNTS.counting and not isinstance(optimizer, ZeroOptimizer):
            COUNTS.optimizer_calls += 1

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(on_step)

    from lzero.engine import gather

    # every Python call autograd makes into lzero in backward: per-parameter hooks, and stage 3's hooks on the
    # blocks' inputs and outputs (one tensor hook each, running the block's release and the next gather)
    for owner, name in ((ZeroEngine, "_on_grad_ready"), (gather, "_run_actions")):
        original = getattr(owner, name)

        def counted(*args, _original=original, **kwargs):
            if COUNTS.counting:
                COUNTS.hook_calls += 1
            return _original(*args, **kwargs)

        setattr(owner, name, counted)
    original_init = ZeroEngine.__init__

    def remember_units(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        COUNTS.units = len(self.units)

    ZeroEngine.__init__ = remember_units

    def nbytes(t) -> int:
        if isinstance(t, (list, tuple)):
            return sum(nbytes(x) for x in t)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    for name, arg in (("reduce_scatter", 1), ("all_gather", 1), ("all_reduce", 0), ("broadcast_", 0),
                      ("broadcast_coalesced_", 0)):
        original = getattr(collectives, name)

        def counted(*args, _original=original, _arg=arg, **kwargs):
            if COUNTS.counting and len(args) > _arg:
                COUNTS.comm_bytes += nbytes(args[_arg])
            return _original(*args, **kwargs)

        setattr(collectives, name, counted)


class StepTimer(Callback):
    """Rank 0's wall time of each step after ``warmup``; with ``profile``, a cProfile of the timed steps."""

    def __init__(self, warmup: int, profile: bool = False) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0
        self.profile = None
        if profile:
            import cProfile

            self.profile = cProfile.Profile()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        COUNTS.counting = batch_idx >= self.warmup
        if self.profile is not None and COUNTS.counting and trainer.is_global_zero:
            self.profile.enable()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)
            if self.profile is not None and trainer.is_global_zero:
                self.profile.disable()

    def report(self, steps: int) -> None:
        import io
        import pstats

        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats("tottime").print_stats(25)
        print(f"cProfile of {steps} timed steps on rank 0, by own time:\n{out.getvalue()}", flush=True)


@dataclass
class Row:
    model: str
    strategy: str
    times: list[float]
    peak_rss_mb: list[float]
    counts: dict = field(default_factory=dict)
    passes: list[float] = field(default_factory=list)  # mean s/step of each pass (--repeat)
    ratios: list[float] = field(default_factory=list)  # each pass's mean over DDP's mean in the same pass

    @property
    def seconds(self) -> float:
        """s/step: the median over passes of each pass's mean."""
        return statistics.median(self.passes) if self.passes else statistics.mean(self.times)

    @property
    def ratio(self) -> Optional[float]:
        return statistics.median(self.ratios) if self.ratios else None

    def spread(self) -> str:
        return f" ({min(self.ratios):.2f}-{max(self.ratios):.2f})" if len(self.ratios) > 1 else ""


def merge_passes(passes: list[list[Row]]) -> list[Row]:
    """One row per (model, strategy) from ``--repeat`` passes: every timed step, each pass's mean, and each pass's
    ratio to the DDP row of that pass (rows were run interleaved, so a slow minute of the machine hits a pass's
    DDP row and its other rows alike)."""
    merged: dict[tuple[str, str], Row] = {}
    for rows in passes:
        base = {r.model: statistics.mean(r.times) for r in rows if r.strategy == "ddp"}
        for r in rows:
            key = (r.model, r.strategy)
            if key not in merged:
                merged[key] = Row(r.model, r.strategy, [], r.peak_rss_mb, r.counts)
            m = merged[key]
            mean = statistics.mean(r.times)
            m.times += r.times
            m.passes.append(mean)
            m.peak_rss_mb = [max(a, b) for a, b in zip(m.peak_rss_mb, r.peak_rss_mb)]
            if r.model in base:
                m.ratios.append(mean / base[r.model])
    return list(merged.values())


def run_one(model: str, strategy: str, args: argparse.Namespace) -> Row:
    shape = MODELS[model]
    seed_everything(0, verbose=False)
    module = GPT2Module(model, fsdp2=strategy == "fsdp2")
    steps = args.warmup + args.steps
    data = DataLoader(RandomTokens(steps, shape["seq"], shape["config"]["vocab_size"], shape["batch"]), batch_size=1)
    timer = StepTimer(args.warmup, profile=args.profile)
    chosen = ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1) \
        if strategy == "fsdp2" else with_overrides(strategy)
    trainer = Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=chosen, precision="32-true", max_steps=steps,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer], enable_checkpointing=False,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False)
    reset_peak_rss()
    COUNTS.optimizer_calls = COUNTS.hook_calls = COUNTS.comm_bytes = 0
    trainer.fit(module, train_dataloaders=data)
    COUNTS.counting = False
    counts = {}
    if strategy.startswith("zero") or strategy == "ddp":  # counted for lzero (and DDP's one optimizer call)
        counts = dict(optimizer_calls=COUNTS.optimizer_calls / args.steps, hook_calls=COUNTS.hook_calls / args.steps,
                      units=COUNTS.units if strategy != "ddp" else None,
                      comm_mb=COUNTS.comm_bytes / args.steps / 1e6 if strategy != "ddp" else None)
    row = Row(model, strategy, timer.times, gather_floats(peak_rss_mb()), counts)
    if trainer.is_global_zero and args.profile:
        timer.report(args.steps)
    if trainer.is_global_zero:
        print(f"{model} {strategy}: {statistics.mean(row.times):.4f} s/step {counts}", flush=True)
    del trainer, module
    return row


def with_overrides(name: str):
    """``zero3:key=value;key=value`` (or an alias of one): the preset with ZeroConfig overrides."""
    name = ALIASES.get(name, name)
    if ":" not in name:
        return name
    import yaml

    from lzero import ZeroConfig, ZeroStrategy
    from lzero.presets import strategy_file

    preset, pairs = name.split(":", 1)
    config = yaml.safe_load(Path(strategy_file(preset)).read_text())["init_args"]["config"]
    for pair in pairs.split(";"):
        key, value = pair.split("=", 1)
        config[key] = yaml.safe_load(value)
    return ZeroStrategy(config=ZeroConfig(**config))


def deepspeed_rows(args: argparse.Namespace) -> list[Row]:
    rows = []
    for model in args.models:
        cmd = module_command("benchmarks.peers.peer_deepspeed_step", "--model", model, "--stages", "1,2,3",
                             "--warmup", args.warmup, "--steps", args.steps, python=args.deepspeed_python)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # none of this environment's packages
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env=module_env(env, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
        found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not found:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"DeepSpeed peer run failed for {model}: exit {done.returncode}")
        for f in found:
            rows.append(Row(model, f["strategy"], f["times"], f["peak_rss_mb"], {"version": f.get("deepspeed")}))
    return rows


def format_table(rows: list[Row], header: str) -> str:
    lines = [header, "",
             "| model | strategy | s/step | median step | vs ddp | optimizer calls/step | grad-hook calls/step | units |"
             " collective MB/step (rank 0) | peak RSS MB (rank 0 / 1) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        for r in mine:
            mean = r.seconds
            ratio = f"{r.ratio:.2f}x{r.spread()}" if r.ratio is not None else "n/a"
            c = r.counts

            def show(key: str, fmt: str = "{:.0f}") -> str:
                return fmt.format(c[key]) if c.get(key) is not None else "-"

            lines.append(f"| {model} | {r.strategy} | {mean:.4f} | {statistics.median(r.times):.4f} | {ratio} |"
                         f" {show('optimizer_calls')} | {show('hook_calls')} | {show('units')} |"
                         f" {show('comm_mb', '{:.1f}')} |"
                         f" {' / '.join(f'{m:.0f}' for m in r.peak_rss_mb)} |")
    return "\n".join(lines) + "\n"


README_START, README_END = "<!-- bench_speed:start -->", "<!-- bench_speed:end -->"


def write_readme_table(rows: list[Row], readme: Path) -> None:
    """The summary (ratio to DDP per model, counts) between the README's markers."""
    models = list(dict.fromkeys(r.model for r in rows))
    lines = [README_START,
             "| strategy | " + " | ".join(f"{m}: s/step, vs DDP" for m in models)
             + " | optimizer calls / grad hooks / units per step (deep) |",
             "|---" * (len(models) + 2) + "|"]
    for strategy in dict.fromkeys(r.strategy for r in rows):
        cells = []
        for m in models:
            found = [r for r in rows if r.model == m and r.strategy == strategy]
            cells.append(f"{found[0].seconds:.3f} s, {found[0].ratio:.2f}x{found[0].spread()}" if found else "-")
        deep = [r for r in rows if r.strategy == strategy and r.counts.get("optimizer_calls") is not None]
        c = deep[-1].counts if deep else {}
        counts = f"{c['optimizer_calls']:.0f} / {c['hook_calls']:.0f} / {c['units'] if c.get('units') else '-'}" \
            if deep else "-"
        lines.append(f"| {strategy} | " + " | ".join(cells) + f" | {counts} |")
    lines.append(README_END)
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme} has no {README_START} ... {README_END} markers to write the table between")
    head, rest = text.split(README_START, 1)
    readme.write_text(head + "\n".join(lines) + rest.split(README_END, 1)[1])
    print(f"wrote the summary into {readme}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="wide,deep")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1,
                        help="passes over every row, interleaved; each row reports the median over passes")
    parser.add_argument("--deepspeed-python", default=None,
                        help="python of an environment with DeepSpeed (never a dependency of lzero)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of rank 0's timed steps per row")
    parser.add_argument("--world-size", type=int, default=None, help="processes (default 2)")
    parser.add_argument("--json", default=None,
                        help="also write the rows as JSON here (benchmarks.cluster.scale_model reads it)")
    parser.add_argument("--readme", default="none", help="README whose bench markers get the summary table")
    parser.add_argument("--out", default=None, help="markdown file to write, a result name, or 'none' (default:"
                        " results/step_time/speed.<machine>.<date>.md)")
    args = parser.parse_args()
    if args.world_size is not None and str(args.world_size) != os.environ.get("BENCH_WORLD_SIZE"):
        os.environ["BENCH_WORLD_SIZE"] = str(args.world_size)  # Lightning's launcher re-runs this module
        command = module_command(__spec__.name, *sys.argv[1:])
        os.execv(command[0], command)
    args.out = out_path(args.out, "step_time", "speed")
    args.models = [m for m in args.models.split(",") if m]
    args.strategies = [s for s in args.strategies.split(",") if s]
    return args


def main() -> None:
    import lzero  # noqa: F401  registers the strategy names

    args = parse_args()
    torch.set_num_threads(1)
    install_counters()
    # passes run every row once, one pass after another, so the machine's slow and fast minutes spread over all rows
    passes = [[run_one(model, strategy, args) for model in args.models for strategy in args.strategies]
              for _ in range(args.repeat)]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if args.deepspeed_python:  # after the lzero passes (rank 1 has returned): each pass gets one DeepSpeed run
        for rows in passes:
            rows += deepspeed_rows(args)
            rows.sort(key=lambda r: args.models.index(r.model))
    rows = merge_passes(passes)
    versions = {r.counts.get("version") for r in rows if r.strategy.startswith("deepspeed")} - {None}
    header = (f"{run_header('transformers')}\n\n"
              f"Hugging Face GPT-2, fp32, AdamW, {WORLD_SIZE} CPU processes x 1 thread, gloo; {args.warmup} warmup +"
              f" {args.steps} timed steps (rank 0) per row, {args.repeat} interleaved pass(es): s/step is the median of"
              " the passes' means, the ratio the median of each pass's ratio to that pass's DDP (range in brackets)"
              + (f"; DeepSpeed {', '.join(sorted(versions))} (own environment, no Lightning)" if versions else "")
              + ". wide: 8 x 512, seq 128, batch 4; deep: 24 x 64, seq 32, batch 2.")
    if args.readme != "none":
        write_readme_table(rows, Path(args.readme))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(model=r.model, strategy=r.strategy, world_size=WORLD_SIZE,
                                                    times=r.times, counts=r.counts) for r in rows], indent=1))
    table = format_table(rows, header)
    print(table)
    if args.out is not None:
        write_report(args.out, table)


if __name__ == "__main__":
    main()
