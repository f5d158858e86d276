"""A scale model of lzero's step time and memory per device, from 1 to 1024 devices.

Step time of one rank, data parallel over N ranks (an alpha-beta network model):

    t(N) = compute + optimizer(N) + exposed communication(N)

- ``compute``: forward + backward of one rank's micro-batch, which data parallelism does not change. Measured
  (``--validate``: the N = 1 run minus the optimizer) or from FLOPs (``--table``: 6 x params x tokens / (peak x MFU)).
- ``optimizer``: DDP steps all Ψ elements, a ZeRO stage its Ψ/N shard; offloaded: the host steps the shard and
  the gradients and parameters cross PCIe.
- communication per step (ring collectives; B bytes, N ranks, latency α, seconds per byte β):
  all-reduce 2(N-1)α + 2B(N-1)/N β; reduce-scatter and all-gather (N-1)α + B(N-1)/N β each (past 8 ranks the
  latency term takes 2 log2(N) steps instead of N-1: NCCL's trees and pipelined rings at scale).
  DDP all-reduces Ψ in 25 MB buckets; zero1/2 reduce-scatter Ψ and all-gather Ψ in their buckets; zero3 gathers
  every block in forward and again in backward and reduce-scatters it (3Ψ); its order checks, started a block
  ahead, overlap the gathers and are not counted. The committed runs (results/cluster/scale_runs.*.json) were
  measured when lzero ran gloo's reduce-scatter as an all-reduce, and ``--validate`` models them so; lzero now runs gloo's
  reduce-scatters and all-gathers point to point (lzero/engine/collectives.py), which new runs would need modelled.
  On CPU (gloo, one thread per rank) communication is not hidden; on GPUs (NCCL on its own streams) it hides
  behind compute, and only what exceeds the compute is exposed.
- On CPU, ranks beyond the core count time-share the cores: compute and optimizer are multiplied by
  max(1, N / cpus); ``--validate`` measures the network with N ranks on the same cores, so its α and β hold
  the time-sharing already.

Memory per device comes from lzero's own estimator (``lzero.memory.estimate``, model states + working buffers,
bf16-mixed Adam) plus activations with activation checkpointing.

    python -m benchmarks.cluster.scale_model --validate latest   # the newest results/cluster/scale_runs.*.json
    python -m benchmarks.cluster.scale_model --validate runs.json   # bench_speed --json at N = 1, 2, 4
    python -m benchmarks.cluster.scale_model --table                # 7B and 70B on 8 ... 1024 GPUs, recommended

Writes results/cluster/scale_model.<machine>.<date>.md unless ``--out`` says otherwise (``-``: stdout only).

``--validate`` measures α and β of gloo's all-reduce and all-gather on this machine with N ranks (for each N
of the runs) and the AdamW step rate, then predicts the N = 2 and N = 4 runs from the N = 1 run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from benchmarks.common import latest_result, out_path, run_header, write_report

DDP_BUCKET_BYTES = 25 * 2**20
ZERO_BUCKET = 5_000_000  # the presets' reduce_bucket_size and allgather_bucket_size, elements


@dataclass
class Network:
    alpha: float  # seconds per message hop
    beta: float  # seconds per byte
    # measured per collective kind (``measure_network``): kind -> (alpha, beta); others use the two above
    kinds: Optional[dict] = None
    # a reduce-scatter charged as an all-reduce plus a slice: how lzero ran it on gloo when the committed runs were
    # measured (it now runs pairwise, collectives.py)
    reduce_scatter_by_all_reduce: bool = False

    def ring(self, kind: str, nbytes: float, n: int, messages: int = 1) -> float:
        if n == 1:
            return 0.0
        if kind == "reduce_scatter" and self.reduce_scatter_by_all_reduce:
            kind = "all_reduce"
        alpha, beta = (self.kinds or {}).get(kind, (self.alpha, self.beta))
        hops = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[kind]
        # a ring's n - 1 latency steps; past one node NCCL's trees and pipelining pay about log2(n) of them
        steps = n - 1 if n <= 8 else 2 * math.log2(n)
        return hops * (messages * steps * alpha + (n - 1) * nbytes / n * beta)


@dataclass
class Model:
    params: float  # Ψ, trainable elements
    layers: int  # stage-3 blocks
    bytes_per_element: int = 4  # of the communicated values (fp32 here; bf16-mixed reduces in bf16 on GPUs: 2)


def communication(strategy: str, model: Model, n: int, net: Network) -> float:
    """Seconds of collectives per step on one rank (see the module docstring)."""
    b = model.params * model.bytes_per_element
    stage = strategy.removeprefix("zero")[:1]
    if strategy == "ddp":
        return net.ring("all_reduce", b, n, messages=max(1, math.ceil(b / DDP_BUCKET_BYTES)))
    buckets = max(1, math.ceil(model.params / ZERO_BUCKET))
    flag = net.ring("all_reduce", 4, n)
    if stage in ("1", "2"):
        return net.ring("reduce_scatter", b, n, buckets) + net.ring("all_gather", b, n, buckets) + flag
    blocks = model.layers + 1  # each block and the root reduce-scatter once
    gathers = 2 * model.layers + 1  # blocks in forward and backward, the root once
    # the order check of each gather (an 8-byte all-gather) is started a block ahead and runs while the previous
    # block gathers and computes: it is not on the critical path, so it is not counted
    return net.ring("reduce_scatter", b, n, blocks) + net.ring("all_gather", 2 * b, n, gathers) + flag


def predict(strategy: str, model: Model, n: int, net: Network, compute: float, adam_rate: float,
            cpus: int | None = None, hide_behind_compute: bool = False, net_shares_cpus: bool = False) -> float:
    """``net_shares_cpus``: ``net`` was measured with ``n`` ranks on these ``cpus``, so its times already hold the
    time-sharing of the cores; only compute and the optimizer are then scaled by it."""
    sharded = strategy != "ddp"
    optimizer = model.params / (n if sharded else 1) / adam_rate
    comm = communication(strategy, model, n, net)
    share = max(1.0, n / cpus) if cpus else 1.0
    exposed = max(0.0, comm - compute) if hide_behind_compute else comm
    return share * (compute + optimizer) + (exposed if net_shares_cpus else share * exposed)


# --- validation on this machine -----------------------------------------------------------------------------


# the two message sizes α and β are fitted from (output elements): a block-sized message like a stage-3 gather of
# the deep model (a 4-byte one measures gloo's fastest path, which no step takes) and a large one
SMALL, BIG = 65_536, 4_000_000


def _net_rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def timed(run, repeats: int) -> float:  # the median of 5 batches' means: one slow moment moves none of them
        run()
        means = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                run()
            means.append((time.perf_counter() - start) / repeats)
        return statistics.median(means)

    found = {}
    for numel, repeats in ((SMALL, 50), (BIG, 2)):  # the output's elements, as lzero's collectives count them
        flat = torch.zeros(numel - numel % world)
        shard = torch.zeros(flat.numel() // world)
        found[("all_reduce", numel)] = (timed(lambda: dist.all_reduce(flat), repeats), flat.numel() * 4)
        found[("all_gather", numel)] = (timed(lambda: dist.all_gather_single(flat, shard), repeats),
                                        flat.numel() * 4)
    if rank == 0:
        queue.put(found)
    dist.destroy_process_group()


def measure_network(world: int = 2) -> Network:
    """α and β of gloo's all-reduce and all-gather on this machine (the collectives lzero runs on gloo: a
    reduce-scatter there is an all-reduce), each from a 256 KB and a 16 MB message, fitted to the ring form."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_net_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    found = queue.get(timeout=300)
    for p in procs:
        p.join()
    kinds = {}
    for kind, hops in (("all_reduce", 2), ("all_gather", 1)):
        (t_small, b_small), (t_big, b_big) = found[(kind, SMALL)], found[(kind, BIG)]
        beta = (t_big - t_small) / (hops * (b_big - b_small) * (world - 1) / world)
        alpha = (t_small - hops * b_small * (world - 1) / world * beta) / (hops * (world - 1))
        kinds[kind] = (alpha, beta)
    return Network(*kinds["all_reduce"], kinds=kinds, reduce_scatter_by_all_reduce=True)


