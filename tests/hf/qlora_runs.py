"""QLoRA: a bitsandbytes-quantized pretrained base with peft LoRA adapters, world size 2, 10 steps, bf16-true.

    python tests/hf/qlora_runs.py MODELS_DIR OUT_DIR RUN [RUN ...]

RUN is ``MODEL:QUANT:STRATEGY:BUILD[:FLAG...]``. QUANT: ``nf4`` (nf4, bf16 quant storage, double quantization, as
QLoRA's paper and DeepSpeed need), ``fp4`` (fp4, uint8 storage, no double quantization) or ``int8`` (LLM.int8).
BUILD: ``init`` (``from_pretrained`` in ``__init__``) or ``configure`` (in ``configure_model``: under zero3 each
rank reads and quantizes its own shard). The adapters start from fixed values (``on_fit_start``, through
``strategy.gathered_parameters()`` under lzero), or with ``peft`` as peft draws them (gaussian, after
``torch.manual_seed(1)``). ``eval`` adds, after fit, the validation loss and 4 greedy tokens
generated inside ``strategy.generation()`` on the quantized shards. ``ckpt`` runs a sanity validation first (an
eval-mode forward, where bitsandbytes' CPU kernels repack the 4-bit weights) and saves checkpoints every 5 steps to
``OUT_DIR/RUN-ckpt/``, the adapters' ``adapter_config.json`` to ``OUT_DIR/RUN-adapter-config/`` and the logits of the trained model on ``PROBE``. ``resume`` runs on one process, batches of 8
(the 2 ranks' batches of 4 together), from the step-5 checkpoint of the same run with ``ckpt`` (the same RUN with
``resume`` in place of ``ckpt``). ``fresh`` runs as the first run of a fresh process would: bitsandbytes makes its 4-bit code
tables once per process, in the default dtype of its first quantization (bf16 under bf16-true's ``configure_model``,
fp32 elsewhere), so the run forgets the tables the runs before it made (put such runs last: later ones keep its).
Rank 0 writes ``OUT_DIR/RUN.pt`` (``:`` as ``-``): losses, adapter weights after fit, and with ``eval`` the
validation loss and the generated tokens. tests/hf/test_qlora.py compares them with DDP's.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

import lzero
from lzero.demo.finetune import quantization_config as quantization  # nf4, fp4 or int8
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

PROBE = torch.tensor([[3, 17, 42, 5, 9]])


class QLoRA(LightningModule):
    def __init__(self, path: str, quant: str, lazy: bool, peft_draws: bool = False) -> None:
        super().__init__()
        self.path, self.quant, self.peft_draws = path, quant, peft_draws
        if not lazy:
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.path, quantization_config=quantization(self.quant),
                                                    dtype=torch.bfloat16)
        if self.peft_draws:
            torch.manual_seed(1)  # as users write it: the adapters drawn by peft after a seed
        self.model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0,
                                                     init_lora_weights="gaussian" if self.peft_draws else True))

    def on_fit_start(self) -> None:
        if self.peft_draws:  # the adapters as peft drew them
            self.start = {n: p.detach().clone() for n, p in self.named_parameters() if "lora_" in n} \
                if not hasattr(self.trainer.strategy, "gathered_parameters") else self._gathered_start()
            return
        self._fixed_start()

    def _gathered_start(self) -> dict:
        with self.trainer.strategy.gathered_parameters(self):
            return {n: p.detach().clone() for n, p in self.named_parameters() if "lora_" in n}

    def _fixed_start(self) -> None:
        strategy = self.trainer.strategy
        gathered = strategy.gathered_parameters(self) if hasattr(strategy, "gathered_parameters") else \
            contextlib.nullcontext()
        generator = torch.Generator().manual_seed(7)
        self.start = {}
        with gathered, torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
                    self.start[name] = p.detach().clone()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        # fused: the kernel an offloaded step runs, so that DDP is the bitwise reference of every strategy
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3, fused=True)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.mean_losses: list[float] = []  # over the ranks (a collective): what one rank with every batch sees

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())
        self.mean_losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


def _trainer(strategy: str, steps: int, callbacks: list, devices: int = 2) -> Trainer:
    checkpointing = any(type(c).__name__ == "ModelCheckpoint" for c in callbacks)
    return Trainer(enable_checkpointing=checkpointing, num_sanity_val_steps=2 if checkpointing else 0,
                   accelerator="cpu", devices=devices, strategy=strategy, precision="bf16-true", max_steps=steps,
                   logger=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks)


def forget_bitsandbytes_tables() -> None:
    """What a fresh process starts with: no 4-bit code table yet (bitsandbytes 0.50 caches them on first use)."""
    from bitsandbytes.backends import utils
    from bitsandbytes.backends.default import ops

    utils._code_4bit_cache.clear()
    ops._get_4bit_quantize_bounds.cache_clear()


def fit(models: Path, out: Path, run: str) -> None:
    name, quant, strategy, build, *flags = run.split(":")
    if "fresh" in flags:
        forget_bitsandbytes_tables()
    # 40 samples: 5 steps an epoch on 2 ranks, so the step-5 checkpoint ends an epoch and a resume sees the same batches
    tokens = torch.randint(0, 128, (40, 12), generator=torch.Generator().manual_seed(1))
    record = Record()
    tag = run.replace(":", "-")
    callbacks: list = [record]
    if "ckpt" in flags:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=out / f"{tag}-ckpt", every_n_train_steps=5, save_top_k=-1,
                                         save_last=True))
    resume = "resume" in flags
    trainer = _trainer(strategy, 10, callbacks, devices=1 if resume else 2)
    module = QLoRA(str(models / name), quant, lazy=build == "configure", peft_draws="peft" in flags)
    checkpoint = out / f"{tag.replace('-resume', '-ckpt')}-ckpt" / "epoch=0-step=5.ckpt" if resume else None
    val = DataLoader(TensorDataset(tokens[:16]), batch_size=4) if "ckpt" in flags else None
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=8 if resume else 4), val, ckpt_path=checkpoint)
    result: dict[str, Any] = {"losses": record.losses, "mean_losses": record.mean_losses}
    if "eval" in flags:
        val = trainer.validate(module, DataLoader(TensorDataset(tokens[:16]), batch_size=4), verbose=False)
        result["val_loss"] = val[0]["val_loss"]
        strategy_obj = trainer.strategy
        generation = strategy_obj.generation() if hasattr(strategy_obj, "generation") else contextlib.nullcontext()
        with generation, torch.no_grad():
            result["generated"] = module.model.generate(input_ids=PROBE, max_new_tokens=4, do_sample=False)
    lzero.unshard(module)  # zero3 leaves the model sharded: whole adapters to compare (a no-op otherwise)
    if "ckpt" in flags:
        module.model.eval()  # as PeftModel.from_pretrained returns the model
        with torch.no_grad():
            result["logits"] = module.model(input_ids=PROBE).logits
    if trainer.is_global_zero:
        result["adapters"] = {k: v.detach().clone() for k, v in module.named_parameters() if "lora_" in k}
        result["start"] = module.start
        if "ckpt" in flags:  # what `lzero export-hf --adapters-only --config` needs beside the checkpoint
            module.model.peft_config["default"].save_pretrained(out / f"{tag}-adapter-config")
        torch.save(result, out / f"{tag}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    models_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    for run in sys.argv[3:]:
        fit(models_dir, out_dir, run)
    destroy_process_group()
