"""Out-of-memory triage, world size 2: zero2 fits its first step, then a step runs out of memory (injected: CPU has no
allocator limit to hit), with a budget that only zero3 + activation checkpointing meets.

    python tests/memory/oom_runs.py OUT_DIR

Rank 0 writes ``OUT_DIR/oom.pt``: the error's type and message, its ``lzero_triage`` record, the budget, and the
model's count. tests/memory/test_oom_triage.py checks them against the estimator and the activations of this model counted
by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lzero import ZeroConfig, ZeroStrategy
from lzero.memory.estimate import count_parameters, model_states, working_set
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

VOCAB, WIDTH, LAYERS, BATCH, SEQ = 16, 32, 4, 8, 64
INJECTED = "CUDA out of memory. Tried to allocate 20.00 MiB (injected by tests/memory/oom_runs.py)"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            strategy = self.trainer.strategy
            strategy.memory_budget_bytes = zero3_checkpointed_bytes(self, strategy._probe.total)
            raise torch.OutOfMemoryError(INJECTED)
        (x,) = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def zero3_checkpointed_bytes(model: nn.Module, activations: int) -> int:
    """zero3 + activation checkpointing, priced by hand: the estimator's model states and working set, and the
    activations less what each block saves (its input u and ReLU's output 4u) plus the inputs, plus one block."""
    config, count = ZeroConfig(stage=3), count_parameters(model)
    u = BATCH * SEQ * WIDTH * 4
    checkpointed = activations - LAYERS * 5 * u + LAYERS * u + 5 * u
    states = sum(model_states(config, count, 2, "32-true")["device"].values())
    return states + working_set(config, count, 2, "32-true")["device"] + checkpointed


def main(out: Path) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model = Net()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=2), max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=BATCH))
        caught: dict[str, Any] = {"error": None}
    except torch.OutOfMemoryError as err:
        caught = {"error": type(err).__name__, "message": str(err), "record": getattr(err, "lzero_triage", None)}
    if trainer.is_global_zero:
        torch.save({**caught, "budget": trainer.strategy.memory_budget_bytes, "count": count_parameters(model)},
                   out / "oom.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    destroy_process_group()
