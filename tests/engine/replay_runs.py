"""Models built on the meta device under zero3 start from the eager model's weights: world size 2, 10 steps.

    python tests/engine/replay_runs.py OUT_DIR RUN [RUN ...]

RUN is ``MODEL:STRATEGY:PRECISION[:init_module]``; MODEL: ``mlp`` (an embedding, 4 x [Linear, LayerNorm, GELU] and a
head, its first Linear redrawn by ``trunc_normal_``), ``llama``, ``gpt2``, ``t5`` (Hugging Face ``from_config``) or
``lora`` (the Llama with peft's LoRA adapters added in the same ``configure_model``), ``branchy`` (a module whose
``reset_parameters`` skips its draw on the meta device), ``pre_lora`` / ``pre_head`` (``from_pretrained`` of
``$REPLAY_PRETRAINED``, then LoRA adapters after a seed, or a new classification head); ``pre_resize``: its
token embeddings resized. The model is built in
``configure_model`` after ``torch.manual_seed(0)`` (``init_module``: under ``trainer.init_module(empty_init=True)``
before fit instead). Rank 0 writes ``OUT_DIR/RUN.pt``: the parameters and buffers as the first step sees them
(gathered), the losses, and a draw from the global RNG at the start of fit. tests/engine/test_replay.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero  # noqa: F401
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

VOCAB = 64


class Branchy(nn.Module):
    """A module whose ``reset_parameters`` branches on the meta device, as libraries do that defer work there."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.w = nn.Parameter(torch.empty(32, 32))
        self.head = nn.Linear(32, VOCAB)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.w.is_meta or self.w.device.type == "meta":
            return  # nothing to draw on the meta device: eager code never takes this branch
        nn.init.normal_(self.w, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x) @ self.w))


def pretrained(kind: str) -> nn.Module:
    """A pretrained Llama (``$REPLAY_PRETRAINED``, saved by the test) with what its files do not hold: peft's LoRA
    adapters drawn after a seed (``pre_lora``), a new classification head (``pre_head``), or 16 new token rows
    (``pre_resize``)."""
    import os

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    folder = os.environ["REPLAY_PRETRAINED"]
    if kind == "pre_head":
        return AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if kind == "pre_resize":  # the new rows drawn from the loaded ones' mean and covariance (values read)
        model.resize_token_embeddings(VOCAB + 16)
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


def build(kind: str) -> nn.Module:
    if kind.startswith("pre_"):
        return pretrained(kind)
    if kind == "branchy":
        return Branchy()
    if kind == "mlp":
        net = nn.Sequential(nn.Embedding(VOCAB, 32), *[m for _ in range(4) for m in (nn.Linear(32, 32),
                                                                                        nn.LayerNorm(32), nn.GELU())],
                            nn.Linear(32, VOCAB))
        nn.init.trunc_normal_(net[1].weight, std=0.02)
        return net
    from transformers import (AutoModelForCausalLM, AutoModelForSeq2SeqLM, GPT2Config, LlamaConfig, T5Config)

    if kind == "t5":
        return AutoModelForSeq2SeqLM.from_config(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                          vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0))
    if kind == "gpt2":
        return AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                                           n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                                           attn_pdrop=0.0))
    model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         vocab_size=VOCAB))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                 init_lora_weights="gaussian"))
    return model


class Built(LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net: Any = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build(self.kind)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if self.kind in ("mlp", "branchy"):
            return self.net(x).float().logsumexp(-1).mean() - self.net(x).float()[..., 0].mean()
        if self.kind == "t5":
            return self.net(input_ids=x, decoder_input_ids=x, labels=x).loss
        if self.kind == "pre_head":
            return self.net(input_ids=x).logits.float().logsumexp(-1).mean()
        return self.net(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> Any:
        # fused: the kernel an offloaded step runs, so that DDP is the bitwise reference of every preset
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, fused=True)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.draw: Any = None

    def on_fit_start(self, trainer: Trainer, module: LightningModule) -> None:
        strategy = trainer.strategy
        gathered = strategy.gathered_parameters(module) if hasattr(strategy, "gathered_parameters") else \
            torch.no_grad()
        with gathered:
            self.initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.draw = torch.get_rng_state().clone()  # where the global RNG is: eager construction advanced it

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())


def fit(out: Path, run: str) -> None:
    kind, strategy, precision, *flags = run.split(":")
    record = Record()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=10,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record])
    tokens = torch.randint(0, VOCAB, (80, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    module = Built(kind)
    if "init_module" in flags:
        with trainer.init_module(empty_init=True):
            module.configure_model()
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    if trainer.is_global_zero:
        torch.save({"initial": record.initial, "losses": record.losses, "rng": record.draw},
                   out / f"{run.replace(':', '-')}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    for run in sys.argv[2:]:
        fit(out_dir, run)
    destroy_process_group()
