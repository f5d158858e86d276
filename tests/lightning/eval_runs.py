"""validate / test / predict under zero3 and the offload presets, against DDP on the same checkpoint.

    python tests/lightning/eval_runs.py fit OUT_DIR     # zero3 fit (model built in configure_model) + eval after fit
    python tests/lightning/eval_runs.py alone OUT_DIR   # a new process: eval alone from the checkpoint

``fit`` trains 4 steps under zero3, zero3_offload (the model built in ``__init__``) and zero3_offload_nvme with
``ModelCheckpoint(save_last=True)`` (a sharded directory), then runs validate/test/predict on the same Trainer on
the model fit left sharded, and writes ``plain_<preset>.ckpt`` with ``lzero consolidate``; then the ways to read
the sharded model after fit. ``alone`` runs validate/test/predict with ``ckpt_path`` under DDP (each
``plain_<preset>.ckpt``, model built in ``__init__``) and under zero3,
zero3_offload and zero3_offload_nvme (the sharded directory; the model built in ``configure_model`` and, for zero3,
in ``__init__`` too), and predict without a checkpoint. Rank 0 writes ``OUT_DIR/<run>.pt``: metrics, predictions
and the parameter bytes a rank held during predict. tests/lightning/test_eval.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero  # noqa: F401
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

VOCAB, WIDTH, LAYERS = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(LightningModule):
    def __init__(self, lazy: bool = True) -> None:
        super().__init__()
        if not lazy:
            self.configure_model()

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, T, C)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, T, V)

    def _loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        return nn.functional.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def on_predict_start(self) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        self.held = {"shards": 0, "gathered": 0}
        if engine is None:
            return

        def measure(*_: Any) -> None:  # around each block's forward: the units gathered now, and every shard
            self.held["shards"] = sum(u.master_shard.numel() * u.master_shard.element_size() for u in engine.units)
            self.held["gathered"] = max(self.held["gathered"],
                                        sum(u.flat_param.untyped_storage().nbytes() for u in engine.units))

        for block in self.blocks:
            block.register_forward_pre_hook(measure)
            block.register_forward_hook(measure)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(seed: int, n: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, 9), generator=torch.Generator().manual_seed(seed))),
                      batch_size=4)


def trainer(strategy: Any, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, **kwargs)


def evaluate(out: Path, name: str, t: Trainer, model: Net, ckpt: Any) -> None:
    val = t.validate(model, loader(1), ckpt_path=ckpt, verbose=False)[0]
    test = t.test(model, loader(2), ckpt_path=ckpt, verbose=False)[0]
    predictions = t.predict(model, loader(3), ckpt_path=ckpt)
    if t.is_global_zero:
        torch.save({"val": val, "test": test, "predictions": torch.cat(predictions), "held": model.held},
                   out / f"{name}.pt")


AFTER_FIT = {"zero3": True, "zero3_offload": False, "zero3_offload_nvme": True}  # preset -> model built lazily


def held_by(model: Net, strategy: Any) -> dict[str, int]:
    """Bytes behind the module's parameters (distinct storages: a released parameter shares one placeholder
    element), and the engine's parameter shards (in memory: this model is within NVMe offload's ``max_in_cpu``)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    engine = strategy._live_engine if hasattr(strategy, "_live_engine") else None
    units = engine.units if engine is not None else []
    assert not any(u.param_store.holds_in_file(u) for u in units)
    shards = sum(u.compute_shard().numel() * u.compute_shard().element_size() for u in units)
    return {"module": sum(storages.values()), "shards": shards}


def fit(out: Path) -> None:
    """Each preset fits 4 steps, keeps the model sharded, and evaluates on the same Trainer; zero3 then shows the
    ways out: ``state_dict()`` refused by name, ``trainer.save_checkpoint``, ``lzero.unshard``."""
    from lzero.checkpoint.consolidate import consolidate
    from lzero.engine.parameters import ReleasedParameterError

    for strategy, lazy in AFTER_FIT.items():
        torch.manual_seed(0)
        t = trainer(strategy, max_steps=4, callbacks=[ModelCheckpoint(dirpath=out / f"ckpt_{strategy}", save_last=True)])
        model = Net(lazy)
        t.fit(model, loader(0))
        held_after_fit = held_by(model, t.strategy)
        evaluate(out, f"{strategy}_after_fit", t, model, None)
        if t.is_global_zero:
            consolidate(out / f"ckpt_{strategy}" / "last.ckpt", out / f"plain_{strategy}.ckpt")
            torch.save({**torch.load(out / f"{strategy}_after_fit.pt"), "held_after_fit": held_after_fit},
                       out / f"{strategy}_after_fit.pt")
        t.strategy.barrier()
    try:
        model.state_dict()
        refusal = ""
    except ReleasedParameterError as err:
        refusal = str(err)
    t.save_checkpoint(out / "saved_after_fit.ckpt")  # the kept shards: a sharded directory
    lzero.unshard(model)  # whole tensors on every rank, for good
    torch.manual_seed(0)  # zero3's fit again, gathered back at its end
    gathered = Net()
    t = trainer(lzero.ZeroStrategy(stage=3, gather_after_fit=True), max_steps=4, enable_checkpointing=False)
    t.fit(gathered, loader(0))
    if t.is_global_zero:
        consolidate(out / "saved_after_fit.ckpt", out / "saved_after_fit_plain.ckpt")
        torch.save({"refusal": refusal, "unsharded": model.state_dict(),
                    "module_bytes": held_by(model, t.strategy)["module"],
                    "gather_after_fit": gathered.state_dict(),
                    "gather_after_fit_bytes": held_by(gathered, t.strategy)["module"]}, out / "ways_out.pt")
    t.strategy.barrier()


def alone(out: Path) -> None:
    for strategy in AFTER_FIT:  # DDP on each fit's own checkpoint
        evaluate(out, f"ddp_{strategy}", trainer("ddp"), Net(lazy=False), out / f"plain_{strategy}.ckpt")
    sharded, plain = out / "ckpt_zero3" / "last.ckpt", out / "plain_zero3.ckpt"
    for strategy in ("zero3", "zero3_offload", "zero3_offload_nvme"):
        evaluate(out, f"{strategy}_alone", trainer(strategy), Net(), sharded)
    evaluate(out, "zero3_alone_eager", trainer("zero3"), Net(lazy=False), sharded)
    evaluate(out, "zero3_alone_plain_ckpt", trainer("zero3"), Net(), plain)
    t = trainer("zero3")  # no checkpoint: the model initialized on the meta device, unit by unit
    predictions = t.predict(Net(), loader(3))
    if t.is_global_zero:
        torch.save({"predictions": torch.cat(predictions)}, out / "zero3_no_ckpt.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"fit": fit, "alone": alone}[sys.argv[1]](Path(sys.argv[2]))
    destroy_process_group()
