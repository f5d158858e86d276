"""Stage 3's ``schedule="auto"`` against real memory: the in-step peak each rank reaches under the schedule it chose,
beside the peak it predicted and the budget it was given.

For each preset (zero3, zero3_offload) and each model of ``bench_memory.py`` (the demo GPT, 8 x 512, and its small
2 x 64 shape) a 2-process CPU run first takes the machine's budget (the host's available memory shared by the
ranks, plus each rank's own resident memory), then, on the 8 x 512 model, budgets set from that run's first-two-steps
peak P and the extra bytes E that keeping every block gathered costs: (P + E/2) / (1 - margin), room for about half
of them, and (P + E/10) / (1 - margin), room for few. Each run trains 6 steps; the peak of a step is the process's
VmHWM, reset through /proc/self/clear_refs at the step's start (what the engine measures over the first two steps); the
measured column is the highest of steps 3-6 over both ranks, which must stay within the predicted peak + 5% and
within the budget.

    python -m benchmarks.memory.bench_schedule_auto          # writes results/memory/schedule_auto.<machine>.<date>.md

Lightning launches rank 1 of a run by re-running this module with the same arguments (``--worker``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"8 x 512": dict(n_layer=8, n_head=8, n_embd=512, block_size=128),
          "2 x 64": dict(n_layer=2, n_head=2, n_embd=64, block_size=32)}
PRESETS = ("zero3", "zero3_offload")
STEPS = 6


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, seed_everything

    from benchmarks.common import bench_trainer, reset_peak_rss
    from lzero import ZeroConfig, ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule
    from lzero.engine.schedule import peak_bytes
    from lzero.presets import PRESET_CONFIGS

    torch.set_num_threads(1)

    class Peaks(Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step > 1:  # the first two steps are the engine's own measure
                reset_peak_rss()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step > 2:
                self.peaks.append(peak_bytes(torch.device("cpu")))

        def on_train_end(self, trainer, pl_module) -> None:
            self.record = trainer.strategy.engine.auto_schedule.record

    seed_everything(0, verbose=False)
    shape = MODELS[args.model]
    model = DemoGPT(vocab_size=256, **shape)
    data = TextDataModule(block_size=shape["block_size"], batch_size=4, steps_per_epoch=STEPS)
    strategy = ZeroStrategy(config=ZeroConfig(**PRESET_CONFIGS[args.preset]), memory_budget_bytes=args.budget)
    peaks = Peaks()
    trainer = bench_trainer(strategy, STEPS, [peaks])
    trainer.fit(model, datamodule=data)
    mine = {"record": peaks.record, "peaks": peaks.peaks}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(every))


def run(preset: str, model: str, budget: int | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cmd = [sys.executable, "-m", "benchmarks.memory.bench_schedule_auto", "--worker", "--preset", preset,
               "--model", model, "--out", str(out)] + (["--budget", str(budget)] if budget is not None else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def row(preset: str, model: str, label: str, ranks: list[dict]) -> tuple[str, bool]:
    mb = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    r = ranks[0]["record"]
    predicted = max(x["record"]["predicted_peak_bytes"] for x in ranks)
    budget = min(x["record"]["budget_bytes"] for x in ranks)
    measured = max(max(x["peaks"]) for x in ranks)
    ok = measured <= 1.05 * predicted and measured <= budget
    return (f"| {preset} | {model} | {label} | {mb(budget)} | {r['persistent_blocks']} persistent, {r['kept_blocks']}"
            f" kept of {r['blocks']}; {r['gathers_per_step']} gathers/step (min_memory {r['min_memory_gathers_per_step']})"
            f" | {mb(max(x['record']['measured_peak_bytes'] for x in ranks))} | {mb(predicted)} | {mb(measured)} |"
            f" {measured / predicted:.3f} | {'yes' if ok else '**no**'} |"), ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--preset", default="zero3")
    parser.add_argument("--model", default="8 x 512")
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.common import out_path, publish, run_header

    lines = ["# schedule=\"auto\": predicted and measured in-step peaks", "",
             f"`python -m benchmarks.memory.bench_schedule_auto`. {run_header()} 2 CPU processes x 1 thread, gloo,"
             f" fp32, AdamW, batch 4; {STEPS} steps. Per rank, MiB: the peak of steps 1-2 (VmHWM, what the engine"
             " measures over steps 1-2), the peak it predicts under its choice, and the highest VmHWM of steps 3-6 over both"
             " ranks (reset at each step's start). Budgets below the machine's: (P + E/2) / 0.9 and (P + E/10) / 0.9,"
             " P the peak of steps 1-2 and E the bytes every block kept gathered adds, from the machine-budget run.", "",
             "| preset | model | budget | budget MiB | chosen | steps 1-2 | predicted | measured | measured / predicted"
             " | within predicted + 5% and budget |", "|---|---|---|---|---|---|---|---|---|---|"]
    all_ok = True
    for preset in PRESETS:
        for model in MODELS:
            ranks = run(preset, model, None)
            text, ok = row(preset, model, "machine", ranks)
            lines.append(text)
            all_ok &= ok
            print(text, flush=True)
            if model != "8 x 512":
                continue
            first = max(x["record"]["measured_peak_bytes"] for x in ranks)
            extra = max(x["record"]["predicted_peak_bytes"] - x["record"]["measured_peak_bytes"] for x in ranks)
            for label, share in (("half the blocks' room", 0.5), ("a tenth of it", 0.1)):
                budget = int((first + share * extra) / 0.9)
                text, ok = row(preset, model, label, run(preset, model, budget))
                lines.append(text)
                all_ok &= ok
                print(text, flush=True)
    lines += ["", f"Every row within its predicted peak + 5% and its budget: {'yes' if all_ok else 'no'}."]
    publish(lines, out_path(None, "memory", "schedule_auto"))


if __name__ == "__main__":
    main()
