"""Tensor parallel through Fabric's door: ``Fabric(strategy=ZeroFabricStrategy(stage=S, tensor_parallel_size=2,
parallelize_fn=...))`` at tp2 x dp2, as a script under Fabric's ``ModelParallelStrategy`` is written.

    python tests/lightning/tp_fabric_runs.py OUT_DIR   # with 4 ranks

The small block of tensor_parallel_runs.py, 4 clipped AdamW steps on the global batches of its one-process reference,
a ``fabric.save`` after step 2 and at the end; then a fresh model and optimizer ``fabric.load`` the step-2 checkpoint
and take steps 3 and 4 again. Rank 0 writes ``OUT_DIR/fabric_zero<S>.pt`` (losses, norms, resumed losses) and
``reference_dp2.pt``; the checkpoints stay in ``OUT_DIR/fabric_zero<S>_step<N>.ckpt``. tests/lightning/test_tp_fabric.py
compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero.lightning.fabric_strategy import ZeroFabricStrategy
from tensor_parallel_runs import CLIP, MICRO, STEPS, VOCAB, build, dataset, optimizer_of, parallelize, reference


def parallelize_fn(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    parallelize(model, device_mesh["tensor_parallel"])  # Fabric's ModelParallelStrategy contract
    return model


def setup(fabric: Fabric) -> tuple[torch.nn.Module, Any]:
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(optimizer_of(model.parameters()))
    return model, optimizer


def batches(fabric: Fabric) -> list[Any]:
    sampler = DistributedSampler(dataset(), **fabric.strategy.distributed_sampler_kwargs, shuffle=True, seed=0)
    return list(DataLoader(dataset(), batch_size=MICRO, sampler=sampler))[:STEPS]


def step(fabric: Fabric, model: Any, optimizer: Any, batch: Any) -> tuple[float, float]:
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))  # loss_of's, through Fabric
    fabric.backward(loss)
    norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
    optimizer.step()
    optimizer.zero_grad()
    return fabric.all_reduce(loss.detach(), reduce_op="mean").item(), norm.item()


def main(out: Path) -> None:
    for stage in (1, 2, 3):
        fabric = Fabric(accelerator="cpu", devices=4, strategy=ZeroFabricStrategy(
            stage=stage, tensor_parallel_size=2, parallelize_fn=parallelize_fn))
        fabric.launch()
        assert fabric.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": fabric.global_rank // 2}
        model, optimizer = setup(fabric)
        losses, norms = [], []
        for i, batch in enumerate(batches(fabric)):
            loss, norm = step(fabric, model, optimizer, batch)
            losses.append(loss)
            norms.append(norm)
            if i + 1 in (2, STEPS):
                fabric.save(out / f"fabric_zero{stage}_step{i + 1}.ckpt", {"model": model, "optimizer": optimizer})
        model, optimizer = setup(fabric)  # a fresh run resumes from step 2
        fabric.load(out / f"fabric_zero{stage}_step2.ckpt", {"model": model, "optimizer": optimizer})
        resumed = [step(fabric, model, optimizer, batch)[0] for batch in batches(fabric)[2:]]
        if fabric.global_rank == 0:
            torch.save({"losses": losses, "norms": norms, "resumed": resumed}, out / f"fabric_zero{stage}.pt")
    if dist.get_rank() == 0:
        reference(out, 2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
    destroy_process_group()
