"""Tensor parallel under ZeRO in bf16-mixed (16-bit compute copies, fp32 masters) against one process under autocast
and against Lightning's ``ModelParallelStrategy`` (FSDP2 + TP) in the same precision, at tp2 x dp2.

    python tests/lightning/tp_bf16_runs.py OUT_DIR LLAMA_DIR   # with 4 ranks

The three models of tensor_parallel_runs.py, 4 clipped AdamW steps, zero1/zero2/zero3 (zero3 with
``gather_after_fit=True``: the model leaves fit holding its fp32 masters). Rank 0 writes ``OUT_DIR/<model>zero<S>.pt``,
``model_parallel.pt`` (the block under ModelParallelStrategy), ``reference_copies_<model>.pt`` (one process, bf16
copies of fp32 masters under ``torch.autocast(bfloat16)``: lzero's bf16-mixed) and ``reference_autocast_.pt`` (fp32
weights under autocast: Lightning's, what ModelParallelStrategy runs). tests/lightning/test_tp_bf16.py compares them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, DistributedSampler

import tensor_parallel_runs as runs
from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy

MODELS = {"": None, "gpt_": runs.GPT}  # the Llama's folder is added from the command line


def trainer(strategy: Any, devices: int, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=runs.STEPS, logger=False,
                   precision="bf16-mixed", enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, gradient_clip_val=runs.CLIP, **kwargs)


def reference(out: Path, name: str, llama: Any, copies: bool) -> None:
    """One process on the global batches, fp32 AdamW, the forward under autocast: with fp32 weights that autocast casts
    op by op (``copies`` False: Lightning's bf16-mixed, what ModelParallelStrategy runs), or with bf16 copies of fp32
    masters, their gradients stepped on the masters (``copies``: lzero's bf16-mixed, and DeepSpeed's)."""
    masters = runs.make_model(llama)
    model = runs.make_model(llama).to(torch.bfloat16) if copies else masters
    optimizer = runs.optimizer_of(masters.parameters(), runs.eps_of(llama))
    x, y = runs.dataset().tensors
    orders = [list(DistributedSampler(runs.dataset(), num_replicas=2, rank=d, shuffle=True, seed=0)) for d in range(2)]
    losses = []
    for step in range(runs.STEPS):
        if copies:
            with torch.no_grad():
                for copy, master in zip(model.parameters(), masters.parameters()):
                    copy.copy_(master)
        rows = [order[step * runs.MICRO + i] for order in orders for i in range(runs.MICRO)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = runs.loss_of(model, x[rows], y[rows])
        losses.append(loss.item())
        loss.backward()
        if copies:
            for copy, master in zip(model.parameters(), masters.parameters()):
                master.grad = copy.grad.float()
                copy.grad = None
        torch.nn.utils.clip_grad_norm_(masters.parameters(), runs.CLIP)
        optimizer.step()
        optimizer.zero_grad()
    kind = "copies" if copies else "autocast"
    torch.save({"losses": losses, "params": runs.full_parameters(masters)}, out / f"reference_{kind}_{name}.pt")


if __name__ == "__main__":
    out, llama_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    runs.trainer = trainer  # every run of this script in bf16-mixed
    models = {**MODELS, "llama_": llama_dir}
    for stage in (1, 2, 3):
        for name, llama in models.items():
            strategy = ZeroStrategy(stage=stage, tensor_parallel_size=2, gather_after_fit=stage == 3)
            runs.run(out, f"{name}zero{stage}", strategy, world, llama=llama)
    from lightning.pytorch.strategies import ModelParallelStrategy

    runs.run(out, "model_parallel", ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), world,
             fsdp=True)
    if dist.get_rank() == 0:
        for name, llama in models.items():
            reference(out, name, llama, copies=True)
        reference(out, "", None, copies=False)
    destroy_process_group()
