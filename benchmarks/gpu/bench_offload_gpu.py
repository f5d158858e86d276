"""Offload on one GPU (issue 12, acceptance point 3): step time and the largest model that trains.

Three measurements on the demo GPT at world size 1 (``devices=1``), each training run in a fresh
subprocess so that an out-of-memory error, a hang or a crash cannot spoil the next run:

(a) step time of ``zero2_offload`` against ``zero2`` and of ``zero3_offload`` against ``zero3`` at the
    same batch, in each ``--precisions`` (target: offloaded <= 1.3x non-offloaded), and of
    ``zero2_offload+delayed`` (``offload_optimizer.delayed_update``: the host step runs on a worker thread while
    the GPU computes the next step; its "host optimizer" column then overlaps the step) against ``zero2``, with
    ``torch.cuda.max_memory_allocated`` over the training steps and the host's peak RSS;
(b) the largest GPT (by ``n_layer`` at ``--search-width``) that trains ``--search-steps`` steps under
    ``zero3`` and under ``zero3_offload`` with the GPU capped at ``--cap-gib`` through
    ``torch.cuda.set_per_process_memory_fraction`` (target: offloaded >= 3x the parameters), found by
    doubling then bisection within the wall-clock ``--budget-s``;
(c) where an offloaded step's time goes, from timers around the engine's gradient wait
    (``ZeroEngine.wait``), its step and publish (``ZeroEngine.step_and_gather``) and each host
    optimizer step, taken in the runs of (a): no extra runs;
(s) (``--parts s``, not run by default) step time against DDP of ``--s-strategies`` (DDP, zero1-3, both offloads,
    torch FSDP2 through Lightning's ModelParallelStrategy) on a ~1.2B GPT in bf16-mixed, with the GPU peak, the GPU
    bytes per parameter between steps, and the host's CPU milliseconds per step (the process's CPU time: Python,
    launches, host optimizer threads).

``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1`` is set before lzero is imported, so the reduce-scatters and
all-gathers really run through NCCL at world size 1 (see lzero/engine/collectives.py).

    python3 -m benchmarks.gpu.bench_offload_gpu          # the GPU machine: results/gpu/offload_gpu.<machine>.<date>.md
    python -m benchmarks.gpu.bench_offload_gpu --small   # CPU smoke test, printed only (--out to keep it)

Without CUDA the same code runs on the CPU accelerator (gloo): the GPU columns read "n/a", the memory
cap of (b) is not applied (the search then stops at ``--max-layers``), and only the host's peak RSS is
reported. Such figures exercise the code paths; they say nothing about offload on a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("LZERO_COLLECTIVES_AT_WORLD_SIZE_1", "1")  # read when lzero.engine.collectives is imported

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from benchmarks.common import (fsdp2_demo_gpt, module_command, module_env, out_path, peak_rss_mb, reset_peak_rss,
                               run_header, write_report)

MODULE = "benchmarks.gpu.bench_offload_gpu"
GIB = 2**30
PAIRS = [("zero2", "zero2_offload"), ("zero3", "zero3_offload")]
DELAYED = "zero2_offload+delayed"  # zero2_offload with offload_optimizer.delayed_update, against zero2 too
RESULT_TAG = "RESULT "  # the child's one line of JSON on stdout starts with this


@dataclass(frozen=True)
class Shape:
    """DemoGPT's architecture (byte vocabulary)."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    """Sequence length of every training window, too."""

    def parameters(self) -> int:
        """Distinct parameter elements (the tied head counted once), counted on the meta device."""
        from lzero.demo import GPT, GPTConfig

        with torch.device("meta"):
            return GPT(GPTConfig(vocab_size=256, **asdict(self))).num_parameters()


@dataclass
class Job:
    """One training run in a child process."""

    strategy: str
    precision: str
    shape: Shape
    batch_size: int
    warmup: int
    steps: int
    cap_gib: Optional[float] = None
    """Cap on the caching allocator (CUDA only): ``set_per_process_memory_fraction(cap / total)``."""