def measure_adam(numel: int) -> float:
    """Elements per second of torch AdamW (the default kernel) on one thread."""
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.randn(numel) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4)
    opt.step()
    start = time.perf_counter()
    for _ in range(5):
        opt.step()
    return numel * 5 / (time.perf_counter() - start)


SHAPES = {"wide": (8 * 12 * 512 * 512 + 8000 * 512 + 128 * 512, 8), "deep": (24 * 12 * 64 * 64 + 8000 * 64 + 32 * 64, 24)}


def validate(path: Path, cpus: int) -> str:
    rows = json.loads(path.read_text())
    # the network is measured with as many ranks as each prediction has: past the core count the ranks time-share
    # the CPUs, and the collectives' latency with them (as a different fabric would have its own α and β)
    nets = {n: measure_network(n) for n in sorted({r["world_size"] for r in rows}) if n > 1}
    lines = [f"gloo on this machine, {cpus} CPUs, fitted to the ring form with N ranks (a reduce-scatter runs as an"
             " all-reduce: lzero's choice on gloo):", ""]
    lines += [f"- N = {n}: " + "; ".join(f"{kind} α = {a * 1e6:.0f} µs per hop, β = {1 / b / 1e9:.2f} GB/s"
                                       for kind, (a, b) in net.kinds.items()) for n, net in nets.items()]
    lines += ["", "| model | strategy | N | measured s/step | predicted | error |", "|---|---|---|---|---|---|"]
    errors = []
    for model_name in dict.fromkeys(r["model"] for r in rows):
        psi, layers = SHAPES[model_name]
        model = Model(psi, layers)
        adam = measure_adam(int(psi))
        for strategy in dict.fromkeys(r["strategy"] for r in rows if r["model"] == model_name):
            mine = {r["world_size"]: statistics.mean(r["times"]) for r in rows
                    if r["model"] == model_name and r["strategy"] == strategy}
            if 1 not in mine:
                continue
            compute = mine[1] - psi / adam  # the N = 1 run holds no communication
            for n in sorted(mine):
                t = predict(strategy, model, n, nets.get(n, Network(0.0, 0.0)), compute, adam, cpus=cpus,
                            net_shares_cpus=True)
                err = t / mine[n] - 1
                if n > 1:
                    errors.append(abs(err))
                lines.append(f"| {model_name} | {strategy} | {n} | {mine[n]:.4f} | {t:.4f} | {err:+.0%} |")
    lines += ["", f"Largest error at N > 1: {max(errors):.0%}." if errors else ""]
    return "\n".join(lines) + "\n"


