"""``DemoGPT``: the demo GPT wrapped as a LightningModule for next-token training."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from typing_extensions import override

from lzero.demo.model import GPT, GPTConfig


class DemoGPT(LightningModule):
    """Next-token language model over ``(x, y)`` batches of token ids, both ``(B, T)``.

    The architecture arguments mirror :class:`GPTConfig` as plain values so that
    LightningCLI can expose each one as a flag.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPTConfig(
            vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout
        )
        self.model = GPT(config)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)  # (B, T, vocab_size)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # each (B, T)
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # named_parameters() yields the tied embedding/head weight once, so it lands in
        # exactly one group; listing module weights by hand would add it twice.
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # biases and LayerNorm weights
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))
