"""``model.generate(...)`` on rank 0 alone under zero3 (a misuse: a collective on one rank), under the Trainer or
Fabric, with the unit-order check's timeout at 3 s. Every rank must end with the UnitOrderError that names
``strategy.generation()``; tests/engine/test_stage3_gather.py parses each rank's stderr.

    python generate_misuse.py MODEL_DIR trainer|fabric [RANK]

RANK: the rank that generates alone (default 0).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lzero import ZeroStrategy
from lzero.lightning.fabric_strategy import ZeroFabricStrategy

PROMPT = torch.zeros(1, 4, dtype=torch.long)
TIMEOUT_S = 3
SCHEDULE = "min_memory"  # blocks gathered per forward: "auto" keeps this small model gathered, and a rank then
# generates alone without any collective (no misuse left to name)
ALONE = int(sys.argv[3]) if len(sys.argv) > 3 else 0


def trainer(path: str) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    class Sampled(LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            if self.global_step == 2 and self.global_rank == ALONE:  # the misuse: outside strategy.generation()
                self.model.generate(PROMPT, max_new_tokens=2, do_sample=False)
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    tokens = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(0))
    fit = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, unit_order_timeout_s=TIMEOUT_S, schedule=SCHEDULE),
                  max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    fit.fit(Sampled(), DataLoader(TensorDataset(tokens), batch_size=2))


def fabric(path: str) -> None:
    import lightning as L

    fab = L.Fabric(accelerator="cpu", devices=2, strategy=ZeroFabricStrategy(stage=3, unit_order_timeout_s=TIMEOUT_S,
                                                                       schedule=SCHEDULE))
    fab.launch()
    with fab.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = fab.setup_module(model)
    optimizer = fab.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        fab.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
        if fab.global_rank == ALONE:  # the misuse
            model.generate(PROMPT, max_new_tokens=2, do_sample=False)


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"trainer": trainer, "fabric": fabric}[sys.argv[2]](sys.argv[1])
