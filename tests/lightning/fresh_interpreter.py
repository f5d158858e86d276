"""A user script that never imports lzero: `Trainer(strategy="zero2")` must still work.

    python tests/lightning/fresh_interpreter.py OUT_FILE
"""

import sys

import lightning  # noqa: F401

assert "lzero" not in sys.modules, "import lightning alone imported lzero"

import torch  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from _teardown import destroy_process_group  # a sibling: scripts run from their folder


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    model = Tiny()
    before = model.layer.weight.detach().clone()
    trainer = Trainer(strategy="zero2", accelerator="cpu", devices=2, max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        with open(sys.argv[1], "w") as f:
            strategy = trainer.strategy
            f.write(f"{type(strategy).__module__}.{type(strategy).__name__} stage={strategy.config.stage}"
                    f" world_size={trainer.world_size} steps={trainer.global_step}"
                    f" moved={not torch.equal(before, model.layer.weight)}\n")
    destroy_process_group()
