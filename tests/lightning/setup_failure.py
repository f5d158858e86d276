"""A ZeRO-3 setup that stops part way, at world size 2: the error that stopped it must be the last one each rank prints
(see [Note: a setup that stops part way] in lzero/engine/engine.py).

    python setup_failure.py trainer|fabric partition|gather|hpz|stores|optimizers

``hpz`` is a real misconfiguration (``hpz_partition_size=8`` at world size 2, found after the parameters are
sharded); the others raise ``RuntimeError("injected at <phase>")`` from inside the engine's setup: the partition, the
gather hooks (after the process groups and the shards), the shard stores, and the optimizers' wrapping (after the
engine is whole)."""

import sys

import lightning as L
import torch

import lzero.engine.engine as engine_module
import lzero.optimizer
from lzero.demo.model import GPT, GPTConfig

DOOR, PHASE = sys.argv[1], sys.argv[2]


def injected(*args, **kwargs):
    raise RuntimeError(f"injected at {PHASE}")


if PHASE == "partition":
    engine_module.partition_by_label = injected
elif PHASE == "gather":
    engine_module.Gatherer = injected
elif PHASE == "stores":
    engine_module.stores_for = injected
elif PHASE == "optimizers":
    lzero.optimizer.ZeroOptimizer.__init__ = injected
    lzero.optimizer.ZeroOptimizer.attach = injected
options = {"stage": 3, "hpz_partition_size": 8 if PHASE == "hpz" else 1}
config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
batch = torch.zeros(2, 8, dtype=torch.long)

if DOOR == "trainer":
    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(config)

        def training_step(self, batch, batch_idx):
            return self.model(batch).float().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=lzero.ZeroStrategy(**options), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader([batch[0]] * 4, batch_size=2))
else:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=lzero.ZeroFabricStrategy(**options))
    fabric.launch()
    model = fabric.setup_module(GPT(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    fabric.backward(model(batch).float().mean())  # the engine starts here: [Note: the engine starts at first use]
    optimizer.step()
