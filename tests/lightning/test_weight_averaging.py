"""Weight-averaging callbacks read and write every parameter between steps: zero3 refuses them
before the first step; zero1/zero2 keep whole parameters and run them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lzero import ZeroConfigError, ZeroStrategy


class TwoBlocks(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.blocks(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Steps(Callback):
    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.started += 1


def fit(strategy: Any, averaging: Callback) -> tuple[Trainer, Steps]:
    steps = Steps()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2,
                      callbacks=[averaging, steps], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TwoBlocks(), data)
    return trainer, steps


@pytest.mark.parametrize("averaging", [StochasticWeightAveraging, EMAWeightAveraging])
def test_zero3_refuses_weight_averaging_before_the_first_step(in_process_fit, averaging: type) -> None:
    callback = averaging(swa_lrs=0.05, swa_epoch_start=1) if averaging is StochasticWeightAveraging else averaging()
    steps = Steps()
    with pytest.raises(ZeroConfigError, match=rf"`{averaging.__name__}` .* zero3 .*HINT: .*zero2.*gathered_parameters"):
        data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
        Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=1, max_epochs=2, callbacks=[callback, steps],
                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False).fit(TwoBlocks(), data)
    assert steps.started == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_swa_runs_at_zero1_and_zero2(in_process_fit, stage: int) -> None:
    """As under DDP, bit for bit (world size 1 here; world size 2 with BatchNorm: test_grad_clearing.py)."""
    trainer, steps = fit(ZeroStrategy(stage=stage), StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))
    reference, _ = fit("ddp", StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))
    assert steps.started == 8
    for p, q in zip(trainer.lightning_module.parameters(), reference.lightning_module.parameters(), strict=True):
        assert torch.equal(p, q)
