"""A two-level scale model: step time of flat, hybrid, hpZ and quantized layouts with one network inside a node and
another between nodes, fitted on the simulated cluster and projected to 7B/70B on GPU clusters.

[Note: the two-level model]
Each level is an alpha-beta network: a collective costs ``steps x alpha + bytes x beta``, where ``bytes`` is what one
rank sends over its busiest link (ring algorithms: an all-gather or reduce-scatter of B bytes over n ranks moves
B(n-1)/n, an all-reduce twice that). Inside a node (G ranks) the links are the node's own (loopback here, NVLink on
GPUs); a collective that spans nodes is as slow as its inter-node hops (one hop in each direction per node for a ring
over consecutive ranks; on GPU clusters, each GPU's own NIC). Per step, with Ψ parameters of ``e`` bytes, N ranks, G
per node, R = N/G nodes, q the quantized bytes per element (qwZ: 1.0625; qgZ int8 1.0625, int4 0.5625):

| layout | inter-node (per rank's link) | intra-node |
|---|---|---|
| DDP | all-reduce Ψe over N | - |
| zero2 flat | reduce-scatter Ψe + all-gather Ψe, over N | - |
| zero2 hybrid | all-reduce of the shard Ψe/G over R | reduce-scatter + all-gather Ψe over G |
| zero3 flat | 2 all-gathers + reduce-scatter Ψe over N | - |
| zero3 hybrid | all-reduce of the shard Ψe/G over R | 2 all-gathers + reduce-scatter Ψe over G |
| zero3 hpZ | all-gather (forward) + reduce-scatter Ψe over N | all-gather (backward) Ψe over G |
| zero3 qwZ | 2 all-gathers Ψq + reduce-scatter Ψe over N | - |
| zero3 qwZ + qgZ | 2 all-gathers Ψq + all-to-all Ψq over N | - |
| hybrid qwZ + qgZ | all-to-all + all-gather of the shard Ψq/G over R | 2 all-gathers + all-to-all Ψq over G |

On the simulated cluster the 4 ranks share 2 CPU cores, so the model adds compute (forward + backward, measured with
all 4 ranks running), the optimizer step of the rank's shard, the quantization work, lzero's tiny order-check
collectives and the collectives within a node; the bytes between nodes cost the larger of the shaped link's time and
the CPU's (moving those bytes, plus the stage-3 engine's own work, measured at world size 1): see ``predict_cpu``. On
GPUs compute comes from FLOPs and communication hides behind it; only what exceeds it is exposed (as
benchmarks.cluster.scale_model assumes).

    python -m benchmarks.cluster.two_level --validate latest --table   # the newest cluster JSON: fit, predict, project
    python -m benchmarks.cluster.two_level --validate benchmarks/results/cluster/cluster.<machine>.<date>.json
    python -m benchmarks.cluster.two_level --table --out -            # 7B/70B projections, on stdout

Writes results/cluster/two_level.<machine>.<date>.md unless ``--out`` says otherwise (``-``: stdout).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks.common import latest_result, out_path, run_header, write_report

Q8, Q4 = 1.0625, 0.5625  # bytes per element of lzero's blockwise int8 / int4 codes with fp32 scales per 64


@dataclass(frozen=True)
class Level:
    alpha: float  # seconds per step of a collective
    beta: float  # seconds per byte on a rank's busiest link


@dataclass(frozen=True)
class Cluster:
    intra: Level
    inter: Level
    per_node: int  # G
    flat: Optional[Level] = None  # the simulated cluster: lzero's pairwise collectives over every rank, link bytes


def _ring(kind: str, nbytes: float, n: int) -> tuple[float, float]:
    """(steps, bytes on the busiest link) of a ring collective of ``nbytes`` over ``n`` ranks; all-to-all sends
    (n-1)/n of its buffer; latency past 8 ranks grows as log2 (trees, pipelined rings)."""
    if n <= 1:
        return 0.0, 0.0
    factor = 2 if kind == "all_reduce" else 1
    steps = (n - 1) if n <= 8 else 2 * math.log2(n)
    return factor * steps, factor * nbytes * (n - 1) / n


def collectives(layout: str, psi: float, e: float, n: int, g: int) -> list[tuple[str, str, float, int]]:
    """(level, kind, bytes, ranks) of one step's collectives: the table of [Note: the two-level model]."""
    b, r = psi * e, n // g
    reduce = "reduce_scatter"
    rows = {
        "ddp": [("inter", "all_reduce", b, n)],
        "zero2": [("inter", reduce, b, n), ("inter", "all_gather", b, n)],
        "zero2_hybrid": [("intra", reduce, b, g), ("inter", "all_reduce", b / g, r), ("intra", "all_gather", b, g)],
        "zero3": [("inter", "all_gather", b, n)] * 2 + [("inter", reduce, b, n)],
        "zero3_hybrid": [("intra", "all_gather", b, g)] * 2 + [("intra", reduce, b, g),
                                                             ("inter", "all_reduce", b / g, r)],
        # max_reuse_distance past the model: each block stays gathered from its forward to its backward
        "zero3_hybrid_reuse": [("intra", "all_gather", b, g), ("intra", reduce, b, g), ("inter", "all_reduce", b / g, r)],
        "zero3_hpz": [("inter", "all_gather", b, n), ("intra", "all_gather", b, g), ("inter", reduce, b, n)],
        "zero3_qwz": [("inter", "all_gather", psi * Q8, n)] * 2 + [("inter", reduce, b, n)],
        "zero3_qwz_qgz8": [("inter", "all_gather", psi * Q8, n)] * 2 + [("inter", "all_to_all", psi * Q8, n)],
        "zero3_qwz_qgz4": [("inter", "all_gather", psi * Q8, n)] * 2 + [("inter", "all_to_all", psi * Q4, n)],
        "zero3_hybrid_qwz_qgz8": [("intra", "all_gather", psi * Q8, g)] * 2 + [
            ("intra", "all_to_all", psi * Q8, g), ("inter", "all_to_all", psi / g * Q8, r),
            ("inter", "all_gather", psi / g * Q8, r)],
    }
    return rows[layout]


