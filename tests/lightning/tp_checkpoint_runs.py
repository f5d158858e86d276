"""Checkpoints of tensor-parallel runs: saved at tp2 x dp2, resumed at other (tensor, data) sizes.

    python tests/lightning/tp_checkpoint_runs.py OUT_DIR LLAMA_DIR PHASE   # launched with WORLD_SIZE ranks

PHASE ``save`` (world 4): the uninterrupted runs, tp2 x dp2 at zero1/zero2/zero3, 2 epochs of 2 steps each, a
ModelCheckpoint directory after each epoch; rank 0 writes ``OUT_DIR/<run>.pt`` with the losses, the whole
parameters after epoch 0 (gathered) and at the end. PHASE ``resume:<tp>`` resumes each epoch-0 checkpoint at
``tensor_parallel_size=tp`` over the launched world (tp 1: the model is not parallelized) and trains epoch 1; rank 0
writes ``OUT_DIR/<run>_from_tp2dp2_at_tp<tp>dp<dp>.pt``. The micro-batch is 4 / dp, so every layout trains on the same
global batches. tests/lightning/test_tp_checkpoint.py compares them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy
from tensor_parallel_runs import (LLAMA_EPS, CLIP, build, dataset, full_parameters, load_llama, loss_of, optimizer_of,
                                  parallelize, parallelize_llama)

GLOBAL_BATCH, SAMPLES, EPOCHS = 4, 8, 2  # 2 steps per epoch
STAGES = (1, 2, 3)


class Module(LightningModule):
    def __init__(self, llama: Any = None) -> None:
        super().__init__()
        self.llama = llama
        self.model = build() if llama is None else load_llama(llama)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.tensor import DTensor

        if self.trainer.strategy.config.tensor_parallel_size == 1 or any(
                isinstance(p, DTensor) for p in self.model.parameters()):
            return
        tp_mesh = self.device_mesh["tensor_parallel"]
        parallelize_llama(self.model, tp_mesh) if self.llama else parallelize(self.model, tp_mesh)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        loss = loss_of(self.model, *batch)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_of(self.parameters(), LLAMA_EPS if self.llama else 1e-8)


class KeepEpochZero(Callback):
    """The whole parameters at the end of epoch 0, gathered on every rank (a collective)."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if trainer.current_epoch == 0:
            with trainer.strategy.gathered_parameters(module.model):
                self.params = full_parameters(module.model)


def fit(out: Path, strategy: ZeroStrategy, devices: int, dp: int, llama: Any, ckpt_path: Any = None,
        checkpoints: Any = None) -> tuple[Module, Trainer, KeepEpochZero]:
    module, keep = Module(llama), KeepEpochZero()
    callbacks: list[Callback] = [keep]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, every_n_epochs=1, filename="{epoch}"))
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=EPOCHS, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=CLIP,
                      enable_checkpointing=checkpoints is not None, callbacks=callbacks, default_root_dir=out)
    data = DataLoader(Subset(dataset(), range(SAMPLES)), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, trainer, keep


def final(trainer: Trainer, module: Module) -> dict[str, torch.Tensor]:
    with trainer.strategy.gathered_parameters(module.model):
        return full_parameters(module.model)


def run_name(stage: int, llama: Any) -> str:
    return f"{'llama_' if llama else ''}zero{stage}"


if __name__ == "__main__":
    out, llama_dir, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    for stage in STAGES:
        for llama in (None, llama_dir):
            name = run_name(stage, llama)
            if phase == "save":
                module, trainer, keep = fit(out, ZeroStrategy(stage=stage, tensor_parallel_size=2), world, 2, llama,
                                            checkpoints=out / name)
                params = final(trainer, module)
                if dist.get_rank() == 0:
                    torch.save({"losses": module.losses, "epoch0": keep.params, "params": params}, out / f"{name}.pt")
            else:
                tp = int(phase.split(":")[1])
                if llama is not None and tp == 4:
                    continue  # its 2 KV heads do not split over 4 tensor ranks
                module, trainer, _ = fit(out, ZeroStrategy(stage=stage, tensor_parallel_size=tp), world, world // tp,
                                         llama, ckpt_path=out / name / "epoch=0.ckpt")
                params = final(trainer, module)
                if trainer.is_global_zero:
                    torch.save({"losses": module.losses, "params": params},
                               out / f"{name}_from_tp2dp2_at_tp{tp}dp{world // tp}.pt")
    if dist.is_initialized():
        destroy_process_group()
