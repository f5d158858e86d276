"""NVMe offload beyond host memory: a GPT whose training state (16 bytes per parameter) is at least twice the
peak RSS of each training process trains under ``zero3_offload_nvme``, and its losses equal ``zero3``'s; the
swap-file throughput of its steps against a raw ``O_DIRECT`` sequential write and read of the same bytes in
the same folder, in the same run.

    python -m benchmarks.offload.bench_nvme_offload --nvme-path /path/on/a/fast/disk
    # writes results/offload/nvme_offload.<machine>.<date>.md

Each strategy runs in a fresh pair of processes (2 CPU ranks, gloo, fp32, AdamW with ``fused=True`` so the
host step and the device step run the same kernel). Peak RSS is each process's VmHWM at the end of fit
(reset after the imports, as bench_step_time does). The NVMe run keeps parameter shards in files too
(``offload_param.max_in_cpu: 0``). Swap-file throughput: bytes each rank's swap files moved during the timed
steps over the wall time with at least one request of that direction in flight (``SwapFiles`` counters).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (REPO, module_command, module_env, out_path, peak_rss_mb, publish, reset_peak_rss,
                               run_header)

SHAPE = dict(n_layer=12, n_head=16, n_embd=1280, block_size=64)
SMALL = dict(n_layer=2, n_head=2, n_embd=64, block_size=32)  # --small: a seconds-long smoke test


def run(args: argparse.Namespace) -> None:
    """One strategy, launched by Lightning on 2 ranks; rank 0 writes ``args.json``."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule

    class FusedGPT(DemoGPT):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = super().configure_optimizers()
            return torch.optim.AdamW(opt.param_groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas), fused=True)

    class Probe(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []
            self.io: dict[str, float] = {}

        def _files(self, trainer):  # type: ignore[no-untyped-def]
            stores = [s for s in trainer.strategy.engine.stores if hasattr(s, "files")]
            return stores[0].files if stores else None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            self._start = time.perf_counter()
            files = self._files(trainer)
            if trainer.global_step == args.warmup and files is not None:
                self._io0 = (files.bytes_read, files.bytes_written, files.read_seconds, files.write_seconds)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"]))
            files = self._files(trainer)
            if files is not None and trainer.global_step == args.steps:
                read, written, rs, ws = (a - b for a, b in zip(
                    (files.bytes_read, files.bytes_written, files.read_seconds, files.write_seconds), self._io0))
                self.io = {"read_bytes": read, "written_bytes": written, "read_s": rs, "write_s": ws,
                           "folder": str(files.folder), "direct": files.direct, "steps": args.steps - args.warmup}

    seed_everything(0, verbose=False)
    model = FusedGPT(vocab_size=256, **SHAPE, dropout=0.0)
    data = TextDataModule(block_size=SHAPE["block_size"], batch_size=2, steps_per_epoch=args.steps)
    if args.strategy == "zero3":
        strategy = ZeroStrategy(stage=3)
    else:
        block = {"device": "nvme", "nvme_path": args.nvme_path}
        strategy = ZeroStrategy(stage=3, offload_optimizer=block, offload_param={**block, "max_in_cpu": 0})
    probe = Probe()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=args.steps,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe], enable_checkpointing=False,
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    reset_peak_rss()
    trainer.fit(model, datamodule=data)
    rss = [0.0] * dist.get_world_size()
    dist.all_gather_object(rss, peak_rss_mb())
    ios: list = [None] * dist.get_world_size()
    dist.all_gather_object(ios, probe.io)
    if trainer.is_global_zero:
        psi = sum(p.numel() for p in model.parameters())
        Path(args.json).write_text(json.dumps({"strategy": args.strategy, "psi": psi, "losses": probe.losses,
                                               "times": probe.times, "peak_rss_mb": rss, "io": ios}))