def communication(layout: str, psi: float, e: float, n: int, cluster: Cluster) -> float:
    """Seconds of one step's collectives, one after another (GPU clusters: each GPU its own NIC)."""
    total = 0.0
    for level, kind, nbytes, ranks in collectives(layout, psi, e, n, cluster.per_node):
        net = cluster.intra if level == "intra" else cluster.inter
        steps, moved = _ring(kind, nbytes, ranks)
        total += steps * net.alpha + moved * net.beta
    return total


# --- the simulated cluster -------------------------------------------------------------------------------------


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b x`` over (x, t)."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, mt - b * mx), b


def fit(probe: dict, g: int = 2) -> Cluster:
    """The two levels from cluster_probe.py's measurements (4 ranks, 2 nodes of 2)."""
    # within a node: an all-gather of B over G moves B(G-1)/G in G-1 steps
    a, b = _fit([(nbytes * (g - 1) / g, t) for nbytes, t in probe["intra_all_gather"]])
    intra = Level(alpha=a / (g - 1), beta=b)
    # between nodes: G pairs all-reduce B each at once; the link carries G B(R-1)/R... per direction, here G x B / 2 x 2
    # (an all-reduce over 2 ranks moves B each way): the busiest link's bytes per collective are those of the node
    a, b = _fit([(g * nbytes, t) for nbytes, t in probe["inter_all_reduce"]])
    inter = Level(alpha=a / 2, beta=b)
    # lzero's pairwise collectives over all N ranks: G x (N - G)/N of the buffer crosses the link each way, in 2 x G
    # flows at once (the pairs' all-reduces above are G flows), which the shaped link carries less well
    flat = None
    if "flat_all_gather" in probe:
        n = 2 * g
        a, b = _fit([(nbytes * g * (n - g) / n, t) for nbytes, t in probe["flat_all_gather"]])
        flat = Level(alpha=a, beta=b)
    return Cluster(intra, inter, g, flat)


