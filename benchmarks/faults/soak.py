"""Soak: the demo GPT for thousands of steps at world size 2 with periodic saves, SIGKILLs and resumes (by hand).

    python -m benchmarks.faults.soak --strategy zero3_offload --steps 3000
    python -m benchmarks.faults.soak --strategy zero3_offload_nvme --steps 3000 --swap /var/tmp/lzero-soak

One run: a sharded checkpoint every ``--every`` steps (``last.ckpt``), and every ``--kill-every`` steps rank 1
SIGKILLs itself half-way between two checkpoints; the driver then starts the run again from ``last``, until
``--steps``. Each rank reports, every ``--every`` steps: resident memory, open file descriptors, threads, the
bytes under the NVMe swap folder; rank 0 logs every step's loss.

Data follows the global step (each rank's batch is drawn from a generator seeded by step and rank), so a resumed
step trains on the batch the killed run trained on at that step: its loss must equal the killed run's, bitwise,
for every step replayed between the checkpoint and the kill (the loss curve is continuous across resumes).

It writes ``results/faults/soak_<strategy>.<machine>.<date>.md`` (or ``--report``): the trend of each measure after
warm-up, within each segment (from a start to the next kill) and over the whole run, the replayed losses, and what
is left on disk at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.common import module_command, module_env, out_path, proc_status, run_header, write_report

SHAPE = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
BATCH = 4


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Soak(Callback):
    """Per-rank measures every ``every`` steps, rank 0's loss every step, and the planned SIGKILL of rank 1."""

    def __init__(self, out: Path, every: int, kill_at: int, swap: Path | None) -> None:
        self.out, self.every, self.kill_at, self.swap = out, every, kill_at, swap

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, rank = trainer.global_step, trainer.global_rank  # global_step counts the step just taken
        if rank == 0:
            with open(self.out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(outputs["loss"]), "pid": os.getpid()}) + "\n")
        if step % self.every == 0:
            row = {"step": step, "rank": rank, "pid": os.getpid(), "rss_kb": proc_status("VmRSS"),
                   "fds": len(os.listdir("/proc/self/fd")), "threads": proc_status("Threads"),
                   "py_threads": threading.active_count(),
                   "swap_bytes": _folder_bytes(self.swap) if self.swap else 0}
            with open(self.out / f"measures_rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if rank == 1 and step == self.kill_at:
            (self.out / "killed_at").write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)


def worker(args: argparse.Namespace) -> None:
    import lzero
    from lzero.demo import DemoGPT

    class StepData(DemoGPT):
        def training_step(self, batch, batch_idx):  # the batch follows the global step, not the loader
            g = torch.Generator().manual_seed(1000 * self.trainer.global_step + self.global_rank)
            tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"] + 1), generator=g)
            return self._loss((tokens[:, :-1], tokens[:, 1:]))

    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    out = Path(args.out)
    strategy = args.strategy
    swap = None
    if strategy.endswith("_nvme"):
        swap = Path(args.swap)
        nvme = {"device": "nvme", "nvme_path": str(swap)}
        strategy = lzero.ZeroStrategy(stage=3, offload_optimizer=nvme, offload_param=nvme)
    last = out / "ckpt" / "last.ckpt"
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, use_distributed_sampler=False,
                      callbacks=[ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.every, save_last=True,
                                                 save_top_k=1),
                                 Soak(out, args.every, args.kill_at, swap)])
    loader = DataLoader(range(args.steps + 1), batch_size=1)  # one item per step; training_step makes the data
    trainer.fit(StepData(**SHAPE), loader, ckpt_path=str(last) if last.exists() else None)


