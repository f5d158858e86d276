"""The memory monitor at world size 2: a small demo GPT trained a few steps per configuration with a
TensorBoard logger (one launched script; Lightning re-runs it for rank 1).

    python tests/memory/monitor_runs.py OUT_DIR

Each run logs to ``OUT_DIR/<name>/``; tests/memory/test_memory_monitor.py reads the event files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from lzero import ZeroStrategy
from lzero.demo import DemoGPT, TextDataModule
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

RUNS = {f"zero{stage}_{precision}": (stage, precision) for stage in (1, 2, 3) for precision in ("32-true", "bf16-mixed")}


def main(out: Path) -> None:
    for name, (stage, precision) in RUNS.items():
        seed_everything(0, verbose=False)
        model = DemoGPT(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=96)
        data = TextDataModule(block_size=32, batch_size=4, steps_per_epoch=4)
        trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=stage), precision=precision,
                          max_steps=4, log_every_n_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                          logger=TensorBoardLogger(str(out), name=name, version=0), enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    destroy_process_group()
