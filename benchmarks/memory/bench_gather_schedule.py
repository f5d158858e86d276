"""Stage 3's gather schedule (DeepSpeed's stage3_* knobs, [Note: stage-3 gather schedule] in lzero/engine/gather.py):
what each setting costs in parameter all-gathers and gathered memory, and that none changes the result.

The demo GPT (n_layer 8, n_head 4, n_embd 256, vocab 256, block_size 128: 8 block units of 789,760 elements, a
unit of the position embedding (32,768; ``nn.Embedding`` repeats, so it is a unit class) and the root: the tied
token embedding and the final LayerNorm, 66,048), batch 8, fp32, AdamW, through ``ZeroEngine`` at stage 3 on 2 gloo processes. Per row: 2
warm-up steps (the first records the unit order), then 4 measured steps. Columns, per rank and step:

* gathers: unit all-gathers launched (a prefetch counts where it is launched);
* gathered MB: bytes received by parameter all-gathers (``collectives.TRAFFIC``), gathers after the optimizer
  step included;
* peak live: the most parameter elements gathered at once (sampled after every gather and launch), in MB of fp32;
* step ms: the median step time (2 CPU cores shared by both ranks: a rough figure);
* loss: the last measured loss, and whether every rank's parameters after the run equal the default row's
  bitwise.

    python -m benchmarks.memory.bench_gather_schedule [--out none]
    # default: results/memory/gather_schedule.<machine>.<date>.md
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import out_path, run_header, write_report

SHAPE = dict(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=256, dropout=0.0)
BATCH, WARM, STEPS = 8, 2, 4
H = SHAPE["n_embd"]
ROWS = {  # name -> ZeroConfig's gather-schedule fields
    "default (prefetch 1)": {},
    "prefetch 0": {"prefetch": 0},
    "prefetch 2": {"prefetch": 2},
    "prefetch_bucket_size 1.5M (two units ahead)": {"prefetch_bucket_size": 1_500_000},
    "DeepSpeed's defaults (5e7, 1e5, 1e9, 1e9)": {"prefetch_bucket_size": 50_000_000, "param_persistence_threshold":
                                                   100_000, "max_live_parameters": 10**9, "max_reuse_distance": 10**9},
    "Hugging Face auto (h=256) + 1e9, 1e9": {"prefetch_bucket_size": int(0.9 * H * H), "param_persistence_threshold":
                                             10 * H, "max_live_parameters": 10**9, "max_reuse_distance": 10**9},
    "max_reuse_distance 2M (last 2 units kept)": {"max_reuse_distance": 2_000_000},
    "max_reuse_distance 1e9, max_live 3M (3 kept)": {"max_reuse_distance": 10**9, "max_live_parameters": 3_000_000},
    "param_persistence_threshold 1M (every unit)": {"param_persistence_threshold": 1_000_000},
}


def run(rank: int, world: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
    from lzero.engine import collectives
    from lzero.demo.model import GPT, GPTConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
    results = {}
    for name, knobs in ROWS.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SHAPE))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, **knobs))
        zopt = ZeroOptimizer(opt, engine, 0)
        gatherer = engine.gatherer
        counts = {"gathers": 0, "peak": 0}
        launch = gatherer.launch

        def counted(block: str, launch=launch, gatherer=gatherer, counts=counts) -> None:  # type: ignore[no-untyped-def]
            before = gatherer.blocks[block].state.name
            launch(block)
            counts["gathers"] += before == "RELEASED"
            counts["peak"] = max(counts["peak"], gatherer.live_numel())

        gatherer.launch = counted
        times, loss = [], None
        for step in range(WARM + STEPS):
            if step == WARM:
                counts.update(gathers=0, peak=0)
                traffic = collectives.TRAFFIC["all_gather"]
            dist.barrier()
            start = time.perf_counter()
            engine.gather_root()
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            zopt.step()
            zopt.zero_grad()
            times.append(time.perf_counter() - start)
        results[name] = {"gathers": counts["gathers"] / STEPS, "peak": counts["peak"],
                         "bytes": (collectives.TRAFFIC["all_gather"] - traffic) / STEPS,
                         "ms": 1e3 * statistics.median(times[WARM:]), "loss": float(loss)}
        engine.unshard()  # gathers every unit once more: after the counts
        results[name]["params"] = torch.cat([p.detach().flatten() for p in model.parameters()])
        engine.remove()
    first = next(iter(results.values()))["params"]
    for r in results.values():
        r["equal"] = bool(torch.equal(r.pop("params"), first))
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/memory/gather_schedule.<machine>.<date>.md)")
    args = parser.parse_args()
    args.out = out_path(args.out, "memory", "gather_schedule")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    lines = [run_header(), "", "`python -m benchmarks.memory.bench_gather_schedule`: gloo, world size 2. Per rank and"
             " step (rank 0; rank 1 equal in every count).", "",
             "| schedule | gathers | gathered MB | peak live MB | step ms | last loss | parameters equal to default |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name in ROWS:
        r, other = by_rank[0][name], by_rank[1][name]
        assert (r["gathers"], r["peak"], r["bytes"]) == (other["gathers"], other["peak"], other["bytes"]), name
        lines.append(f"| {name} | {r['gathers']:g} | {r['bytes'] / 1e6:.1f} | {4 * r['peak'] / 1e6:.1f} |"
                     f" {r['ms']:.0f} | {r['loss']:.6f} | {'yes' if r['equal'] and other['equal'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        write_report(args.out, "# Stage-3 gather schedule\n\n" + __doc__.split("\n\n", 1)[1].split("    python")[0]
                     + "\n" + text)


if __name__ == "__main__":
    sys.exit(main())
