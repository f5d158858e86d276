"""Pipeline parallel at Fabric's door: ``ZeroFabricStrategy(pipeline_parallel_size=2)`` at pp2 x dp2 (world 4).

    python tests/lightning/pipeline_fabric_runs.py OUT_DIR LLAMA_DIR   # with 4 ranks

The loop a Fabric script writes, with the step (model call and loss) handed to ``strategy.pipeline_step``; the
models, batches and optimizer of pipeline_runs.py (4 micro-batches of 1 per data rank, 4 AdamW steps clipped by
``fabric.clip_gradients``), at zero1 (the Llama) and zero2, zero3 (the demo GPT, its head tied to the embedding; zero3
also with ``optimizer_partition="per_tensor"``).
Each run ends with ``fabric.save`` and a ``fabric.load`` into a fresh pipelined model. Rank 0 writes
``OUT_DIR/fabric_<run>.pt``: losses, norms, the whole parameters before and after the round trip; pipeline_runs.py's
references (one process on the same global batches) beside them. tests/lightning/test_pipeline.py compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroFabricStrategy
from pipeline_runs import CLIP, GPT, MICROBATCHES, STEPS, dataset, loss_of, make_model, optimizer_of, reference

RUNS = {"llama_zero1": 1, "gpt_zero2": 2, "gpt_zero3": 3, "gpt_zero3_per_tensor": 3}
"""Run name -> stage; ``_per_tensor``: ``optimizer_partition="per_tensor"``, each stage's AdamW stepping whole tensors
on their owners ([Note: per-tensor ownership] in lzero/engine/partition.py), which must train as per element."""


def step(model: Any, micro: Any) -> torch.Tensor:
    return loss_of(model, micro[0])  # what a DDP loop computes before fabric.backward


def whole(model: Any) -> dict[str, torch.Tensor]:
    """Every stage's parameters, whole (``model.state_dict()``: gathered at zero3), by name."""
    names = {n for n, _ in model.module.named_parameters()}
    mine = {n: v.detach().clone() for n, v in model.state_dict().items() if n in names}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: value for params in everyone for name, value in params.items()}


def fabric_for(stage: int, partition: str = "auto") -> Fabric:
    strategy = ZeroFabricStrategy(stage=stage, pipeline_parallel_size=2, pipeline_microbatches=MICROBATCHES,
                                  optimizer_partition=partition)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    return fabric


def run(out: Path, name: str, stage: int, llama: Any) -> None:
    partition = "per_tensor" if name.endswith("_per_tensor") else "auto"
    fabric = fabric_for(stage, partition)
    model = fabric.setup_module(make_model(llama))
    optimizer = fabric.setup_optimizers(optimizer_of(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=MICROBATCHES, shuffle=True))
    losses, norms = [], []
    for i, batch in zip(range(STEPS), loader):
        loss = fabric.strategy.pipeline_step(model, step, batch)
        fabric.backward(loss)  # the schedule ran it: only the hooks
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss, reduce_op="mean").item())
    params = whole(model)
    fabric.save(out / f"fabric_{name}.ckpt", {"model": model, "optimizer": optimizer})
    again = fabric_for(stage, partition)
    fresh = again.setup_module(make_model(llama))
    fresh_optimizer = again.setup_optimizers(optimizer_of(fresh.parameters()))
    again.load(out / f"fabric_{name}.ckpt", {"model": fresh, "optimizer": fresh_optimizer})
    loaded = whole(fresh)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "norms": norms, "params": params, "loaded": loaded}, out / f"fabric_{name}.pt")


def joint_setup(out: Path) -> None:
    """``fabric.setup(model, optimizer)`` under a pipeline: refused by name (rank 0 writes the message)."""
    fabric = fabric_for(2)
    model = make_model(GPT)
    try:
        fabric.setup(model, optimizer_of(model.parameters()))
        message = None
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        message = f"{type(err).__name__}: {err}"
    if dist.get_rank() == 0:
        torch.save({"message": message}, out / "refused_joint_setup.pt")


def main() -> None:
    out, llama = Path(sys.argv[1]), Path(sys.argv[2])
    joint_setup(out)
    for name, stage in RUNS.items():
        run(out, name, stage, llama if name.startswith("llama") else GPT)
    if dist.get_rank() == 0:
        reference(out, llama, "llama")
        reference(out, GPT, "gpt")
    destroy_process_group()


if __name__ == "__main__":
    main()
