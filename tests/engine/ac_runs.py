"""Activation checkpointing at world size 2 (Lightning re-runs this script for rank 1).

    python tests/engine/ac_runs.py OUT_DIR

A small DemoGPT (dropout 0.1) trains 3 steps under zero1/zero2/zero3, each once plainly and once with
activation checkpointing (zero1: the qualified class name, zero2: the class with cpu_checkpointing,
zero3: True, eagerly built and built on the meta device). Rank 0 writes ``OUT_DIR/<run>.pt``: final
parameters, losses, gradient norms, state_dict keys seen while fitting, whether ``forward`` came back,
and at zero3 what the gatherer did (see :class:`GatherProbe`). tests/engine/test_activation_checkpointing.py
compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lzero
from lzero import ZeroStrategy
from lzero.demo import DemoGPT
from lzero.demo.model import Block
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

SHAPE = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.1, lr=1e-2)
STEPS = 3


class Recorder(Callback):
    """Per-step loss and reported gradient norm; the names a checkpoint would hold, seen mid-fit."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.names: dict[str, list[str]] = {}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.grad_norms.append(trainer.strategy.grad_norm().item())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.names = {"parameters": [n for n, _ in pl_module.named_parameters()],
                      "state_dict": list(pl_module.state_dict(keep_vars=True)),  # zero3: no reads
                      "checkpoint": list(trainer.strategy.lightning_module_state_dict()),
                      "checkpointed_forwards": sorted(p for p, m in pl_module.named_modules() if "forward" in m.__dict__)}


class GatherProbe(Callback):
    """Zero3: per step, how many block all-gathers start, and for every run of a block's first LayerNorm
    (forward and, under checkpointing, recomputation) the block's state and whether backward is running."""

    def __init__(self) -> None:
        self.launches: list[int] = []
        self.ln_1: list[list[tuple[int, str, bool]]] = []
        self._hooks: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        gatherer = trainer.strategy.engine.gatherer
        launch = gatherer.launch

        def counted(name: str, **kwargs: Any) -> None:
            if name and gatherer.blocks[name].state.name == "RELEASED":
                self.launches[-1] += 1
            launch(name, **kwargs)

        gatherer.launch = counted
        for i, block in enumerate(pl_module.model.blocks):
            def seen(module: Any, args: Any, i: int = i) -> None:
                state = gatherer.blocks[f"model.blocks.{i}"].state.name
                self.ln_1[-1].append((i, state, torch._C._current_graph_task_id() != -1))
            self._hooks.append(block.ln_1.register_forward_pre_hook(seen))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.launches.append(0)
        self.ln_1.append([])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for h in self._hooks:
            h.remove()
        del trainer.strategy.engine.gatherer.launch


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, SHAPE["vocab_size"], (4 * 2 * STEPS, SHAPE["block_size"] + 1), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)


def run(out: Path, name: str, strategy: ZeroStrategy, meta: bool = False) -> None:
    seed_everything(0)
    recorder, probe = Recorder(), GatherProbe()
    callbacks: list[Callback] = [recorder] + ([probe] if strategy.config.stage == 3 else [])
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks)
    with trainer.init_module(empty_init=meta):
        model = DemoGPT(**SHAPE)
    weight = model.model.blocks[0].ln_1.weight  # zero3_meta: a fake tensor, the CPU reported over no memory
    built_on = (weight.device.type, weight.untyped_storage().device.type)
    trainer.fit(model, data())
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "losses": recorder.losses, "grad_norms": recorder.grad_norms, "names": recorder.names,
                    "instance_forwards": sorted(p for p, m in model.named_modules() if "forward" in m.__dict__),
                    "forward_is_class_method": all(m.forward.__func__ is type(m).forward for m in model.modules()),
                    "launches": probe.launches, "ln_1": probe.ln_1, "built_on": built_on,
                    "reference_keys": list(DemoGPT(**SHAPE).state_dict())}, out / f"{name}.pt")


def main(out: Path) -> None:
    runs: dict[str, Callable[[], ZeroStrategy]] = {
        "zero1": lambda: ZeroStrategy(stage=1),
        "zero1_ac": lambda: ZeroStrategy(stage=1, activation_checkpointing=["lzero.demo.model.Block"]),
        "zero2": lambda: ZeroStrategy(stage=2),
        "zero2_ac": lambda: ZeroStrategy(stage=2, activation_checkpointing=[Block], cpu_checkpointing=True),
        # min_memory: each block gathered in forward and again before its backward, whose recomputation the test
        # follows ("auto" keeps this small model's blocks gathered all step)
        "zero3": lambda: ZeroStrategy(stage=3, schedule="min_memory"),
        "zero3_ac": lambda: ZeroStrategy(stage=3, activation_checkpointing=True, schedule="min_memory"),
    }
    for name, strategy in runs.items():
        run(out, name, strategy())
    run(out, "zero3_meta", ZeroStrategy(stage=3, schedule="min_memory"), meta=True)
    run(out, "zero3_meta_ac", ZeroStrategy(stage=3, activation_checkpointing=True, schedule="min_memory"), meta=True)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    main(out_dir)
    destroy_process_group()
