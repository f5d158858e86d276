"""``FinetuneHF``: causal-language-model fine-tuning of a pretrained Hugging Face model, for
``configs/finetune_hf.yaml``. The model is loaded in ``configure_model`` with the plain ``from_pretrained`` line:
under zero3 and the offload presets each rank reads only its shards of the files (see [Note: from_pretrained
under zero3] in lzero/hf/pretrained.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from typing_extensions import override


class FinetuneHF(LightningModule):
    """Next-token training of ``AutoModelForCausalLM.from_pretrained(path)`` on ``(x, y)`` batches of token ids.

    Args:
        path: a folder written by ``save_pretrained`` (or a Hugging Face model id).
        dtype: the parameters' dtype (``float32`` keeps fp32 masters under ``bf16-mixed``).
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay (matrices only).
        quantization: QLoRA's frozen base, quantized by bitsandbytes as it is read (under zero3, each rank its own
            shard): ``"nf4"``, ``"fp4"`` or ``"int8"`` (see :func:`quantization_config`); None: the weights as they are.
        lora_rank: with a rank > 0, peft's LoRA adapters on ``lora_targets`` train and the rest is frozen.
        lora_targets: the module names LoRA wraps.
    """

    def __init__(self, path: str, dtype: str = "float32", lr: float = 1e-4, weight_decay: float = 0.0,
                 quantization: Optional[str] = None, lora_rank: int = 0,
                 lora_targets: tuple[str, ...] = ("q_proj", "v_proj")) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        hp = self.hparams
        extra = {"quantization_config": quantization_config(hp.quantization)} if hp.quantization else {}
        self.model = AutoModelForCausalLM.from_pretrained(hp.path, dtype=getattr(torch, hp.dtype), **extra)
        if hp.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(r=hp.lora_rank, lora_alpha=2 * hp.lora_rank,
                                                               target_modules=list(hp.lora_targets)))
        self.model.train()  # from_pretrained returns it in eval mode

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # each (B, T)
        logits = self.model(input_ids=x).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.hparams.lr)


def quantization_config(kind: str) -> Any:
    """bitsandbytes' configuration of a QLoRA base: ``"nf4"`` (NF4, double quantization, bf16 storage and compute:
    QLoRA's recipe, the storage DeepSpeed needs too), ``"fp4"`` (FP4, bitsandbytes' uint8 storage) or ``"int8"``."""
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if kind == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    if kind == "fp4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.bfloat16)
    raise ValueError(f"quantization={kind!r} is not known. HINT: use 'nf4', 'fp4' or 'int8'.")
