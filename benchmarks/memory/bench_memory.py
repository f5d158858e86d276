"""Peak memory per rank of DDP, lzero zero1/2/3, torch FSDP2 and DeepSpeed ZeRO-1/2/3.

Trains DemoGPT (about 25M parameters, fp32, AdamW) on 2 processes with one thread each,
once per strategy, for ``--profile-step + 3`` steps, and measures on every rank
(see :class:`MemoryProbe` for which step each measure is taken on):

* between steps (live walk): just before the measured step, after ``gc.collect()``, every
  tensor reachable from Python (``gc.get_objects()``, the module's parameters and
  gradients, the optimizers' params and state, lzero's per-unit shard optimizers included;
  a DTensor counts its local shard) is deduplicated by storage and summed, split into
  params (module parameters and the optimizers' parameters: lzero's and DeepSpeed's fp32
  shards), grads, optimizer state and other. Buffers that only C++ holds are not seen.
* peak in step (walk + allocator), every strategy alike: the live walk plus the highest net
  growth of the CPU allocator during the step, from the profiler's raw allocation events.
* peak in step (timeline), CPU: torch's memory timeline (``torch.profiler`` with
  ``profile_memory``, the ``MemoryProfile`` behind ``export_memory_timeline``) over one
  step: the peak of the summed timeline and its split by the profiler's categories
  (PARAMETER, OPTIMIZER_STATE, GRADIENT, ACTIVATION, ...). Its data-flow analysis fails on
  some ranks of DeepSpeed (reported, the row keeps the other columns).
* step RSS growth, CPU: VmHWM during the step (reset through /proc/self/clear_refs) minus
  VmRSS just before it, allocator effects included.
* on CUDA: ``torch.cuda.memory_allocated`` before the step and ``max_memory_allocated``
  during it (after ``reset_peak_memory_stats``); no profiler.

    python -m benchmarks.memory.bench_memory                 # ddp,zero1,zero2,zero3,fsdp2
    /work/venv-ds/bin/python -m benchmarks.memory.bench_memory --strategies deepspeed1,deepspeed2,deepspeed3 \\
        --json benchmarks/results/memory/memory.<machine>.<date>.json   # the lzero run's file: rows merged into it

Each run merges its rows into the ``--json`` file (by strategy name; default
``results/memory/memory.<machine>.<date>.json``) and writes the markdown beside it (same name, ``.md``)
from all rows, so DeepSpeed can run from another environment (DeepSpeed is never a dependency of lzero).
``deepspeedN`` is Lightning's DeepSpeedStrategy at ZeRO stage N with a plain torch AdamW
(``zero_force_ds_cpu_optimizer: false``), in a CPU subclass on a CPU machine.

Lightning launches rank 1 by re-running this module with the same arguments.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import json

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything
from typing_extensions import override

from benchmarks.common import (WORLD_SIZE, bench_trainer, fsdp2_demo_gpt, make_strategy, out_path, peak_rss_mb,
                               proc_status, reset_peak_rss, run_header, write_report)
from lzero.demo import DemoGPT, TextDataModule

SHAPE = dict(n_layer=8, n_head=8, n_embd=512, block_size=128)
SMALL_SHAPE = dict(n_layer=2, n_head=2, n_embd=64, block_size=32)
MB = 1e6
TIMELINE_CATEGORIES = ["PARAMETER", "OPTIMIZER_STATE", "INPUT", "TEMPORARY", "ACTIVATION", "GRADIENT", "AUTOGRAD_DETAIL", "unknown"]


def _storage_of(t: torch.Tensor):
    """(key, nbytes) of the storage behind ``t``; a DTensor counts its local shard."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        t = local
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), t.device.type), s.nbytes()
    except Exception:  # meta / fake / wrapper subclasses without storage
        return None, 0


