"""The offloaded step's host path on this CPU: page faults, host bytes allocated and seconds per step, against the
bound of 36 bytes per parameter at this machine's copy bandwidth (issue 46, point 1).

A real ``ZeroEngine`` (stage 2, ``offload_optimizer: cpu``, world size 1) trains a stack of Linear layers of about
200M parameters; the "device" is this CPU, so forward and backward allocate their own activations and gradients
(torch has no caching allocator on the CPU) and those page faults are not the host path's. The host path's own
work is counted apart: every call of the store's ``land_grad`` / ``finish`` / ``publish`` and of the inner
optimizers' ``step`` is wrapped, and inside it the minor page faults (``getrusage``), the seconds, and the bytes of
every tensor storage an aten op creates there (a ``TorchDispatchMode``) are summed. The copy bandwidth is measured
in the same run: bytes read plus bytes written per second of a 1 GB ``copy_`` between reused buffers.

    python -m benchmarks.offload.bench_host_path --label new        # a line of results/offload/host_path.*.json
    python -m benchmarks.offload.bench_host_path --table FILE.json  # the runs of FILE.json as a markdown table

Each JSON line carries its run's date, commit, machine and versions (``run``), which the table lists.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import out_path, run_header
from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.engine.mixed_precision import PrecisionPolicy

BYTES_PER_PARAM = 36  # AdamW's 28 (read p, g, m, v; write p, m, v) + the gradient landing and the publish


class _NewStorages(TorchDispatchMode):
    """Sums the bytes of storages that aten ops create (outputs not aliasing an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.nbytes() > 0:
                inputs.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


class Meter:
    """Seconds, minor page faults and new host bytes of the wrapped calls, by phase, for the current step."""

    def __init__(self) -> None:
        self.step: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._depth = 0

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        inner: Callable = getattr(obj, name)

        def measured(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # nested inside another measured call: counted by the outer one
                return inner(*args, **kwargs)
            self._depth += 1
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            mode = _NewStorages()
            start = time.perf_counter()
            try:
                with mode:
                    return inner(*args, **kwargs)
            finally:
                row = self.step[phase]
                row["s"] += time.perf_counter() - start
                row["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                row["bytes"] += mode.bytes
                self._depth -= 1

        setattr(obj, name, measured)

    def take(self) -> dict[str, dict[str, float]]:
        out = {k: dict(v) for k, v in self.step.items()}
        self.step.clear()
        return out


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes read plus written per second by ``copy_`` between two reused (already faulted) buffers."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros(nbytes // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def table(path: str) -> str:
    """The runs appended to ``path`` (one JSON object a line) as a markdown table."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    runs = list(dict.fromkeys(r.get("run", "(not recorded)") for r in rows))
    out = [f"- {run}" for run in runs] + [""]
    out += ["| run | precision | threads | copy GB/s | bound s | landing s | host step s | publish s | host path s |"
           " x bound | faults/step | MB allocated/step | whole step s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["per_step"]
        out.append(f"| {r['label']} | {r['precision']} | {r['threads']} | {r['bandwidth_gb_s']:.1f} | {r['bound_s']:.3f} |"
                   f" {p['landing']['s']:.3f} | {p['host step']['s']:.3f} | {p['publish']['s']:.3f} |"
                   f" {r['host_path_s']:.3f} | {r['host_path_s'] / r['bound_s']:.2f} | {r['faults']:,.0f} |"
                   f" {r['bytes'] / 1e6:,.1f} | {r['wall_s']:.3f} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="bf16-mixed")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", default=None, help="append the result as one JSON line to this file, or none"
                        " (default: results/offload/host_path.<machine>.<date>.json)")
    parser.add_argument("--options", default="{}", help="extra ZeroConfig offload_optimizer keys, as JSON")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    args.json = out_path(args.json, "offload", "host_path", "json")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mixed = args.precision == "bf16-mixed"
    policy = PrecisionPolicy(torch.bfloat16, torch.float32) if mixed else None
    offload = {"device": "cpu", **json.loads(args.options)}
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, offload_optimizer=offload), policy)
    zopt = ZeroOptimizer(opt, engine, 0)
    meter = Meter()
    for store in {id(u.store): u.store for u in engine.units}.values():
        meter.wrap(store, "land_grad", "landing")
        meter.wrap(store, "finish", "landing")
        meter.wrap(store, "publish", "publish")
    for _, inner in zopt.buckets:
        meter.wrap(inner, "step", "host step")
    bandwidth = copy_bandwidth()
    x = torch.randn(1, args.width)
    steps = []
    for step in range(args.steps):
        start = time.perf_counter()
        engine.gather_root()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = model(x).float().square().mean()
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        wall = time.perf_counter() - start
        steps.append({"wall_s": wall, **meter.take()})
    engine.remove()
    later = steps[2:]  # after step 2: every persistent buffer exists

    def mean(phase: str, key: str) -> float:
        return sum(s.get(phase, {}).get(key, 0.0) for s in later) / len(later)

    phases = ["landing", "host step", "publish"]
    result = {
        "run": run_header(), "label": args.label, "params": params, "precision": args.precision,
        "threads": torch.get_num_threads(),
        "options": offload, "bandwidth_gb_s": bandwidth / 1e9,
        "bound_s": BYTES_PER_PARAM * params / bandwidth,
        "per_step": {p: {k: mean(p, k) for k in ("s", "faults", "bytes")} for p in phases},
        "host_path_s": sum(mean(p, "s") for p in phases),
        "faults": sum(mean(p, "faults") for p in phases),
        "bytes": sum(mean(p, "bytes") for p in phases),
        "wall_s": sum(s["wall_s"] for s in later) / len(later),
        "steps": steps,
    }
    print(f"{args.label}: {params / 1e6:.0f}M parameters, {args.precision}, {result['threads']} threads;"
          f" copy bandwidth {result['bandwidth_gb_s']:.1f} GB/s (read + write); bound"
          f" {BYTES_PER_PARAM} B/param = {result['bound_s']:.3f} s")
    for p in phases:
        row = result["per_step"][p]
        print(f"  {p:10s} {row['s']:.3f} s  {row['faults']:>9,.0f} faults  {row['bytes'] / 1e6:>9,.1f} MB new")
    print(f"  host path {result['host_path_s']:.3f} s = {result['host_path_s'] / result['bound_s']:.2f}x the bound;"
          f" {result['faults']:,.0f} faults and {result['bytes'] / 1e6:,.1f} MB allocated per step after step 2;"
          f" whole step {result['wall_s']:.3f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"appended to {args.json}")


if __name__ == "__main__":
    main()
