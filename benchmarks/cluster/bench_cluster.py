"""Two "nodes" on one machine, for hybrid sharding (issue 37): two network namespaces joined by a veth pair whose
link is shaped with `tc tbf`, torchrun with `--nnodes 2` and 2 processes in each. Inside a namespace the ranks talk
over its own loopback (local addresses are routed through `lo`); between namespaces everything crosses the shaped
link. Run as root (it creates and deletes the namespaces; everything is torn down at exit, after a failure too):

    .venv/bin/python -m benchmarks.cluster.bench_cluster --rates 1gbit 10gbit   # from the repository root

Writes results/cluster/cluster.<machine>.<date>.md, its rows as .json and, with --probe, the probe as .probe.json
beside it (what benchmarks.cluster.two_level fits). Not part of CI. Each layout: benchmarks.cluster.cluster_step,
4 ranks, the median step after warm-up and the bytes the link carried.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import module_env, out_path, run_header, write_report

NODES = [("lzbench0", "lzb0", "10.77.0.1"), ("lzbench1", "lzb1", "10.77.0.2")]  # namespace, veth end, address
LAYOUTS = ["ddp", "zero2", "zero2_hybrid", "zero3", "zero3_hybrid", "zero3_hybrid_min_memory", "zero3_hybrid_reuse",
           "zero3_hpz", "zero3_qwz", "zero3_qwz_qgz8", "zero3_hybrid_qwz_qgz8"]


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if not check else None)


def up(rate: str) -> None:
    down()
    for ns, _, _ in NODES:
        sh("ip", "netns", "add", ns)
    (ns0, if0, ip0), (ns1, if1, ip1) = NODES
    sh("ip", "link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1)
    for ns, dev, ip in NODES:
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
           "1mbit", "latency", "100ms")


def down() -> None:
    for ns, _, _ in NODES:
        sh("ip", "netns", "del", ns, check=False)  # deletes its end of the veth, and so the pair


def run(layout: str, out: Path, steps: int, batch: int, script: str = "cluster_step", attempts: int = 3) -> dict:
    """One layout on the cluster. A rank of the freshly created namespaces sometimes aborts right after the process
    group is set up ("terminate called without an active exception", torch's DDP layout too, about one run in 10-20);
    the other node then waits out torchrun's 300 s exit barrier. So a node that fails ends the other at once, and the
    run is tried again, at most ``attempts`` times; the result records how many it took."""
    for attempt in range(1, attempts + 1):
        procs, logs = [], []
        for node, (ns, dev, _) in enumerate(NODES):
            env = module_env(GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1")
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", NODES[0][2], "--master-port",
                   str(29577 + attempt), "-m", f"benchmarks.cluster.{script}", layout, str(out), "--link", dev,
                   "--steps", str(steps), "--batch", str(batch)]
            log = tempfile.TemporaryFile("a+")  # O_APPEND: the ranks append wherever this process reads
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline, failed = time.monotonic() + 900, False
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not failed:
            time.sleep(0.5)
            # a node whose rank failed reports it, then waits for the other node (torchrun's exit barrier): end both
            failed = any(p.returncode for p in procs) or any("failed (exitcode" in _text(log) for log in logs)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # torchrun and the ranks it started
            p.wait()
        if not failed and not any(p.returncode for p in procs):
            return {**json.loads(out.read_text()), "attempts": attempt}
        text = [_text(log)[-3000:] for log in logs]
        print(f"{layout} failed (attempt {attempt} of {attempts}):\n" + "\n".join(text), file=sys.stderr, flush=True)
    raise RuntimeError(f"{layout} failed {attempts} times")


def _text(log) -> str:
    log.seek(0)
    return log.read()


def combine(results: list[dict]) -> dict:
    """One layout's runs as one row: the run of median step time (its CPU time and bytes with it), and the spread."""
    ordered = sorted(results, key=lambda r: r["step_s"])
    return {**ordered[len(ordered) // 2], "step_s_runs": [r["step_s"] for r in results],
            "retried": sum(r["attempts"] - 1 for r in results)}


def median_probe(probes: list[dict]) -> dict:
    """The probe's rounds as one: every figure the median of its rounds (the collectives size by size)."""
    out = {}
    for key, value in probes[0].items():
        if isinstance(value, list):
            out[key] = [[size, statistics.median(p[key][i][1] for p in probes)] for i, (size, _) in enumerate(value)]
        elif key == "params":
            out[key] = value
        else:
            out[key] = statistics.median(p[key] for p in probes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every layout this many times, interleaved; report the median run of each")
    parser.add_argument("--batch", type=int, default=8, help="rows per rank and step")
    parser.add_argument("--probe", action="store_true",
                        help="also run cluster_probe at each rate, once per round (two_level's fit: the median of the"
                        " rounds), into OUT's .probe.json")
    parser.add_argument("--out", default=None, help="markdown file or a result name (default:"
                        " results/cluster/cluster.<machine>.<date>.md)")
    args = parser.parse_args()
    args.out = out_path(args.out, "cluster", "cluster")
    if args.out is None:
        parser.error("--out none: the rows and the probe are written beside the markdown; give a path")
    rows, probes = [], {}
    try:
        for rate in args.rates:
            up(rate)
            runs: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
            probed = []
            for round_ in range(args.rounds):  # layouts interleaved: a drift of the machine's speed hits them all
                if args.probe:
                    with tempfile.TemporaryDirectory() as folder:
                        probed.append(run("probe", Path(folder) / "probe.json", args.steps, args.batch,
                                          "cluster_probe"))
                    print(rate, f"round {round_ + 1}", "probe", probed[-1], flush=True)
                for layout in args.layouts:
                    with tempfile.TemporaryDirectory() as folder:
                        result = run(layout, Path(folder) / "result.json", args.steps, args.batch)
                    runs[layout].append(result)
                    print(rate, f"round {round_ + 1}", layout, f"{result['step_s']:.3f} s/step",
                          f"{result['link_bytes_per_step'] / 1e6:.1f} MB", flush=True)
            for layout, results in runs.items():
                rows.append((rate, combine(results)))
            if probed:
                probes[rate] = median_probe(probed)
    finally:
        down()
    lines = ["| link | layout | s/step | vs DDP | runs (s/step) | rank 0 CPU s/step | link bytes per step | vs DDP |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in args.rates:
        ddp = next((r for k, r in rows if k == rate and r["layout"] == "ddp"), None)
        for k, r in rows:
            if k != rate:
                continue
            t = f"{r['step_s'] / ddp['step_s']:.2f}x" if ddp else "-"
            b = f"{r['link_bytes_per_step'] / ddp['link_bytes_per_step']:.2f}x" if ddp else "-"
            spread = " ".join(f"{x:.3f}" for x in r["step_s_runs"])
            lines.append(f"| {rate} | {r['layout']} | {r['step_s']:.3f} | {t} | {spread} | {r['cpu_s']:.3f} |"
                         f" {r['link_bytes_per_step'] / 1e6:.1f} MB | {b} |")
    params = rows[0][1]["params"] if rows else 0
    text = (f"# Hybrid sharding on a simulated two-node cluster\n\n{run_header()}\n\n"
            f"`python -m {__spec__.name} {' '.join(sys.argv[1:])}`: 2 network namespaces x 2"
            f" ranks (gloo), the link between them shaped with tc tbf; {params / 1e6:.1f}M fp32 parameters in"
            f" 4 wide linear blocks, {args.batch} rows per rank, AdamW; a run's time is the median of {args.steps} steps after"
            f" 2 of warm-up, and each layout ran {args.rounds} times, the layouts interleaved (the median run is shown)."
            " Link bytes: both directions of the veth, per step. Rank 0 CPU: its process's CPU time per step (user +"
            " system, every thread; the 4 ranks share 2 cores)."
            f" Runs started again after a rank aborted at start-up: {sum(r['retried'] for _, r in rows)}."
            "\n\n" + "\n".join(lines) + "\n")
    write_report(args.out, text)
    write_report(args.out.with_suffix(".json"), json.dumps([{"rate": k, **r} for k, r in rows], indent=1))
    if probes:
        write_report(args.out.with_suffix(".probe.json"), json.dumps(probes, indent=1))
    print(text)


if __name__ == "__main__":
    main()