def live_walk(module: torch.nn.Module, optimizers) -> dict[str, int]:
    """Bytes of live tensor storages, each counted once, by category (first match wins)."""
    gc.collect()
    groups: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "optimizer_state": [], "other": []}
    for p in module.parameters():
        groups["params"].append(p)
        if p.grad is not None:
            groups["grads"].append(p.grad)
    # The optimizers that hold state: a wrapper's inner optimizer (Lightning, DeepSpeed), and lzero's
    # per-unit optimizers stepping the shards (ZeroOptimizer keeps them in ``_shared.inner``).
    stepping = []
    for opt in optimizers:
        stepping += [opt, getattr(opt, "optimizer", None)]
        stepping += list(getattr(getattr(opt, "_shared", None), "inner", {}).values())
    for opt in (o for o in stepping if isinstance(o, torch.optim.Optimizer)):
        for g in opt.param_groups:
            for p in g["params"]:
                groups["params"].append(p)
                if p.grad is not None:
                    groups["grads"].append(p.grad)
        for state in opt.state.values():
            groups["optimizer_state"].extend(v for v in state.values() if isinstance(v, torch.Tensor))
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                groups["other"].append(obj)
        except Exception:  # objects whose __class__ lookup fails
            pass
    seen: set = set()
    out = {k: 0 for k in groups}
    for name, tensors in groups.items():
        for t in tensors:
            key, nbytes = _storage_of(t)
            if key is None or key in seen:
                continue
            seen.add(key)
            out[name] += nbytes
    out["total"] = sum(out.values())
    return out


MARKER_BYTES = 7_777_777  # an allocation of this size marks the start of the measured step in the profile


def _profiler():
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    )
    prof.__enter__()
    return prof


class MemoryProbe(Callback):
    """Measures training steps ``step`` and ``step + 2`` (0-based) on this rank.

    On CUDA: allocated bytes before step ``step + 2``, the allocator's peak during it. On CPU: step
    ``step`` alone is profiled for torch's memory timeline (its data-flow analysis gets more fragile over
    longer windows); then a second profile runs from the start of step ``step + 1`` to the end of
    ``step + 2`` for the allocator peak of step ``step + 2`` (so blocks that step frees but the step
    before allocated are seen being freed), a marker allocation of ``MARKER_BYTES`` separating the two.
    The live walk and the RSS growth are taken at step ``step + 2``.
    """

    def __init__(self, step: int, timeline: bool) -> None:
        self.step = step
        self.measured = step + 2
        self.timeline = timeline
        self.result: dict = {}
        self._prof = None
        self._rss0 = 0.0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        cuda = pl_module.device.type == "cuda"
        if not cuda and (batch_idx == self.step and self.timeline or batch_idx == self.measured - 1):
            self._prof = _profiler()
        if batch_idx != self.measured:
            return
        self.result["between"] = live_walk(trainer.strategy.model or pl_module, trainer.optimizers)
        if cuda:
            torch.cuda.synchronize()
            self.result["cuda_before"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)
        del marker
        reset_peak_rss()
        self._rss0 = proc_status("VmRSS") / 1024

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            if batch_idx == self.measured:
                torch.cuda.synchronize()
                self.result["cuda_peak"] = torch.cuda.max_memory_allocated()
            return
        if batch_idx == self.step and self._prof is not None:
            self._prof.__exit__(None, None, None)
            try:
                self.result["timeline"] = timeline_peak(self._prof)
            except Exception as e:  # the timeline's data-flow analysis can fail (it does on DeepSpeed)
                self.result["timeline_error"] = f"{type(e).__name__}: {e}"[:200]
            self._prof = None
        if batch_idx != self.measured:
            return
        self.result["rss_growth_mb"] = peak_rss_mb() - self._rss0
        self._prof.__exit__(None, None, None)
        try:
            self.result["alloc_peak_growth"] = allocation_peak_growth(self._prof)
        except Exception as e:
            self.result["alloc_error"] = f"{type(e).__name__}: {e}"[:200]
        self._prof = None


