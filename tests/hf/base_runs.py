"""Checkpoints of LoRA and QLoRA fine-tunes at zero3, world size 2: with the frozen base (``save_frozen=True``) and
without it (the default), and a resume from the one without it.

    python tests/hf/base_runs.py MODELS_DIR OUT_DIR RUN [RUN ...]

RUN is ``MODEL:MODE[:STAGE]`` (STAGE 3 by default; at 1 and 2 the base is whole on every rank, loaded by
transformers). MODEL: ``gpt2`` (LoRA r=4 on GPT-2's ``c_attn``, a Conv1D, in fp32) or ``qlora`` (the tiny
Llama loaded 4-bit NF4 with double quantization and bf16 quant storage, LoRA r=4 on q/v, bf16-true). The model is
built by ``from_pretrained`` in ``configure_model`` (each rank reads its shard of the files), 6 steps, 3 an epoch,
checkpoints every 3 steps in ``OUT_DIR/MODEL-MODE-ckpt/``. MODE: ``whole`` (``save_frozen=True``), ``lean`` (the
default), ``resume`` (from lean's step-3 checkpoint, to step 6), ``touched`` (lean, but ``on_fit_start`` adds 1 to
one frozen base weight, which the checkpoints must then hold). Rank 0 writes ``OUT_DIR/MODEL-MODE.pt``: the losses
and the trainable parameters after fit. ``gpt2:fabric`` runs the LoRA fine-tune through Fabric (``init_module``, 6 steps,
``fabric.save`` after 3 to ``OUT_DIR/gpt2-fabric.ckpt``), then a second model built alike loads that checkpoint and runs
steps 4-6: both runs' losses and adapters. tests/hf/test_frozen_base.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lzero
from lzero.demo.finetune import quantization_config
from lzero.lightning.trainer_strategy import ZeroStrategy
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

TOUCHED = "model.base_model.model.transformer.h.0.mlp.c_fc.weight"  # the frozen weight ``touched`` changes


class FineTune(LightningModule):
    def __init__(self, path: str, model: str, touch: bool) -> None:
        super().__init__()
        self.path, self.kind, self.touch = path, model, touch

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if self.kind == "gpt2":
            base = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
            config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        else:
            base = AutoModelForCausalLM.from_pretrained(self.path, quantization_config=quantization_config("nf4"),
                                                        dtype=torch.bfloat16)
            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        torch.manual_seed(1)
        self.model = get_peft_model(base, config)

    def on_fit_start(self) -> None:
        if not self.touch:
            return
        with self.trainer.strategy.gathered_parameters(self), torch.no_grad():
            self.get_parameter(TOUCHED).add_(1.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())


def fit(models: Path, out: Path, run: str) -> None:
    model, mode, *stage = run.split(":")
    tag = run.replace(":", "-")
    resume = mode == "resume"
    folder = out / f"{model}-{'lean' if resume else mode}{''.join(f'-{s}' for s in stage)}-ckpt"
    record = Record()
    checkpoints = ModelCheckpoint(dirpath=out / f"{tag}-ckpt", every_n_train_steps=3, save_top_k=-1)
    strategy = ZeroStrategy(stage=int(stage[0]) if stage else 3, save_frozen=mode == "whole")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy,
                      precision="32-true" if model == "gpt2" else "bf16-true", max_steps=6, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[record, checkpoints])
    module = FineTune(str(models / ("gpt2" if model == "gpt2" else "llama")), model, touch=mode == "touched")
    tokens = torch.randint(0, 128, (24, 12), generator=torch.Generator().manual_seed(1))  # 3 steps an epoch
    torch.manual_seed(0)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4),
                ckpt_path=folder / "epoch=0-step=3.ckpt" if resume else None)
    lzero.unshard(module)
    if trainer.is_global_zero:
        trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
        torch.save({"losses": record.losses, "trained": trained}, out / f"{tag}.pt")


def fabric_run(models: Path, out: Path) -> None:
    import lightning as L
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="zero3")
    fabric.launch()
    tokens = torch.randint(0, 128, (24, 12), generator=torch.Generator().manual_seed(1))

    def build() -> tuple[Any, Any]:
        with fabric.init_module(empty_init=True):  # zero3: each rank reads its shard of the base from the files
            base = AutoModelForCausalLM.from_pretrained(models / "gpt2", dtype=torch.float32)
            model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                    fan_in_fan_out=True))
        torch.manual_seed(1)  # empty_init skipped peft's draws (under DDP too): the adapters drawn after it
        for layer in model.modules():
            if hasattr(layer, "reset_lora_parameters"):
                layer.reset_lora_parameters("default", True)
        model = fabric.setup_module(model)
        return model, fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                                lr=1e-2))

    def steps(model: Any, optimizer: Any, first: int, last: int) -> list[float]:
        losses = []
        for i in range(first, last):
            batch = tokens[(i % 3) * 8 + fabric.global_rank * 4:][:4]
            loss = model(input_ids=batch, labels=batch).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def adapters(model: Any) -> dict[str, torch.Tensor]:  # Fabric's state dict: whole tensors on every rank
        return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}

    model, optimizer = build()
    losses = steps(model, optimizer, 0, 3)
    fabric.save(out / "gpt2-fabric.ckpt", {"model": model, "optimizer": optimizer})
    losses += steps(model, optimizer, 3, 6)
    whole = adapters(model)
    model, optimizer = build()
    fabric.load(out / "gpt2-fabric.ckpt", {"model": model, "optimizer": optimizer})
    resumed = steps(model, optimizer, 3, 6)
    trained = adapters(model)
    if fabric.global_rank == 0:
        torch.save({"losses": losses, "trained": whole, "resumed_losses": resumed, "resumed": trained},
                   out / "gpt2-fabric.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    models_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    for run in sys.argv[3:]:
        fabric_run(models_dir, out_dir) if run == "gpt2:fabric" else fit(models_dir, out_dir, run)
    destroy_process_group()
