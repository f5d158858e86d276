"""A sharded checkpoint of a model of a chosen size, written without Lightning (world size 1, one
process, the engine and the same SaveJob the strategy uses). Shared by the checkpoint benchmark and
the consolidation memory test (tests/checkpoint/test_consolidate_memory.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.checkpoint.sharded import save_sharded
from lzero.checkpoint.state_dict import sharded_state_dict


def build(n_layers: int, width: int, adam_state: bool) -> tuple[nn.Module, ZeroEngine, ZeroOptimizer]:
    """``n_layers`` Linear(width, width) layers; with ``adam_state`` one AdamW step so the optimizer
    state exists (the checkpoint then holds 3 fp32 values per parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2))
    zopt = ZeroOptimizer(opt, engine, 0)
    if adam_state:
        model(torch.randn(2, width)).sum().backward()
        zopt.step()
        zopt.zero_grad()
    return model, engine, zopt


def save(path: Path, model: nn.Module, engine: ZeroEngine, zopt: ZeroOptimizer) -> None:
    checkpoint = {"state_dict": sharded_state_dict(engine, model), "global_step": 1, "epoch": 0,
                  "pytorch-lightning_version": "benchmark", "optimizer_states": [{}]}
    save_sharded(path, engine, [zopt], checkpoint, None, stage=2, precision="32-true")