def _allocation_events(prof) -> list:
    """The profiler's raw CPU allocator events (alloc_size < 0 for a free), in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            out.append((node.start_time_ns, node.typed[1].ptr, node.typed[1].alloc_size))
    out.sort(key=lambda e: e[0])
    return out


def allocation_peak_growth(prof) -> int:
    """Peak, during the measured step, of the bytes allocated minus freed since the step began.

    Uses only the allocator's events (no data-flow analysis, so it works for every strategy). A free
    counts when its block's allocation was seen in the profile (the step before included); the marker
    allocation locates the step's start.
    """
    events = _allocation_events(prof)
    start = next(i for i, (_, _, size) in enumerate(events) if size == MARKER_BYTES)
    live: dict[int, int] = {}
    for _, ptr, size in events[:start]:
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    net = peak = 0
    for _, ptr, size in events[start + 2 :]:  # skip the marker's allocation and free
        if size > 0:
            live[ptr] = size
            net += size
        elif live.pop(ptr, None) is not None:
            net += size
        peak = max(peak, net)
    return peak


def timeline_peak(prof) -> dict:
    """Torch's CPU memory timeline over one step: value at its start, peak, split at the peak."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    totals = [sum(s) for s in sizes]
    i = max(range(len(totals)), key=totals.__getitem__)
    split = dict(zip(TIMELINE_CATEGORIES, sizes[i][1:]))
    return {"start": totals[0], "peak": totals[i], "split": split}


def make_any_strategy(name: str, batch_size: int):
    if name.startswith("deepspeed"):
        return make_deepspeed_strategy(int(name[-1]), batch_size)
    return make_strategy(name)


