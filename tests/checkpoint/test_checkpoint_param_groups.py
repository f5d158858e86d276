"""Restoring param groups from a checkpoint, against ``torch.optim.Optimizer.load_state_dict`` (what DDP
resumes with): the restored group is the saved one, whichever way the checkpoint is stored.

The checkpoint's groups carry a key the new run's groups lack (``note``), and the new run's groups carry a
key the checkpoint lacks (``tag``, as a scheduler or callback of this run would add): torch drops ``tag``
and brings back ``note``. See ``restore_param_groups`` in lzero/checkpoint/rank_state.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.checkpoint.reader import ShardedCheckpoint
from lzero.checkpoint.sharded import load_optimizer_shards, save_sharded
from lzero.checkpoint.state_dict import sharded_state_dict


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def _groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    return [{"params": list(model[0].parameters()), "lr": lr}, {"params": list(model[1].parameters()), "lr": lr / 2}]


def _zero(model: nn.Module, lr: float) -> ZeroOptimizer:
    optimizer = torch.optim.SGD(_groups(model, lr), lr=lr, momentum=0.9)
    return ZeroOptimizer(optimizer, ZeroEngine(model, [optimizer], ZeroConfig(stage=2)), 0)


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _saved_state(model: nn.Module) -> dict[str, Any]:
    """An SGD state dict at lr 0.5 whose groups carry an extra ``note``."""
    saved = torch.optim.SGD(_groups(model, 0.5), lr=0.5, momentum=0.9).state_dict()
    for i, group in enumerate(saved["param_groups"]):
        group["note"] = f"saved {i}"
    return saved


def _tag(groups: list[dict[str, Any]]) -> None:
    for group in groups:
        group["tag"] = "this run only"


def _torch_reference(saved: dict[str, Any]) -> list[dict[str, Any]]:
    model = _model()
    reference = torch.optim.SGD(_groups(model, 0.1), lr=0.1, momentum=0.9)
    _tag(reference.param_groups)
    reference.load_state_dict(saved)
    return _hyperparameters(reference.param_groups)


def test_full_state_param_groups_match_torch() -> None:
    saved = _saved_state(_model())
    expected = _torch_reference(saved)
    assert all("tag" not in g and g["note"] == f"saved {i}" and g["lr"] == (0.5, 0.25)[i]
               for i, g in enumerate(expected))
    target = _model()
    zopt = _zero(target, 0.1)
    _tag(zopt.param_groups)
    zopt.load_state_dict(saved)
    assert _hyperparameters(zopt.param_groups) == expected
    kept = [p for g in zopt.param_groups for p in g["params"]]
    assert len(kept) == 4 and all(a is b for a, b in zip(kept, target.parameters()))  # the groups keep their own


def test_sharded_param_groups_match_torch(tmp_path: Path) -> None:
    model = _model()
    saving = _zero(model, 0.5)
    for i, group in enumerate(saving.param_groups):
        group["note"] = f"saved {i}"
    checkpoint = {"state_dict": sharded_state_dict(saving.engine, model), "global_step": 1, "epoch": 0,
                  "pytorch-lightning_version": "test", "optimizer_states": [{}]}
    save_sharded(tmp_path / "ckpt", saving.engine, [saving], checkpoint, None, stage=2, precision="32-true")
    expected = _torch_reference(_saved_state(_model()))

    target = _model()
    zopt = _zero(target, 0.1)
    _tag(zopt.param_groups)
    load_optimizer_shards(zopt, 0, ShardedCheckpoint(tmp_path / "ckpt"))
    assert _hyperparameters(zopt.param_groups) == expected
    kept = [p for g in zopt.param_groups for p in g["params"]]
    assert len(kept) == 4 and all(a is b for a, b in zip(kept, target.parameters()))  # the groups keep their own
