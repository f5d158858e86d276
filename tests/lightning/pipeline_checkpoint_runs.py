"""Checkpoints of pipeline runs: saved at pp2 x dp2, resumed at other (pipeline, data) sizes.

    python tests/lightning/pipeline_checkpoint_runs.py OUT_DIR LLAMA_DIR PHASE   # launched with WORLD_SIZE ranks

PHASE ``save`` (world 4): the uninterrupted runs, pp2 x dp2 (1F1B, 4 micro-batches of 1) at zero1/zero2/zero3 for the
tiny Llama and the demo GPT (its head tied to the embedding), 2 epochs of 2 steps, a ModelCheckpoint directory after
each epoch; rank 0 writes ``OUT_DIR/<run>.pt`` with each step's loss and the whole parameters at the end. PHASE
``resume:<pp>`` resumes each epoch-0 checkpoint at ``pipeline_parallel_size=pp`` over the launched world and trains
epoch 1; rank 0 writes ``OUT_DIR/<run>_at_pp<pp>dp<dp>.pt``. Every layout trains on the same global batches of 8 (a
data rank's batch is 8 / dp). tests/lightning/test_pipeline.py compares them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy
from pipeline_runs import GPT, Module, Record, dataset

GLOBAL_BATCH, SAMPLES, EPOCHS = 8, 16, 2  # 2 steps per epoch
STAGES = (1, 2, 3)


def whole(trainer: Trainer, module: Module) -> dict[str, torch.Tensor]:
    """Every parameter, from the stage holding it (a tied one under each stage's name)."""
    with trainer.strategy.gathered_parameters(module.model):
        mine = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: value for params in everyone for name, value in params.items()}


def fit(out: Path, stage: int, pp: int, world: int, llama: Any, ckpt_path: Any = None, checkpoints: Any = None
        ) -> tuple[Module, Trainer, Record]:
    module, record = Module(llama), Record()
    callbacks: list[Any] = [record]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, every_n_epochs=1, filename="{epoch}"))
    pipeline = {"pipeline_parallel_size": pp, "pipeline_microbatches": 4} if pp > 1 else {}
    trainer = Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=stage, **pipeline),
                      max_epochs=EPOCHS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      gradient_clip_val=0.5, enable_checkpointing=checkpoints is not None, callbacks=callbacks,
                      default_root_dir=out)
    data = DataLoader(Subset(dataset(), range(SAMPLES)), batch_size=GLOBAL_BATCH // (world // pp))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer, record


if __name__ == "__main__":
    out, llama_dir, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    for stage in STAGES:
        for tag, llama in (("llama", llama_dir), ("gpt", GPT)):
            name = f"{tag}_zero{stage}"
            if phase == "save":
                module, trainer, record = fit(out, stage, 2, world, llama, checkpoints=out / name)
            else:
                pp = int(phase.split(":")[1])
                module, trainer, record = fit(out, stage, pp, world, llama, ckpt_path=out / name / "epoch=0.ckpt")
            params = whole(trainer, module)
            if trainer.is_global_zero:
                suffix = "" if phase == "save" else f"_at_pp{pp}dp{world // pp}"
                torch.save({"losses": record.losses, "params": params}, out / f"{name}{suffix}.pt")
    if dist.is_initialized():
        destroy_process_group()