def make_deepspeed_strategy(stage: int, batch_size: int):
    """Lightning's DeepSpeedStrategy at ZeRO ``stage``; on CPU, the subclass DESIGN.md describes."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    config = {
        "zero_force_ds_cpu_optimizer": False,
        # lzero's default bucket sizes (DeepSpeed's are 5e8 elements for reduce/all-gather,
        # 2 GB of fp32 buffer per rank, most never touched): compare like with like.
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 5_000_000,
            "allgather_bucket_size": 5_000_000,
            "stage3_prefetch_bucket_size": 5_000_000,
        },
        "train_micro_batch_size_per_gpu": batch_size,
    }
    if torch.cuda.is_available():
        return DeepSpeedStrategy(config=config)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", self.local_rank)  # DeepSpeed reads the index as its device rank

        def setup_distributed(self) -> None:
            self._init_deepspeed_distributed()
            self.set_world_ranks() if hasattr(self, "set_world_ranks") else None

    return CPUDeepSpeedStrategy(config=config, process_group_backend="gloo")


def run_one(strategy: str, args: argparse.Namespace) -> dict:
    shape = SMALL_SHAPE if args.small else SHAPE
    seed_everything(0, verbose=False)
    model = (fsdp2_demo_gpt() if strategy == "fsdp2" else DemoGPT)(vocab_size=256, **shape)
    steps = args.profile_step + 3
    data = TextDataModule(block_size=shape["block_size"], batch_size=args.batch_size, steps_per_epoch=steps)
    probe = MemoryProbe(args.profile_step, timeline=not args.no_timeline)
    trainer = bench_trainer(make_any_strategy(strategy, args.batch_size), steps, [probe],
                            accelerator="cuda" if torch.cuda.is_available() else "cpu")
    trainer.fit(model, datamodule=data)
    per_rank = [probe.result] * 1
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, probe.result)
    del trainer, model, data, probe
    gc.collect()
    return {"strategy": strategy, "ranks": per_rank}


def fmt_ranks(values) -> str:
    return " / ".join("n/a" if v is None else f"{v / MB:.1f}" for v in values)


def render(rows: dict, meta: dict) -> str:
    order = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "deepspeed1", "deepspeed2", "deepspeed3"]
    names = sorted(rows, key=lambda n: order.index(n) if n in order else len(order))
    lines = ["# Peak memory per rank", ""]
    for m in meta.values():
        lines.append(f"- {m}")
    lines += [
        "",
        "MB = 10^6 bytes, per rank (rank 0 / rank 1).",
        "",
        "| strategy | between steps (live walk) | params | grads | optimizer state | other"
        " | peak in step (walk + allocator) | peak in step (timeline) | timeline split at peak"
        " | step RSS growth MiB (VmHWM) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors: list[str] = []
    for name in names:
        ranks = rows[name]["ranks"]
        walk = [r["between"] for r in ranks]
        col = lambda k: fmt_ranks([w[k] for w in walk])  # noqa: E731
        alloc = " / ".join(
            f"{(r['between']['total'] + r['alloc_peak_growth']) / MB:.1f}" if "alloc_peak_growth" in r else "n/a"
            for r in ranks
        )
        if "cuda_peak" in ranks[0]:
            alloc = fmt_ranks([r["cuda_peak"] for r in ranks]) + " (cuda max allocated)"
            peak, split, rss = "", "", ""
        else:
            tls = [r.get("timeline") for r in ranks]
            peak = " / ".join("failed" if t is None else f"{t['peak'] / MB:.1f}" for t in tls)
            first = next((i for i, t in enumerate(tls) if t), None)
            split = "" if first is None else f"rank {first}: " + ", ".join(
                f"{k} {v / MB:.1f}" for k, v in tls[first]["split"].items() if v
            )
            errors += [f"{name} rank {i}: {r['timeline_error']}" for i, r in enumerate(ranks) if "timeline_error" in r]
            rss = " / ".join(f"{r['rss_growth_mb']:.0f}" for r in ranks)
        lines.append(
            f"| {name} | {col('total')} | {col('params')} | {col('grads')} | {col('optimizer_state')}"
            f" | {col('other')} | {alloc} | {peak} | {split} | {rss} |"
        )
    lines += [
        "",
        "Columns: *between steps* is the live-tensor walk just before the measured step (storages"
        " deduplicated; params = module parameters plus the optimizer's parameters, i.e. the fp32"
        " master shards of lzero and DeepSpeed); *peak in step (walk + allocator)* is that plus the"
        " highest net growth of the CPU allocator's bytes during the step, from the profiler's raw"
        " allocation events (the same measure for every strategy); *peak in step (timeline)* is the"
        " maximum of torch's CPU memory timeline (`MemoryProfile`, as `export_memory_timeline` writes"
        " it) over the step two steps earlier, with its category split at the peak (the timeline sees"
        " only tensors the step touches; gathered zero3 parameters show as INPUT); *step RSS growth* is VmHWM during the"
        " step minus VmRSS just before it (allocator and non-tensor memory included).",
    ]
    if errors:
        lines += ["", "Memory timeline failures (the other columns of that row stand):", ""]
        lines += [f"- {e[:160]}" for e in errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    import lzero  # noqa: F401  registers zero1/zero2/zero3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp2")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process per step")
    parser.add_argument("--profile-step", type=int, default=2, help="0-based index of the measured step")
    parser.add_argument("--no-timeline", action="store_true", help="skip torch's memory timeline")
    parser.add_argument("--small", action="store_true", help="tiny model, no files written")
    parser.add_argument("--json", default=None, help="rows merged into this file (default:"
                        " results/memory/memory.<machine>.<date>.json); the markdown is written beside it")
    args = parser.parse_args()
    args.json = out_path(args.json, "memory", "memory", "json")
    torch.set_num_threads(1)
    shape = SMALL_SHAPE if args.small else SHAPE
    n_params = DemoGPT(vocab_size=256, **shape).model.num_parameters()
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    results = [run_one(s, args) for s in strategies]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for r in results:
        print(json.dumps(r))
    if args.small or args.json is None:
        return
    stored = json.loads(args.json.read_text()) if args.json.exists() else {"rows": {}, "meta": {}}
    for r in results:
        stored["rows"][r["strategy"]] = r
    ds = ("deepspeed",) if any(s.startswith("deepspeed") for s in strategies) else ()
    stored["meta"][",".join(strategies)] = (
        f"{','.join(strategies)}: DemoGPT {n_params:,} parameters ({shape}), fp32, AdamW,"
        f" {WORLD_SIZE} processes x 1 thread, batch {args.batch_size}/process, measured step"
        f" {args.profile_step} (0-based). {run_header(*ds)}"
    )
    write_report(args.json, json.dumps(stored, indent=1))
    text = render(stored["rows"], stored["meta"])
    write_report(args.json.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