@dataclass
class RunResult:
    """What a child reports (or what the parent knows when it reported nothing)."""

    ok: bool
    error: str = ""
    """"oom: ...", "timeout", "exit N: ...", or another error's type and first line."""
    times: list[float] = field(default_factory=list)
    """Wall time of each timed step, seconds (CUDA synchronized before each clock read)."""
    phases: dict[str, list[float]] = field(default_factory=dict)
    """Per timed step: seconds in ``wait`` (gradients landing), ``step`` (step_and_gather), ``host`` (host optimizers)."""
    gpu_peak: Optional[float] = None
    """max_memory_allocated over the training steps, bytes (None without CUDA)."""
    gpu_start: Optional[float] = None
    """memory_allocated when training starts (model states after setup), bytes."""
    rss_peak_mb: Optional[float] = None
    """Host peak RSS from the start of training (VmHWM after a reset), MB."""
    seconds: float = 0.0
    """Wall time of the whole child process, as the parent measured it."""
    cpu: list[float] = field(default_factory=list)
    """The process's CPU seconds in each timed step (every thread)."""
    gpu_between: Optional[float] = None
    """memory_allocated at the start of the last timed step (between steps), bytes (None without CUDA)."""


# --- the child: one Trainer.fit ----------------------------------------------------------------


def _probe_class():
    """The Lightning callback of a child run (Lightning is imported only in children and when reporting)."""
    from lightning.pytorch import Callback

    class Probe(Callback):
        """Step times (CUDA synchronized at both ends), GPU peak memory, and the phase timers of (c)."""

        def __init__(self, warmup: int, cuda: bool) -> None:
            self.warmup, self.cuda = warmup, cuda
            self.times: list[float] = []
            self.phases: dict[str, list[float]] = {"wait": [], "step": [], "host": []}
            self._open = {"wait": 0.0, "step": 0.0, "host": 0.0}
            self._start = self._cpu_start = 0.0
            self.cpu: list[float] = []
            self.gpu_start = self.gpu_peak = self.gpu_between = None

        def _sync(self) -> None:
            if self.cuda:
                torch.cuda.synchronize()

        def on_train_start(self, trainer, pl_module) -> None:
            self._install_timers(trainer.strategy)
            self._sync()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                self.gpu_start = torch.cuda.memory_allocated()
            reset_peak_rss()

        def _install_timers(self, strategy) -> None:
            """Instance attributes shadowing the engine's and the host optimizers' methods (this run only; lzero's
            strategies: DDP and FSDP2 have no engine)."""
            engine = getattr(strategy, "engine", None)
            if engine is None:
                return
            engine.wait = self._timed(engine.wait, "wait")
            engine.step_and_gather = self._timed(engine.step_and_gather, "step")
            for optimizer in strategy.optimizers:
                zopt = getattr(optimizer, "_optimizer", optimizer)
                for bucket, inner in zopt.buckets:  # one host optimizer per bucket of offloaded units
                    if bucket[0].store.name != "device":
                        inner.step = self._timed(inner.step, "host")

        def _timed(self, method: Callable, phase: str) -> Callable:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    self._open[phase] += time.perf_counter() - start
            return timed

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._sync()
            if self.cuda and batch_idx >= self.warmup:
                self.gpu_between = torch.cuda.memory_allocated()
            self._open = dict.fromkeys(self._open, 0.0)
            self._start, self._cpu_start = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._sync()
            if batch_idx >= self.warmup:
                self.times.append(time.perf_counter() - self._start)
                self.cpu.append(time.process_time() - self._cpu_start)
                for phase, seconds in self._open.items():
                    self.phases[phase].append(seconds)

        def on_train_end(self, trainer, pl_module) -> None:
            if self.cuda:
                self.gpu_peak = torch.cuda.max_memory_allocated()

    return Probe


