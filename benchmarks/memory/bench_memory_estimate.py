"""Measured against estimated model-state memory per rank: the demo GPT at each preset, fp32 and bf16-mixed, on
2 CPU ranks; the measured side is ``lzero.memory.accounting.model_state_bytes`` after a step (what the memory monitor logs),
the estimated side ``lzero.memory.estimate.model_states`` between steps (what ``lzero estimate`` and ``zero_auto`` use).

    python -m benchmarks.memory.bench_memory_estimate   # -> results/memory/memory_estimate.<machine>.<date>.md/.json
    python -m benchmarks.memory.plot_memory_estimate docs/memory.png   # the newest .json of this machine

Lightning re-runs this module for rank 1; rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.common import out_path, run_header, write_report

PRESETS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_nvme")
PRECISIONS = ("32-true", "bf16-mixed")


class Probe(Callback):
    """After the last step: this rank's measured bytes by store and kind, and the formula's."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.found: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step != self.steps:
            return
        from lzero.memory.accounting import model_state_bytes
        from lzero.memory.monitor import _expected

        engine = trainer.strategy.engine
        measured = model_state_bytes(engine, trainer.strategy.optimizers)
        self.found = {"measured": measured, "expected": _expected(engine, trainer.strategy.optimizers),
                      "total": sum(v for kinds in measured.values() for k, v in kinds.items() if k != "buffers")}


def main() -> None:
    import torch.distributed as dist

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule
    from lzero.presets import PRESET_CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file (the JSON beside it), or a result name (default:"
                        " results/memory/memory_estimate.<machine>.<date>.md)")
    out = out_path(parser.parse_args().out, "memory", "memory_estimate")
    torch.set_num_threads(1)
    rows = []
    swap = tempfile.gettempdir()
    for preset in PRESETS:
        for precision in PRECISIONS:
            seed_everything(0, verbose=False)
            model = DemoGPT()  # the demo's shape: 4 layers, width 128, 834,304 parameters
            probe = Probe(steps=3)
            options = dict(PRESET_CONFIGS[preset])
            trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(**options), precision=precision,
                              max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe],
                              logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False)
            trainer.fit(model, datamodule=TextDataModule(batch_size=4, steps_per_epoch=3))
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, probe.found)
            rows.append({"preset": preset, "precision": precision, "ranks": found,
                         "psi": sum(p.numel() for p in model.parameters())})
    if not trainer.is_global_zero:
        return
    write_report(out.with_suffix(".json"), json.dumps(rows, indent=1))
    lines = [run_header(), "",
             f"Demo GPT ({rows[0]['psi']:,} parameters), 2 CPU ranks, AdamW, after 3 steps (between steps: no"
             f" gradient); swap files under {swap}. `python -m benchmarks.memory.bench_memory_estimate`", "",
             "| preset | precision | measured per rank (bytes: device / cpu / nvme) | estimated | measured / estimated |",
             "|---|---|---|---|---|"]
    for row in rows:
        for rank, r in enumerate(row["ranks"]):
            split = " / ".join(f"{sum(v for k, v in r['measured'].get(s, {}).items() if k != 'buffers'):,}"
                               for s in ("device", "cpu", "nvme"))
            lines.append(f"| {row['preset']} | {row['precision']} | rank {rank}: {split} | {r['expected']:,.0f} |"
                         f" {r['total'] / r['expected']:.5f} |")
    table = "\n".join(lines) + "\n"
    write_report(out, table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
