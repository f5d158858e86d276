"""Throughput of the offloaded optimizer step: lzero's host step against torch's fused AdamW on one flat
tensor and against DeepSpeed's compiled CPU Adam, in one run.

    python -m benchmarks.offload.bench_offload_optimizer                # lzero and torch only
    python -m benchmarks.offload.bench_offload_optimizer --ds-python /work/venv-ds/bin/python
    # writes results/offload/offload_optimizer.<machine>.<date>.md

Each measurement runs in a fresh process with ``--threads`` torch/OpenMP threads (1 and 2 by default):

- ``lzero host step``: a world-size-1 ``zero2_offload`` engine over a stack of Linear layers (``--params``
  elements, units of ``reduce_bucket_size`` = 5M elements as by default) whose shard gradients are set; the
  time of stepping every unit as ``ZeroOptimizer.step`` does (the user's AdamW, run with torch's fused CPU
  kernel, hyperparameters copied from the user's groups, one call per unit), with and without publishing
  the stepped values into the parameters (``+ copy back``: on CUDA that copy goes to the device).
- ``torch fused AdamW, one flat tensor``: ``torch.optim.AdamW(fused=True)`` on one tensor of the same size.
- ``DeepSpeedCPUAdam``: DeepSpeed's compiled CPU Adam (AdamW mode, fp32) on one tensor of the same size, run
  with ``--ds-python`` (an environment with DeepSpeed; never a dependency of lzero).

Throughput is elements stepped per second (best of ``--repeats`` timed steps after ``--warmup``). The three
measurements alternate for ``--rounds`` rounds and each keeps its best round, so a slow moment of the shared
machine does not land on one of them only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.common import module_command, module_env, out_path, publish, run_header


def _time(step, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def measure_lzero(numel: int, warmup: int, repeats: int) -> dict:
    import torch
    from torch import nn

    from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer

    width = 2048
    layers = max(1, round(numel / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, offload_optimizer="cpu"))
    zopt = ZeroOptimizer(opt, engine, 0)
    for unit in engine.units:
        unit.shard_grad = torch.randn_like(unit.master_shard) * 1e-3
        unit.mark_reduced()

    def host_step() -> None:
        for bucket, inner in zopt.buckets:
            zopt._copy_hyperparameters(inner)
            inner.step()

    def host_step_and_publish() -> None:
        for bucket, inner in zopt.buckets:
            zopt._copy_hyperparameters(inner)
            inner.step()
            for unit in bucket:
                unit.publish()

    total = sum(u.spec.shard_numel for u in engine.units)
    step_s = _time(host_step, warmup, repeats)
    publish_s = _time(host_step_and_publish, warmup, repeats)
    return {"lzero host step": total / step_s, "lzero host step + copy back": total / publish_s,
            "numel": total, "units": len(engine.units), "kernel": zopt.host_kernel}


def measure_torch(numel: int, warmup: int, repeats: int) -> dict:
    import torch

    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
    return {"torch fused AdamW, one flat tensor": numel / _time(opt.step, warmup, repeats)}


def measure_deepspeed(numel: int, warmup: int, repeats: int) -> dict:
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel) * 1e-3
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    return {f"DeepSpeedCPUAdam ({deepspeed.__version__})": numel / _time(opt.step, warmup, repeats)}


def child(kind: str, numel: int, threads: int, warmup: int, repeats: int) -> None:
    import torch

    torch.set_num_threads(threads)
    measure = {"lzero": measure_lzero, "torch": measure_torch, "deepspeed": measure_deepspeed}[kind]
    print(json.dumps(measure(numel, warmup, repeats)))


def run_child(python: str, kind: str, args: argparse.Namespace, threads: int) -> dict:
    env = module_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = module_command(__spec__.name, "--child", kind, "--params", args.params, "--threads", threads,
                         "--warmup", args.warmup, "--repeats", args.repeats, python=python)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000, help="elements stepped per step")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; each measurement keeps its best")
    parser.add_argument("--ds-python", default=None, help="python of an environment with DeepSpeed")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/offload/offload_optimizer.<machine>.<date>.md)")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.params, int(args.threads), args.warmup, args.repeats)
        return
    args.out = out_path(args.out, "offload", "offload_optimizer")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        found: dict = {}
        for _ in range(args.rounds):
            measured = {**run_child(sys.executable, "lzero", args, threads), **run_child(sys.executable, "torch", args, threads)}
            if args.ds_python:
                measured.update(run_child(args.ds_python, "deepspeed", args, threads))
            for key, value in measured.items():
                found[key] = max(found[key], value) if isinstance(value, float) and key in found else value
        rows.append((threads, found))
        print(threads, found, flush=True)
    names = [k for k in rows[0][1] if k not in ("numel", "units", "kernel")]
    ds = next((k for k in names if k.startswith("DeepSpeedCPUAdam")), None)
    fused = "torch fused AdamW, one flat tensor"
    first = rows[0][1]
    lines = [
        run_header(),
        "",
        f"Offloaded optimizer step, AdamW fp32, {first['numel']:,} elements ({first['units']} units of lzero's"
        f" default 5M-element buckets; host kernel: {first['kernel']}); best of {args.repeats} steps after"
        f" {args.warmup} warmup, each in a fresh process, best of {args.rounds} alternating rounds"
        + (f"; {ds} in its own environment." if ds else "."),
        "",
        f"`python -m {__spec__.name}" + (f" --ds-python {args.ds_python}`" if args.ds_python else "`"),
        "",
        "| threads | " + " | ".join(f"{n} (M elements/s)" for n in names) + " | lzero / fused | lzero / DeepSpeed |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for threads, found in rows:
        cells = " | ".join(f"{found[n] / 1e6:,.0f}" for n in names)
        vs_fused = found["lzero host step"] / found[fused]
        vs_ds = f"{found['lzero host step'] / found[ds]:.2f}" if ds else "not run"
        lines.append(f"| {threads} | {cells} | {vs_fused:.2f} | {vs_ds} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