def _is_oom(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in text.lower() \
        or "ALLOC_FAILED" in text


def fit_once(job: Job) -> RunResult:
    """Train ``job`` here; an error (out of memory included) becomes a failed result."""
    from lightning.pytorch import Trainer, seed_everything

    import lzero  # noqa: F401  registers the zero2/zero3(_offload) strategy names
    from lzero.demo import DemoGPT, TextDataModule

    cuda = torch.cuda.is_available()
    if cuda and job.cap_gib is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job.cap_gib * GIB / total), 0)
    seed_everything(0, verbose=False)
    probe = _probe_class()(job.warmup, cuda)
    shape = asdict(job.shape)
    data = TextDataModule(block_size=shape["block_size"], batch_size=job.batch_size,
                          steps_per_epoch=job.warmup + job.steps)
    strategy: Any = job.strategy
    model_class = DemoGPT
    if job.strategy == DELAYED:  # the host step of step t runs while the GPU computes step t+1
        from lzero import ZeroStrategy

        strategy = ZeroStrategy(stage=2, offload_optimizer={"device": "cpu", "delayed_update": True})
    elif job.strategy == "fsdp2":  # fully_shard per block, then the GPT
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, model_class = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), fsdp2_demo_gpt()
    trainer = Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy,
                      precision=job.precision, max_steps=job.warmup + job.steps, limit_val_batches=0,
                      num_sanity_val_steps=0, callbacks=[probe], enable_checkpointing=False, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    try:
        # zero3: built on the meta device and materialized unit by unit, so the whole model never sits on the
        # GPU (what lets zero3_offload train a model larger than the GPU); zero2: built on the GPU directly
        with trainer.init_module(empty_init=job.strategy.startswith("zero3")):
            model = model_class(vocab_size=256, **shape)
        trainer.fit(model, datamodule=data)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which decides
        kind = "oom" if _is_oom(err) else type(err).__name__
        if kind != "oom":
            traceback.print_exc()  # into the child's log: where it failed, not only what
        return RunResult(False, f"{kind}: {str(err).splitlines()[0][:160] if str(err) else ''}")
    return RunResult(True, times=probe.times, phases=probe.phases, gpu_peak=probe.gpu_peak,
                     gpu_start=probe.gpu_start, rss_peak_mb=peak_rss_mb(), cpu=probe.cpu,
                     gpu_between=probe.gpu_between)


def child_main(spec: str) -> None:
    raw = json.loads(spec)
    job = Job(**{**raw, "shape": Shape(**raw["shape"])})
    result = fit_once(job)
    print(RESULT_TAG + json.dumps(asdict(result)), flush=True)
    sys.stderr.flush()
    # no interpreter teardown: after an out-of-memory error NCCL's and CUDA's destructors are the slow,
    # failure-prone part, and nothing is left to save
    os._exit(0 if result.ok else 3)


# --- the parent: runs children, searches, writes the table ---------------------------------------


class Runner:
    """Runs jobs in fresh child processes against one wall-clock deadline, keeping a log per run."""

    def __init__(self, deadline: float, log_dir: Optional[Path]) -> None:
        self.deadline = deadline
        self.log_dir = log_dir
        self.count = 0
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, job: Job, name: str, timeout: float) -> RunResult:
        timeout = min(timeout, self.left())
        if timeout < 5:
            return RunResult(False, "skipped: wall-clock budget spent")
        self.count += 1
        cmd = module_command(MODULE, "--child", json.dumps(asdict(job)))
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=module_env())
            out, err, rc = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            out, err, rc = _text(exc.stdout), _text(exc.stderr), None
        seconds = time.monotonic() - start
        self._log(name, job, out, err, rc)
        line = next((l for l in reversed(out.splitlines()) if l.startswith(RESULT_TAG)), None)
        if line is not None:
            result = RunResult(**json.loads(line[len(RESULT_TAG):]))
        elif rc is None:
            result = RunResult(False, f"timeout after {timeout:.0f} s")
        else:  # killed (host out of memory: -9) or crashed before reporting
            tail = (err.strip().splitlines() or [""])[-1][:160]
            result = RunResult(False, f"exit {rc}: {tail}")
        result.seconds = seconds
        print(f"  {name}: {'ok' if result.ok else result.error} ({seconds:.0f} s)", flush=True)
        return result

    def _log(self, name: str, job: Job, out: str, err: str, rc: Optional[int]) -> None:
        if self.log_dir is not None:
            path = self.log_dir / f"{self.count:02d}_{name}.log"
            path.write_text(f"job: {json.dumps(asdict(job))}\nrc: {rc}\n--- stdout\n{out}\n--- stderr\n{err}\n")


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


# --- (a) and (c) -----------------------------------------------------------------------------------


def measure_step_times(runner: Runner, args: argparse.Namespace, deadline_a: float) -> dict:
    results = {}
    for precision in args.precisions:
        for strategy in [s for pair in PAIRS for s in pair] + [DELAYED]:
            job = Job(strategy, precision, args.shape, args.batch_size, args.warmup, args.steps)
            budget = min(args.run_timeout, deadline_a - time.monotonic())
            results[(precision, strategy)] = runner.run(job, f"a_{precision}_{strategy}", budget)
    return results


