"""Pretrained Hugging Face models loaded by ``from_pretrained``: DDP with the model built in ``__init__`` against
every lzero preset with ``from_pretrained`` in ``configure_model``, world size 2, 10 steps.

    python tests/hf/pretrained_runs.py MODELS_DIR OUT_DIR RUN [RUN ...]

RUN is ``MODEL:STRATEGY[:PRECISION[:FLAG]]`` (``gpt2:zero3``, ``llama:ddp:bf16-mixed``). FLAG ``eager`` builds the
model in ``__init__`` under an lzero strategy too (DDP always does); ``ckpt`` saves ``OUT_DIR/RUN-ckpt/last.ckpt``;
``lora`` wraps the model with peft's LoRA adapters (their initial values set by ``LORA_A`` in ``on_fit_start``, through
``strategy.gathered_parameters()`` under lzero, so that every run starts from the same adapters) and exports them
with ``ExportHF(adapters_only=True)`` to ``OUT_DIR/RUN-adapters`` and merged into the base with ``ExportHF(merge=True)``
to ``OUT_DIR/RUN-merged``; ``head`` adds a fresh ``nn.Linear`` classification head
after ``from_pretrained`` (drawn where the model is built) whose loss on the last hidden state joins the model's; ``lazy``
builds the model in ``configure_model`` under DDP too.
Every run also saves the logits of the trained model on ``PROBE``. Rank 0 writes
``OUT_DIR/MODEL-STRATEGY-PRECISION.pt``: the first batch, the losses and the parameters after fit.
tests/hf/test_pretrained.py compares them.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

import lzero  # noqa: F401
from _teardown import destroy_process_group  # a sibling: scripts run from their folder


PROBE = torch.arange(10).reshape(1, 10)


def LORA_A(shape: torch.Size) -> torch.Tensor:  # noqa: N802 (a constant's role)
    return torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.1


class Pretrained(LightningModule):
    def __init__(self, path: str, lazy: bool, lora: bool = False, head: bool = False) -> None:
        super().__init__()
        self.path, self.lora, self.with_head = path, lora, head
        if not lazy:
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        cls = AutoModelForSeq2SeqLM if Path(self.path).name == "t5" else AutoModelForCausalLM
        self.model = cls.from_pretrained(self.path, dtype=torch.float32)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            self.model = get_peft_model(self.model, config)
        if self.with_head:  # drawn in the default dtype of the build: bf16 under bf16-true's configure_model
            self.head = torch.nn.Linear(self.model.config.hidden_size, 8)

    def on_fit_start(self) -> None:
        if not self.lora:
            return
        strategy = self.trainer.strategy
        gathered = strategy.gathered_parameters(self) if hasattr(strategy, "gathered_parameters") else \
            contextlib.nullcontext()
        with gathered, torch.no_grad():
            for name, p in self.named_parameters():
                if "lora_A" in name:
                    p.copy_(LORA_A(p.shape))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        if not self.with_head:
            return self.model(input_ids=tokens, labels=tokens).loss
        out = self.model(input_ids=tokens, labels=tokens, output_hidden_states=True)
        classes = self.head(out.hidden_states[-1][:, -1]).float()
        return out.loss + torch.nn.functional.cross_entropy(classes, tokens[:, 0] % 8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)  # the kernel an offloaded step runs


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_batch = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())
        if self.first_batch is None:
            self.first_batch = batch[0].clone()


def fit(models: Path, out: Path, run: str) -> None:
    name, strategy, *rest = run.split(":")
    precision = rest[0] if rest else "32-true"
    eager = (strategy == "ddp" and "lazy" not in rest[1:]) or "eager" in rest[1:]
    tag = run.replace(":", "-")
    checkpoints = [ModelCheckpoint(dirpath=out / f"{tag}-ckpt", save_last=True)] if "ckpt" in rest[1:] else []
    lora = "lora" in rest[1:]  # with ckpt too: "llama:zero3_offload:32-true:lora:ckpt"
    if lora:
        from lzero.hf import ExportHF

        checkpoints += [ExportHF(str(out / f"{tag}-adapters"), adapters_only=True),
                        ExportHF(str(out / f"{tag}-merged"), merge=True)]
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (80, 12), generator=torch.Generator().manual_seed(1))
    record = Record()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=10,
                      logger=False, enable_checkpointing="ckpt" in rest[1:], enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record, *checkpoints])
    module = Pretrained(str(models / name), lazy=not eager, lora=lora, head="head" in rest[1:])
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    lzero.unshard(module)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        params = {k: v.detach().clone() for k, v in (module if module.with_head else module.model).state_dict().items()}
        with torch.no_grad():
            logits = module.model(input_ids=PROBE, decoder_input_ids=PROBE).logits if "t5" in name else \
                module.model(input_ids=PROBE).logits
        torch.save({"losses": record.losses, "first_batch": record.first_batch, "params": params, "logits": logits},
                   out / f"{tag}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    models_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    for run in sys.argv[3:]:
        fit(models_dir, out_dir, run)
    destroy_process_group()