def predict_cpu(layout: str, probe: dict, cluster: Cluster, n: int = 4) -> float:
    """A simulated-cluster step: compute, the shard's AdamW step, quantization work, lzero's tiny collectives over
    every rank, the collectives within a node, and the bytes between nodes, which cost the larger of two times: the
    shaped link's (inter alpha-beta), or the CPU's, which must move the same bytes (at the intra level's per-byte
    cost: the 4 ranks share 2 cores) and do the stage-3 engine's own work (``stage3_overhead``). At 1 Gbit/s the
    link is the larger and hides the engine's work; at 10 Gbit/s the CPU is. DDP's flat all-reduce (gloo's ring)
    crosses the link one hop each way, carrying B(N-1)/N per phase; lzero's flat reduce-scatters and all-gathers are
    pairwise and carry G(N-G)/N; the replica all-reduce's G pairs share the link."""
    psi, g = probe["params"], cluster.per_node
    stepped = psi if layout == "ddp" else psi / (g if "hybrid" in layout else n)
    t = probe["compute"] + probe["adam_per_element"] * stepped
    # quantization work: done while earlier blocks' codes cross the link, so it joins the CPU side of the link's max
    quantizing = 0.0
    if "qwz" in layout:  # each gather quantizes the shard and dequantizes the whole, twice per step
        quantizing += 2 * probe["quantize_per_element"] * psi
    if "qgz" in layout:  # every gradient quantized once (stochastically) and every received chunk dequantized;
        # hybrid: the replica all-reduce of the shard once more (a reduce-scatter, then an all-gather of the sums)
        passes = 2 if "hybrid" in layout else 1
        quantizing += passes * probe.get("stochastic_quantize_per_element", probe["quantize_per_element"]) * psi
    if layout != "ddp":  # lzero's tiny collectives over every rank
        checks = 2 * probe.get("blocks", 4) if layout.startswith("zero3") else 0  # a unit-order check per gather
        t += (checks + 1) * probe["small_world_collective"]  # + the end-of-backward flag exchange
    # lzero's own stage-3 work, hidden while the link is busier. The probe's stage-2 figure is not used: at world size
    # 1 it measured more than stage 3's (115-164 ms against 52-64), which a stage-2 step at world size 4, a quarter of
    # the optimizer and no gathers in forward or backward, does not show (zero2 is 0.16 s at 10 Gbit/s in all)
    link, cpu = 0.0, quantizing + (probe["stage3_overhead"] if layout.startswith("zero3") else 0.0)
    for level, kind, nbytes, ranks in collectives(layout, psi, 4.0, n, g):
        steps, moved = _ring(kind, nbytes, ranks)
        if level == "intra":
            t += steps * cluster.intra.alpha + moved * cluster.intra.beta
            continue
        on_link, net = (moved * g if ranks < n else moved), cluster.inter  # replica all-reduce: G pairs share the link
        if kind != "all_reduce" and ranks == n:
            # lzero's gloo collectives and gloo's all-to-all are pairwise (collectives.py): every rank sends each peer
            # its slice at once, so a node's link carries G x (N - G)/N of the buffer each way (a ring: (N - 1)/N)
            steps, on_link = 1.0, nbytes * g * (n - g) / n
            if cluster.flat is not None and kind != "all_to_all":  # lzero's own, measured as such by the probe
                net = cluster.flat
        link += steps * net.alpha + on_link * net.beta
        cpu += moved * cluster.intra.beta  # what this rank sends
    return t + max(link, cpu)


def validate(results: Path, probes: Path) -> str:
    rows, fitted = json.loads(results.read_text()), json.loads(probes.read_text())
    lines = ["| link | layout | measured s/step | predicted | error |", "|---|---|---|---|---|"]
    worst = 0.0
    for row in rows:
        probe = fitted[row["rate"]]
        cluster = fit(probe)
        predicted = predict_cpu(row["layout"], probe, cluster)
        error = predicted / row["step_s"] - 1
        worst = max(worst, abs(error))
        lines.append(f"| {row['rate']} | {row['layout']} | {row['step_s']:.3f} | {predicted:.3f} | {error:+.0%} |")
    fits = [f"{rate}: intra alpha {c.intra.alpha * 1e6:.0f} us, beta {1 / c.intra.beta / 1e9:.2f} GB/s;"
            f" inter alpha {c.inter.alpha * 1e6:.0f} us, beta {1 / c.inter.beta / 1e9:.3f} GB/s;"
            + (f" lzero's all-gather over all ranks alpha {c.flat.alpha * 1e6:.0f} us, beta"
               f" {1 / c.flat.beta / 1e9:.3f} GB/s of link bytes;" if c.flat else "") +
            f" compute {p['compute'] * 1e3:.1f} ms, AdamW {1 / p['adam_per_element'] / 1e6:.0f} M elements/s,"
            f" int8 quantize+dequantize {1 / p['quantize_per_element'] / 1e6:.0f} M elements/s, an 8-byte collective"
            f" over all ranks {p['small_world_collective'] * 1e3:.1f} ms, engine work at stage 2"
            f" {p.get('stage2_overhead', 0) * 1e3:.0f} ms and at stage 3 {p['stage3_overhead'] * 1e3:.0f} ms per step"
            for rate, p, c in ((rate, p, fit(p)) for rate, p in fitted.items())]
    return "\n".join(["Fitted (cluster_probe.py, all 4 ranks at once):", *[f"- {f}" for f in fits], "", *lines, "",
                      f"Worst error: {worst:.0%}."]) + "\n"


# --- GPU clusters ----------------------------------------------------------------------------------------------

LARGE = {"7B": 6.7e9, "70B": 69e9}
GPU = dict(flops=989e12, mfu=0.4, hbm=3.35e12, memory=80e9)  # H100-like, as benchmarks.cluster.scale_model
NVLINK = Level(alpha=5e-6, beta=1 / 450e9)
LINKS = {"400G": Level(alpha=10e-6, beta=1 / 50e9), "100G": Level(alpha=10e-6, beta=1 / 12.5e9)}
GPU_LAYOUTS = ("ddp", "zero3", "zero3_hybrid", "zero3_hpz", "zero3_qwz_qgz4", "zero2_hybrid")
"""In order of preference where step times tie (within 2%): fewer and exact collectives first."""