def raw_pair(folder: str, nbytes: int, env: dict):  # -> lzero.offload.nvme.RawThroughput
    """The raw O_DIRECT reference as the run saw the disk: two processes (one per rank) each writing then reading
    ``nbytes`` of their own file in ``folder`` at the same time (1 MiB requests, 1 thread each, as the run's aio
    settings); the mean of the two."""
    from lzero.offload.nvme_checks import RawThroughput

    code = ("import json, sys; from lzero.offload.nvme_checks import raw_throughput;"
            f" r = raw_throughput({folder!r} + '/raw' + sys.argv[1], {nbytes}, block_size=1 << 20, threads=1);"
            " print(json.dumps([r.write_gbps, r.read_gbps, r.direct]))")
    for rank in (0, 1):
        Path(folder, f"raw{rank}").mkdir(exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], stdout=subprocess.PIPE, text=True, env=env)
             for rank in (0, 1)]
    found = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    for rank in (0, 1):
        Path(folder, f"raw{rank}").rmdir()
    return RawThroughput(sum(f[0] for f in found) / 2, sum(f[1] for f in found) / 2, nbytes, all(f[2] for f in found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", default=None, help="swap folder (default: a folder on the work disk)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/offload/nvme_offload.<machine>.<date>.md; none with --small)")
    parser.add_argument("--small", action="store_true", help="tiny model, for a smoke test")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.small:
        SHAPE.update(SMALL)
    if args.run:
        run(args)
        return
    args.out = out_path("none" if args.out is None and args.small else args.out, "offload", "nvme_offload")
    nvme_path = args.nvme_path or str(REPO / ".bench_nvme")
    Path(nvme_path).mkdir(parents=True, exist_ok=True)
    results = {}
    env = module_env()
    for strategy in ("zero3_offload_nvme", "zero3"):
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = module_command(__spec__.name, "--run", "1", "--strategy", strategy, "--json", out, "--nvme-path",
                             nvme_path, "--steps", args.steps, "--warmup", args.warmup,
                             *(["--small"] if args.small else []))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{strategy} failed:\n{proc.stderr[-4000:]}")
        results[strategy] = json.loads(out.read_text())
        print(strategy, results[strategy]["peak_rss_mb"], flush=True)
    nvme, plain = results["zero3_offload_nvme"], results["zero3"]
    io = nvme["io"]
    per_rank = max(max(i["read_bytes"], i["written_bytes"]) for i in io)
    raw = raw_pair(nvme_path, int(per_rank // nvme["io"][0]["steps"]), env)
    psi = nvme["psi"]
    state = 16 * psi
    lines = [
        run_header(),
        "",
        f"DemoGPT {psi:,} parameters ({SHAPE}), fp32, AdamW (fused), 2 CPU ranks x 1 thread, batch 2 x"
        f" {SHAPE['block_size']} tokens per rank, {args.steps} steps; swap folder on `{nvme_path}`"
        f" (O_DIRECT: {io[0]['direct']}).",
        "",
        f"`python -m {__spec__.name}{' --nvme-path ' + args.nvme_path if args.nvme_path else ''}`",
        "",
        "| strategy | peak RSS per rank (MB) | full training state 16Ψ (MB) / peak RSS | s/step (after warmup) | losses |",
        "|---|---|---|---|---|",
    ]
    for name, res in (("zero3_offload_nvme", nvme), ("zero3", plain)):
        rss = res["peak_rss_mb"]
        ratio = state / 1e6 / max(rss)
        step = sum(res["times"][args.warmup:]) / max(1, len(res["times"][args.warmup:]))
        lines.append(f"| {name} | {' / '.join(f'{r:,.0f}' for r in rss)} | {state / 1e6:,.0f} / {max(rss):,.0f} ="
                     f" {ratio:.2f}x | {step:.2f} | {', '.join(f'{x:.6f}' for x in res['losses'])} |")
    same = nvme["losses"] == plain["losses"]
    lines += ["", f"Losses equal step by step: {same}.", "",
              "| rank | swap reads per step (MB) | read GB/s | swap writes per step (MB) | write GB/s |"
              " raw O_DIRECT read / write GB/s (same bytes per process, same folder, both processes at once)"
              " | read ratio | write ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for rank, i in enumerate(io):
        rgb = i["read_bytes"] / i["read_s"] / 1e9 if i["read_s"] else 0.0
        wgb = i["written_bytes"] / i["write_s"] / 1e9 if i["write_s"] else 0.0
        lines.append(f"| {rank} | {i['read_bytes'] / i['steps'] / 1e6:,.0f} | {rgb:.2f} |"
                     f" {i['written_bytes'] / i['steps'] / 1e6:,.0f} | {wgb:.2f} | {raw.read_gbps:.2f} /"
                     f" {raw.write_gbps:.2f} | {rgb / raw.read_gbps:.2f} | {wgb / raw.write_gbps:.2f} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
