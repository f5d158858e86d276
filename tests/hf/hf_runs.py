"""A tiny Hugging Face GPT-2 with LoRA adapters: DDP built eagerly vs zero3 built in ``configure_model``.

    python tests/hf/hf_runs.py OUT_DIR

Both runs train with lr=0, so the parameters after fit are the initial ones. Rank 0 writes
``OUT_DIR/<run>.pt``: per-parameter std/mean/constant value and the losses. tests/hf/test_hf_init.py
compares them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import lzero  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared LoRA adapter
from _lora import LoRA  # noqa: E402
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

CONFIG = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0)


class GPT(LightningModule):
    def __init__(self, lazy: bool) -> None:
        super().__init__()
        if not lazy:
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "gpt"):
            return
        self.gpt = GPT2LMHeadModel(GPT2Config(**CONFIG))
        for block in self.gpt.transformer.h:
            block.attn.c_attn = LoRA(block.attn.c_attn, *block.attn.c_attn.weight.shape)  # Conv1D: (in, out)
            block.mlp.c_fc = LoRA(block.mlp.c_fc, *block.mlp.c_fc.weight.shape)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.gpt(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.0, weight_decay=0.0)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())


def stats(model: nn.Module) -> dict[str, tuple[float, float, float]]:
    """name -> (std, mean, the value if every element equals it else NaN)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().reshape(-1)
        out[name] = (t.std().item(), t.mean().item(), t[0].item() if bool((t == t[0]).all()) else math.nan)
    return out


def fit(out: Path, name: str, strategy: str, lazy: bool) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (16, 16), generator=torch.Generator().manual_seed(1))
    recorder = Losses()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder])
    model = GPT(lazy)
    trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=4))
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"stats": stats(model.gpt), "losses": recorder.losses}, out / f"{name}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    fit(out_dir, "ddp_eager", "ddp", lazy=False)
    fit(out_dir, "zero3_meta", "zero3", lazy=True)
    destroy_process_group()