def gpu_step(layout: str, psi: float, n: int, link: Level, tokens: int, per_node: int = 8) -> float:
    """Seconds per step of one GPU: compute from FLOPs, the optimizer's memory traffic, and the communication beyond
    what hides behind compute (bf16: 2 bytes per element on the wire)."""
    compute = 6 * psi * tokens / (GPU["flops"] * GPU["mfu"])
    stepped = psi if layout == "ddp" else psi / (per_node if "hybrid" in layout else n)
    optimizer = 16 * stepped / GPU["hbm"]
    comm = communication(layout, psi, 2.0, n, Cluster(NVLINK, link, per_node))
    return compute + optimizer + max(0.0, comm - compute)


def gpu_memory(layout: str, psi: float, n: int, per_node: int = 8) -> float:
    """Model states per GPU (bf16-mixed AdamW) from lzero's estimator."""
    from lzero.memory.estimate import ModelCount, estimate

    count = ModelCount(int(psi), 0)
    name = "zero3" if layout.startswith("zero3") else "zero2" if layout.startswith("zero2") else "ddp"
    options = {"shard_group_size": per_node} if "hybrid" in layout else {}
    if layout == "zero3_hpz":
        options = {"hpz_partition_size": per_node}
    rows = estimate(count, per_node, n // per_node, strategies=[name], **options)
    return next(r.per_device for r in rows if r.strategy == (layout if layout == "zero3_hpz" else name))


def table(global_tokens: int = 2**22) -> str:
    lines = [f"A global batch of {global_tokens:,} tokens split over the GPUs (fewer per GPU as N grows), bf16 on the"
             f" wire, H100-like ({GPU['flops'] / 1e12:.0f} TFLOP/s at MFU {GPU['mfu']}, 80 GB), 8 GPUs per node on"
             " NVLink (450 GB/s, 5 us); between nodes one NIC per GPU at 400 or 100 Gbit/s (10 us). Communication hides"
             " behind compute; what exceeds it is exposed. Seconds per step; ✗: model states over 90% of 80 GB"
             " (lzero's estimator). Recommended: the fastest that fits; within 2% of it, the first in column order.",
             ""]
    for name, psi in LARGE.items():
        for link_name, link in LINKS.items():
            lines += [f"**{name}, {link_name} between nodes**", "",
                      "| GPUs | " + " | ".join(GPU_LAYOUTS) + " | recommended |", "|---" * (len(GPU_LAYOUTS) + 2) + "|"]
            for n in (16, 32, 64, 128, 256, 512, 1024):
                tokens = global_tokens // n
                cells, fits = [], []
                for layout in GPU_LAYOUTS:
                    t = gpu_step(layout, psi, n, link, tokens)
                    ok = gpu_memory(layout, psi, n) <= 0.9 * GPU["memory"]
                    cells.append(f"{t:.3f}" + ("" if ok else " ✗"))
                    if ok:
                        fits.append((t, layout))
                fastest = min(t for t, _ in fits) if fits else None
                best = next((lay for t, lay in fits if t <= 1.02 * fastest), "none") if fits else "none"
                lines.append(f"| {n} | " + " | ".join(cells) + f" | {best} |")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validate", help="bench_cluster's JSON of step times, or 'latest' (the newest in"
                        " results/cluster/)")
    parser.add_argument("--probes", type=Path, help="bench_cluster --probe's .probe.json (default: beside it)")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--global-tokens", type=int, default=2**22)
    parser.add_argument("--out", default=None, help="markdown file, a result name, or - for stdout (default:"
                        " results/cluster/two_level.<machine>.<date>.md)")
    args = parser.parse_args()
    if args.validate == "latest":
        args.validate = latest_result("cluster", "cluster", "json")
        if args.validate is None:
            parser.error("--validate latest: no results/cluster/cluster.*.json (run benchmarks.cluster.bench_cluster)")
    args.validate = Path(args.validate) if args.validate else None
    parts = ["# The two-level scale model (benchmarks.cluster.two_level)\n", run_header() + "\n"]
    if args.validate:
        parts.append(f"## Against the simulated cluster (`two_level --validate {args.validate.name}`)\n")
        parts.append(validate(args.validate, args.probes or args.validate.with_suffix(".probe.json")))
    if args.table:
        parts.append(f"## 7B and 70B on GPU clusters (`two_level --table --global-tokens {args.global_tokens}`)\n")
        parts.append(table(args.global_tokens))
    text = "\n".join(parts) + "\n"
    print(text)
    if args.out != "-":
        write_report(out_path(args.out, "cluster", "two_level"), text)


if __name__ == "__main__":
    main()