# --- the table for large models on GPUs -----------------------------------------------------------------------

LARGE = {"7B": dict(params=6.7e9, layers=32, hidden=4096), "70B": dict(params=69e9, layers=80, hidden=8192)}
GPU = dict(memory=80e9, flops=989e12, mfu=0.4, hbm=3.35e12, pcie=25e9, host_adam=1.0e9)
NVLINK = Network(alpha=5e-6, beta=1 / 450e9)  # per direction, inside a node of 8
INFINIBAND = Network(alpha=10e-6, beta=1 / 50e9)  # 400 Gb/s per GPU between nodes
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def gpu_step(strategy: str, spec: dict, n: int, tokens: int) -> tuple[float, float]:
    """(seconds per step, bytes per GPU) for one GPU of ``n``."""
    from lzero.memory.estimate import ModelCount, estimate

    psi, layers, h = spec["params"], spec["layers"], spec["hidden"]
    compute = 6 * psi * tokens / (GPU["flops"] * GPU["mfu"])
    net = NVLINK if n <= 8 else INFINIBAND
    model = Model(psi, layers, bytes_per_element=2)
    comm = communication(strategy.removesuffix("_offload"), model, n, net)
    shard = psi / (1 if strategy == "ddp" else n)
    if strategy.endswith("_offload"):  # gradients down, parameters up over PCIe, the host steps the shard
        optimizer = 4 * shard / GPU["pcie"] + shard / GPU["host_adam"]
    else:
        optimizer = 16 * shard / GPU["hbm"]  # Adam reads and writes ~16 bytes per element on the device
    t = compute + optimizer + max(0.0, comm - compute)
    count = ModelCount(int(psi), largest_block=int(12 * h * h), root=int(psi - layers * 12 * h * h))
    states = estimate(count, num_gpus=min(n, 8), num_nodes=max(1, n // 8), strategies=[strategy], buffers=True)[0]
    micro, seq = tokens // 4096, 4096
    activations = 2 * micro * seq * h * layers + 34 * micro * seq * h  # checkpointed inputs + one live block
    return t, states.per_device + activations


def table(tokens: int) -> str:
    lines = [f"Per GPU: {tokens} tokens per step (micro-batch x 4096), bf16-mixed AdamW, activation checkpointing;"
             f" H100-like: {GPU['memory'] / 1e9:.0f} GB, {GPU['flops'] / 1e12:.0f} TFLOP/s at MFU {GPU['mfu']},"
             " NVLink 450 GB/s and α 5 µs inside a node of 8, InfiniBand 400 Gb/s (50 GB/s) and α 10 µs between"
             " nodes, PCIe 25 GB/s and a host step of 1e9 elements/s per GPU for offload.", ""]
    for name, spec in LARGE.items():
        lines += [f"**{name}**", "",
                  "| GPUs | " + " | ".join(f"{s} s/step (GB)" for s in STRATEGIES) + " | recommended |",
                  "|---" * (len(STRATEGIES) + 2) + "|"]
        for n in (8, 16, 32, 64, 128, 256, 512, 1024):
            cells, fits = [], []
            for s in STRATEGIES:
                t, mem = gpu_step(s, spec, n, tokens)
                ok = mem <= 0.9 * GPU["memory"]
                cells.append(f"{t:.2f} ({mem / 1e9:.0f}{'' if ok else ' ✗'})")
                if ok:
                    fits.append((t, STRATEGIES.index(s), s))
            if fits:  # the fastest that fits; within 2% of it, the lowest stage (fewer, larger collectives)
                fastest = min(t for t, _, _ in fits)
                t, _, best = min((f for f in fits if f[0] <= 1.02 * fastest), key=lambda f: f[1])
                why = f"{t:.2f} s, fits" + (f"; the fastest is {fastest:.2f} s" if t > fastest else "")
            else:
                best, why = "none", "no choice fits 90% of 80 GB: add GPUs, tensor or pipeline parallelism"
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {best}: {why} |")
        lines.append("")
    lines.append("✗: over 90% of the GPU's memory.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", help="bench_speed --json output with N = 1, 2, 4 runs, or 'latest' (the newest"
                        " results/cluster/scale_runs.*.json)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--tokens", type=int, default=4 * 4096, help="tokens per GPU per step for --table")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or - for stdout only (default:"
                        " results/cluster/scale_model.<machine>.<date>.md)")
    args = parser.parse_args()
    if not (args.validate or args.table):
        parser.print_help()
        sys.exit(2)
    if args.validate == "latest":
        args.validate = latest_result("cluster", "scale_runs", "json")
        if args.validate is None:
            parser.error("--validate latest: no results/cluster/scale_runs.*.json")
    parts = ["# Scale model: validation and projections\n", run_header() + "\n"]
    if args.validate:
        parts += [f"## Validation (`scale_model --validate {Path(args.validate).name}`)\n",
                  validate(Path(args.validate), args.cpus)]
    if args.table:
        parts += [f"## Projections (`scale_model --table --tokens {args.tokens}`)\n", table(args.tokens)]
    text = "\n".join(parts) + "\n"
    print(text)
    if args.out != "-":
        write_report(out_path(args.out, "cluster", "scale_model"), text)


if __name__ == "__main__":
    main()