def drive(args: argparse.Namespace) -> None:
    out = Path(args.out or f"/tmp/lzero-soak-{args.strategy}")
    if out.exists():
        raise SystemExit(f"{out} exists: give a fresh --out")
    out.mkdir(parents=True)
    swap = Path(args.swap or out / "swap")
    kills = list(range(args.kill_every + args.every // 2, args.steps, args.kill_every))
    segments = []
    for kill_at in [*kills, -1]:
        start = time.time()
        cmd = module_command(__spec__.name, "--worker", "--strategy", args.strategy, "--steps", args.steps,
                             "--every", args.every, "--kill-at", kill_at, "--out", out, "--swap", swap)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=module_env())
        segments.append({"kill_at": kill_at, "rc": proc.returncode, "seconds": time.time() - start})
        print(f"segment until {kill_at if kill_at > 0 else 'the end'}: exit {proc.returncode},"
              f" {time.time() - start:.0f} s", flush=True)
        if kill_at < 0 and proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit("the last segment failed")
    (out / "segments.json").write_text(json.dumps(segments))
    report = summarize(out, swap, args, segments)
    print(report)
    target = out_path(args.report, "faults", f"soak_{args.strategy}")
    if target is not None:
        write_report(target, report)


def _trend(rows: list[dict], key: str, warmup: int) -> tuple[float, float, float]:
    """(first, last, change) of ``key`` over ``rows`` after ``warmup`` steps."""
    kept = [r for r in rows if r["step"] > warmup] or rows
    first, last = kept[0][key], kept[-1][key]
    return first, last, (last - first) / first if first else 0.0


def summarize(out: Path, swap: Path, args: argparse.Namespace, segments: list[dict]) -> str:
    losses = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    by_step: dict[int, list[float]] = {}
    for row in losses:
        by_step.setdefault(row["step"], []).append(row["loss"])
    replayed = {s: v for s, v in by_step.items() if len(v) > 1}
    mismatched = {s: v for s, v in replayed.items() if len(set(v)) > 1}
    lines = [run_header(), "",
             f"Soak, {args.strategy}: demo GPT {SHAPE}, batch {BATCH} per rank, world size 2 (CPU, gloo),"
             f" {args.steps} steps, a sharded checkpoint every {args.every} steps, rank 1 SIGKILLed at steps"
             f" {[s['kill_at'] for s in segments if s['kill_at'] > 0]} and the run resumed from `last` each time;"
             f" {sum(s['seconds'] for s in segments):.0f} s in all.", "",
             "| rank | segment | steps | RSS MB first / last (change) | fds first / last | threads first / last |"
             " swap folder MB first / last |", "|---|---|---|---|---|---|---|"]
    warmup = 200
    for rank in (0, 1):
        rows = [json.loads(line) for line in (out / f"measures_rank{rank}.jsonl").read_text().splitlines()]
        pids = list(dict.fromkeys(r["pid"] for r in rows))
        for i, pid in enumerate(pids):
            seg = [r for r in rows if r["pid"] == pid]
            start = seg[0]["step"]
            rss = _trend(seg, "rss_kb", start + warmup)
            fds = _trend(seg, "fds", start + warmup)
            thr = _trend(seg, "threads", start + warmup)
            sw = _trend(seg, "swap_bytes", start + warmup)
            lines.append(f"| {rank} | {i + 1} | {start}-{seg[-1]['step']} | {rss[0] / 1024:.0f} / {rss[1] / 1024:.0f}"
                         f" ({rss[2]:+.1%}) | {fds[0]:.0f} / {fds[1]:.0f} | {thr[0]:.0f} / {thr[1]:.0f} |"
                         f" {sw[0] / 1e6:.1f} / {sw[1] / 1e6:.1f} |")
    left = sorted(str(p.relative_to(swap)) for p in swap.rglob("*")) if swap.exists() else []
    lines += ["", f"Replayed steps (trained before a kill and again after the resume): {len(replayed)};"
              f" losses differing: {len(mismatched)}" + (f" (e.g. {list(mismatched.items())[:3]})" if mismatched else
                                                          " (every replayed step's loss is bitwise the killed run's)."),
              f"Left under the swap folder after the last exit: {left if left else 'nothing'}.",
              f"Checkpoint folder at the end: {sorted(p.name for p in (out / 'ckpt').iterdir())},"
              f" {_folder_bytes(out / 'ckpt') / 1e6:.1f} MB."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zero3_offload")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--kill-every", type=int, default=500)
    parser.add_argument("--out", default=None, help="the run's working folder (default /tmp/lzero-soak-STRATEGY)")
    parser.add_argument("--report", default=None, help="markdown file, a result name, or none (default:"
                        " results/faults/soak_<strategy>.<machine>.<date>.md)")
    parser.add_argument("--swap", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
