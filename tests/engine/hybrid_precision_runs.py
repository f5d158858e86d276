"""Hybrid sharding under the Trainer at world size 4 (2 shard groups of 2 ranks), beside the flat layout and DDP at
world size 4 (Lightning re-runs nothing: start 4 ranks, as torchrun does).

    python tests/engine/hybrid_precision_runs.py OUT_DIR

skip_runs.py's regression model and batches. fp16 with rank 3 (the second shard group) injecting inf/NaN into one
gradient at global steps 3, 4 and 9, and bf16-mixed, each flat and hybrid at stage 3; fp32 zero2 and zero3_offload
hybrid beside DDP, zero3 hybrid with qwZ and int8 qgZ (quantized within and across the groups), zero3 hybrid reducing layer by layer, zero3 with shard groups of one rank (pure replication), and zero3 hybrid with a frozen first layer
beside DDP with it frozen. Each run ends with ``trainer.validate`` of the trained model. Every rank writes ``OUT_DIR/<run>_rank<r>.pt`` (tests/engine/test_hybrid.py reads them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero
from lzero import ZeroPrecision, ZeroStrategy
from _teardown import destroy_process_group
from skip_runs import SCALING, Record, Toy, data, step_batch


def validation_step(self: Toy, batch: Any, batch_idx: int) -> None:
    """Fixed batches, a different one per rank and index: the mean over every rank is the reference's."""
    x, y = step_batch(1000 + int(batch[0].item()), self.global_rank, self.trainer.world_size)
    self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)


Toy.validation_step = validation_step


def fit(out: Path, name: str, strategy: Any, precision: Any, steps: int, inject: dict[int, str],
        frozen: bool = False) -> None:
    torch.manual_seed(0)
    model = Toy(inject, fused=False, inject_rank=3)
    if frozen:  # the first layer frozen: sharded (stage 3) but never reduced or stepped
        model.net[0].requires_grad_(False)
    record = Record() if isinstance(strategy, ZeroStrategy) else None
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, plugins=[precision] if precision else None,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record] if record else None)
    losses = []
    model.on_train_batch_end = lambda outputs, batch, batch_idx: losses.append(outputs["loss"].item())
    trainer.fit(model, data())
    validated = trainer.validate(model, DataLoader(TensorDataset(torch.arange(4.0)), batch_size=1),
                                 verbose=False)[0]["val_loss"]  # the trained model, sharded, on fixed batches
    lzero.unshard(model)
    torch.save({"rows": record.rows if record else [], "losses": losses, "val_loss": validated,
                "skipped_steps": getattr(trainer.precision_plugin, "skipped_steps", 0),
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               out / f"{name}_rank{trainer.global_rank}.pt")


def main(out: Path) -> None:
    inject = {3: "inf", 4: "nan", 9: "inf"}
    for layout, options in (("flat", {}), ("hybrid", {"shard_group_size": 2})):
        fit(out, f"fp16_{layout}", ZeroStrategy(stage=3, **options), ZeroPrecision("16-mixed", loss_scaling=SCALING),
            12, inject)
        fit(out, f"bf16_{layout}", ZeroStrategy(stage=3, **options), ZeroPrecision("bf16-mixed"), 8, {})
    fit(out, "ddp", "ddp", None, 8, {})
    fit(out, "zero2_hybrid", ZeroStrategy(stage=2, shard_group_size=2), ZeroPrecision("32-true"), 8, {})
    fit(out, "zero3_offload_hybrid", ZeroStrategy(stage=3, shard_group_size=2, offload_optimizer="cpu",
                                                  offload_param="cpu"), ZeroPrecision("32-true"), 8, {})
    fit(out, "zero3_hybrid_quantized", ZeroStrategy(stage=3, shard_group_size=2, quantized_weights=True,
                                                    quantized_gradients=8), ZeroPrecision("32-true"), 8, {})
    # one reduction per layer, at most one in flight: the second layer's launch waits in its hook for the first
    # one's sum across the groups, started there asynchronously ([Note: the sum across replicas overlaps])
    fit(out, "zero3_hybrid_per_layer", ZeroStrategy(stage=3, shard_group_size=2, unit_modules=("Linear",),
                                                    reduce_bucket_size=1, max_inflight_reductions=1),
        ZeroPrecision("32-true"), 8, {})
    fit(out, "zero3_groups_of_one", ZeroStrategy(stage=3, shard_group_size=1), ZeroPrecision("32-true"), 8, {})
    fit(out, "ddp_frozen", "ddp", None, 8, {}, frozen=True)
    fit(out, "zero3_hybrid_frozen", ZeroStrategy(stage=3, shard_group_size=2), ZeroPrecision("32-true"), 8, {},
        frozen=True)


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    main(out_dir)
    destroy_process_group()