def _gib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def table_a(results: dict, args: argparse.Namespace) -> list[str]:
    lines = ["| precision | strategy | s/step median | s/step mean | offloaded / non-offloaded (median) | target <= 1.3 |"
             " GPU peak GiB in steps | GPU GiB at start | host peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for (precision, strategy), r in results.items():
        if not r.ok:
            shown = r.error if r.error.startswith("skipped") else f"failed: {r.error}"
            lines.append(f"| {precision} | {strategy} | {shown} | | | | | | |")
            continue
        median, mean = statistics.median(r.times), statistics.mean(r.times)
        ratio, verdict = "", ""
        base = results.get((precision, strategy.replace("+delayed", "").replace("_offload", "")))
        if "_offload" in strategy and base is not None and base.ok:
            value = median / statistics.median(base.times)
            ratio, verdict = f"{value:.2f}", "met" if value <= 1.3 else "missed"
        rss = "n/a" if r.rss_peak_mb is None else f"{r.rss_peak_mb / 1024:.2f}"
        lines.append(f"| {precision} | {strategy} | {median:.3f} | {mean:.3f} | {ratio} | {verdict} | {_gib(r.gpu_peak)} |"
                     f" {_gib(r.gpu_start)} | {rss} |")
    return lines


def table_c(results: dict) -> list[str]:
    lines = ["| precision | strategy | step s | waiting for gradients s | step_and_gather s | host optimizer s |"
             " host optimizer / step |", "|---|---|---|---|---|---|---|"]
    for (precision, strategy), r in results.items():
        if not r.ok or "_offload" not in strategy:
            continue
        step = statistics.median(r.times)
        wait, stepped, host = (statistics.median(r.phases[p]) for p in ("wait", "step", "host"))
        lines.append(f"| {precision} | {strategy} | {step:.3f} | {wait:.3f} | {stepped:.3f} | {host:.3f} |"
                     f" {host / step:.0%} |")
    return lines


# --- (s) -------------------------------------------------------------------------------------------


def measure_against_ddp(runner: Runner, args: argparse.Namespace, deadline: float) -> dict:
    results = {}
    for strategy in args.s_strategies:
        job = Job(strategy, "bf16-mixed", args.s_shape, args.s_batch_size, args.warmup, args.steps)
        budget = min(args.run_timeout, deadline - time.monotonic())
        results[strategy] = runner.run(job, f"s_{strategy}", budget)
    return results


def table_s(results: dict, args: argparse.Namespace) -> list[str]:
    params = args.s_shape.parameters()
    lines = ["| strategy | s/step median | vs DDP | GPU peak GiB | GPU GiB between steps | GPU bytes per parameter"
             " between steps | host CPU ms per step |", "|---|---|---|---|---|---|---|"]
    ddp = results.get("ddp")
    for strategy, r in results.items():
        if not r.ok:
            shown = r.error if r.error.startswith("skipped") else f"failed: {r.error}"
            lines.append(f"| {strategy} | {shown} | | | | | |")
            continue
        median = statistics.median(r.times)
        ratio = f"{median / statistics.median(ddp.times):.2f}x" if ddp is not None and ddp.ok else "n/a"
        per_param = "n/a" if r.gpu_between is None else f"{r.gpu_between / params:.2f}"
        lines.append(f"| {strategy} | {median:.3f} | {ratio} | {_gib(r.gpu_peak)} | {_gib(r.gpu_between)} |"
                     f" {per_param} | {1e3 * statistics.median(r.cpu):.0f} |")
    return lines


# --- (b) -------------------------------------------------------------------------------------------


@dataclass
class Search:
    """The largest ``n_layer`` that trained, and every trial."""

    strategy: str
    best: int = 0
    trials: list[tuple[int, RunResult]] = field(default_factory=list)
    stopped: str = ""
    """Why the search ended: resolution reached, a bound, the budget, or an error that is not out-of-memory."""


def search_largest(runner: Runner, args: argparse.Namespace, strategy: str, start: int, max_layers: int) -> Search:
    """Double ``n_layer`` from ``start`` until a run fails, then bisect between the largest success and the
    smallest failure until they are within ``--resolution`` of each other."""
    found = Search(strategy)
    lo, hi, n = 0, max_layers + 1, max(1, min(start, max_layers))  # largest success, smallest failure
    while True:
        shape = Shape(n, args.search_width, args.search_heads, args.search_block_size)
        job = Job(strategy, args.search_precision, shape, args.search_batch_size, 0, args.search_steps, args.cap_gib)
        result = runner.run(job, f"b_{strategy}_L{n}", args.trial_timeout)
        found.trials.append((n, result))
        if result.ok:
            lo = found.best = n
        elif result.error.startswith(("oom", "exit -9")):  # the GPU refused, or the host killed it (its memory)
            hi = n
        else:  # a timeout, the budget, or an error that memory does not explain: not an answer about size
            found.stopped = f"stopped at n_layer={n}: {result.error}"
            return found
        if lo >= max_layers:
            found.stopped = f"reached the bound n_layer={max_layers} (--max-layers or host memory), not the GPU's"
            return found
        if hi <= max_layers and hi - lo <= max(1, lo // args.resolution):
            found.stopped = f"bracketed: n_layer {lo} trains, {hi} does not"
            return found
        n = min(2 * lo, max_layers) if hi > max_layers else (lo + hi) // 2


def host_layer_bound(args: argparse.Namespace) -> int:
    """The most layers whose host-side state (``--host-bytes-per-param``) fits in ``--host-mem-fraction`` of the
    host's available memory: beyond that the child would be killed by the host, not refused by the GPU."""
    available = _mem_available()
    per_layer = Shape(2, args.search_width, args.search_heads, args.search_block_size).parameters() - \
        Shape(1, args.search_width, args.search_heads, args.search_block_size).parameters()
    return max(1, int(available * args.host_mem_fraction / (per_layer * args.host_bytes_per_param)))


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 16 * GIB


def zero3_start(args: argparse.Namespace) -> int:
    """Half of the layers that zero3's model states alone (16 bytes per parameter in fp32, 18 under bf16-mixed:
    fp32 master, gradient and Adam moments, plus the 16-bit shard) would fill the cap with."""
    if args.cap_gib is None or not torch.cuda.is_available():
        return 1
    per_layer = Shape(2, args.search_width, args.search_heads, args.search_block_size).parameters() - \
        Shape(1, args.search_width, args.search_heads, args.search_block_size).parameters()
    per_param = 16 if args.search_precision.startswith("32") else 18
    return max(1, int(args.cap_gib * GIB / (per_layer * per_param)) // 2)


def largest_models(runner: Runner, args: argparse.Namespace) -> list[Search]:
    bound = min(args.max_layers, host_layer_bound(args))
    plain = search_largest(runner, args, "zero3", zero3_start(args), args.max_layers)
    # the offload search starts where the target would be met, so its first trial already answers it
    offloaded = search_largest(runner, args, "zero3_offload", max(1, round(3 * plain.best)), bound)
    return [plain, offloaded]


def table_b(searches: list[Search], args: argparse.Namespace) -> list[str]:
    def params(n: int) -> int:
        return Shape(n, args.search_width, args.search_heads, args.search_block_size).parameters() if n else 0

    plain = searches[0]
    base = params(plain.best) if plain.stopped.startswith("bracketed") else 0  # zero3 limited by the GPU
    lines = ["| strategy | largest n_layer | parameters | vs zero3 | target >= 3 | search ended | trials (n_layer: result, s) |",
             "|---|---|---|---|---|---|---|"]
    for s in searches:
        count = params(s.best)
        ratio = verdict = ""
        if s is not plain:
            ratio = f"{count / base:.2f}" if base else "n/a"
            verdict = _verdict(count, base, s.stopped.startswith("bracketed"))
        trials = "; ".join(f"{n}: {'ok' if r.ok else r.error.split(':')[0]}, {r.seconds:.0f}" for n, r in s.trials)
        lines.append(f"| {s.strategy} | {s.best} | {count:,} | {ratio} | {verdict} | {s.stopped} | {trials} |")
    return lines


def _verdict(count: int, base: int, bracketed: bool) -> str:
    if not base:
        return "n/a: zero3 was not limited by the GPU"
    if count >= 3 * base:
        return "met" if bracketed else "met (a lower bound: the search stopped early)"
    return "missed" if bracketed else "undecided: the search stopped before a failure"


# --- report ----------------------------------------------------------------------------------------


def environment() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        device = "no CUDA: CPU accelerator (gloo); GPU columns n/a, the cap of (b) not applied"
    return (f"{run_header()}\n\nDevice: {device}; host: {_mem_available() / GIB:.0f} GiB available;"
            f" LZERO_COLLECTIVES_AT_WORLD_SIZE_1={os.environ['LZERO_COLLECTIVES_AT_WORLD_SIZE_1']}")


def report(args: argparse.Namespace, runs_a: dict, searches: list[Search], seconds: float,
           runs_s: Optional[dict] = None) -> str:
    shape = args.shape
    lines = ["# Offload on one GPU: step time and largest model (issue 12, acceptance point 3)", "",
             f"Command: `{args.command}`", "", environment() + f"; {seconds:.0f} s in all.", ""]
    if runs_s:
        s_shape = args.s_shape
        lines += ["## (s) Step time against DDP", "",
                  f"DemoGPT {s_shape.parameters():,} parameters ({asdict(s_shape)}), bf16-mixed, batch"
                  f" {args.s_batch_size} x {s_shape.block_size} tokens, {args.warmup} warmup + {args.steps} timed"
                  " steps, each run in a fresh process, world size 1 (lzero's collectives through the backend);"
                  " fsdp2: torch's fully_shard per block through Lightning's ModelParallelStrategy. Between steps:"
                  " `memory_allocated` at the start of the last timed step. Host CPU: the process's CPU time per"
                  " step, every thread.", ""]
        lines += table_s(runs_s, args) + [""]
    if runs_a:
        lines += ["## (a) Step time at the same batch", "",
                  f"DemoGPT {shape.parameters():,} parameters ({asdict(shape)}), batch {args.batch_size} x"
                  f" {shape.block_size} tokens, {args.warmup} warmup + {args.steps} timed steps, DemoGPT's AdamW"
                  " (torch's default kernel on the device; lzero's fused CPU kernel for offloaded units), each run"
                  " in a fresh process; 32-true at torch's default float32 matmul precision (no TF32). GPU peak: `max_memory_allocated` from the start of training (after setup);"
                  " GPU at start: `memory_allocated` then (model states).", ""]
        lines += table_a(runs_a, args) + [""]
        lines += ["## (c) Where the offloaded step's time goes", "",
                  "Medians over the timed steps of (a), host wall time: `ZeroEngine.wait` (the host waits for the"
                  " gradient copies to land, and their sums), `ZeroEngine.step_and_gather` (host optimizer steps,"
                  " publishing the new values, all-gathers), of which the host optimizer steps themselves.", ""]
        lines += table_c(runs_a) + [""]
    if searches:
        cap = f"{args.cap_gib} GiB" if args.cap_gib is not None and torch.cuda.is_available() else "none (no CUDA)"
        lines += ["## (b) Largest model that trains", "",
                  f"DemoGPT at width {args.search_width} ({args.search_heads} heads), {args.search_block_size} tokens"
                  f" x batch {args.search_batch_size}, {args.search_precision}, {args.search_steps} steps, GPU capped"
                  f" at {cap} (`set_per_process_memory_fraction`); zero3 built on the meta device and materialized"
                  f" unit by unit; each trial a fresh process; bisection to within 1/{args.resolution} of the layer"
                  f" count. zero3_offload's layers are bounded by the host: --host-bytes-per-param"
                  f" {args.host_bytes_per_param} x --host-mem-fraction {args.host_mem_fraction} of available memory.",
                  ""]
        lines += table_b(searches, args) + [""]
    return "\n".join(lines)


# --- arguments ---------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes and budgets: a CPU smoke test")
    p.add_argument("--parts", default="a,b",
                   help="comma-separated: a (step times, with c), b (largest model), s (step time against DDP)")
    p.add_argument("--s-strategies", default="ddp,zero1,zero2,zero3,zero2_offload,zero3_offload,fsdp2",
                   help="(s) the rows, in order (ddp first: the others' reference)")
    p.add_argument("--s-n-layer", type=int, default=24, help="(s) model depth (24 x 2048 wide: ~1.2B parameters)")
    p.add_argument("--s-batch-size", type=int, default=8, help="(s) sequences of --block-size per step")
    p.add_argument("--precisions", default=None, help="for (a); default bf16-mixed,32-true (32-true with --small)")
    p.add_argument("--n-layer", type=int, default=12, help="(a) model depth")
    p.add_argument("--n-embd", type=int, default=2048, help="(a) model width")
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--block-size", type=int, default=512, help="(a) sequence length")
    p.add_argument("--batch-size", type=int, default=16, help="(a) sequences per step")
    p.add_argument("--warmup", type=int, default=2, help="(a) untimed steps")
    p.add_argument("--steps", type=int, default=4, help="(a) timed steps")
    p.add_argument("--run-timeout", type=float, default=120, help="(a) seconds per run")
    p.add_argument("--cap-gib", type=float, default=8.0, help="(b) GPU memory cap, GiB")
    p.add_argument("--search-width", type=int, default=2048)
    p.add_argument("--search-heads", type=int, default=16)
    p.add_argument("--search-block-size", type=int, default=256)
    p.add_argument("--search-batch-size", type=int, default=8)
    p.add_argument("--search-precision", default="bf16-mixed")
    p.add_argument("--search-steps", type=int, default=5)
    p.add_argument("--max-layers", type=int, default=128, help="(b) largest n_layer tried")
    p.add_argument("--resolution", type=int, default=4, help="(b) bisect until within 1/N of the layer count")
    p.add_argument("--trial-timeout", type=float, default=150, help="(b) seconds per trial")
    p.add_argument("--host-bytes-per-param", type=float, default=32,
                   help="(b) host bytes a zero3_offload parameter may take (masters, gradients, moments, 16-bit"
                        " shard; pinned buffers are rounded up to powers of two)")
    p.add_argument("--host-mem-fraction", type=float, default=0.7)
    p.add_argument("--budget-s", type=float, default=420, help="wall-clock budget of the whole script, seconds")
    p.add_argument("--a-share", type=float, default=0.45, help="share of the budget (a) may use when (b) follows")
    p.add_argument("--out", default=None, help="markdown output, a result name, or none (default:"
                   " results/gpu/offload_gpu.<machine>.<date>.md; none with --small)")
    p.add_argument("--log-dir", type=Path, default=None, help="a log file per child run (stdout and stderr)")
    args = p.parse_args(argv)
    args.command = shlex.join([Path(sys.executable).name, "-m", MODULE, *(sys.argv[1:] if argv is None else argv)])
    if args.small:
        args.n_layer, args.n_embd, args.n_head, args.block_size, args.batch_size = 2, 64, 2, 32, 2
        args.warmup, args.steps, args.search_steps = 1, 2, 2
        args.search_width, args.search_heads, args.search_block_size, args.search_batch_size = 64, 2, 32, 2
        args.search_precision, args.max_layers = "32-true", 2
    args.out = out_path("none" if args.out is None and args.small else args.out, "gpu", "offload_gpu")
    if args.precisions is None:
        args.precisions = "32-true" if args.small else "bf16-mixed,32-true"
    args.precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    args.parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    args.shape = Shape(args.n_layer, args.n_embd, args.n_head, args.block_size)
    args.s_strategies = [s.strip() for s in args.s_strategies.split(",") if s.strip()]
    args.s_shape = Shape(args.n_layer if args.small else args.s_n_layer, args.n_embd, args.n_head, args.block_size)
    if args.small:
        args.s_batch_size = args.batch_size
    return args


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return
    args = parse_args()
    start = time.monotonic()
    runner = Runner(start + args.budget_s, args.log_dir)
    runs_a, searches, runs_s = {}, [], {}
    if "s" in args.parts:
        share = 0.5 if args.parts - {"s"} else 1.0
        print(f"(s) step time against DDP, {len(args.s_strategies)} runs", flush=True)
        runs_s = measure_against_ddp(runner, args, start + share * args.budget_s)
    if "a" in args.parts:
        share = args.a_share if "b" in args.parts else 1.0
        print(f"(a) step times, {len(args.precisions) * 5} runs", flush=True)
        runs_a = measure_step_times(runner, args, start + share * args.budget_s)
    if "b" in args.parts:
        print("(b) largest model", flush=True)
        searches = largest_models(runner, args)
    text = report(args, runs_a, searches, time.monotonic() - start, runs_s)
    print(text)
    if args.out is not None:
        write_report(args.out, text)


if __name__ == "__main__":
    main()
