"""The engine alone (no Lightning) with optimizers that step whole tensors, against DDP step by step, at world size 4
where ranks own none of some units (a Linear's weight and bias among four ranks): their inner optimizers hold no
tensor, and the step, the gathers and the state dict still run. See [Note: per-tensor ownership] in
lzero/engine/partition.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_ranks
from _engine_cases import Net
from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer


def adafactor(params) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=1e-2)


def against_ddp(rank: int, world_size: int, stages: list[int]) -> list[dict]:
    results = []
    for stage in stages:
        torch.manual_seed(1000 + rank)  # unseeded: every rank starts elsewhere, rank 0 wins
        model = Net()
        ref = DDP(copy.deepcopy(model))
        ref_opt = adafactor(ref.parameters())
        opt = adafactor(model.parameters())
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, unit_modules=("Linear",) if stage == 3 else None))
        zopt = ZeroOptimizer(opt, engine, 0)
        gen = torch.Generator().manual_seed(7 + rank)
        for _ in range(5):
            x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
            nn.functional.mse_loss(ref(x), y).backward()
            engine.gather_root()
            nn.functional.mse_loss(model(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            zopt.step()
            zopt.zero_grad()
        state = zopt.state_dict()  # a collective: every owner's tensors gathered
        engine.unshard()
        pairs = list(zip(model.parameters(), ref.module.parameters()))
        want = ref_opt.state_dict()["state"]
        results.append({
            "max_rel": max(((a - b).norm() / b.norm()).item() for a, b in pairs),
            "owners": [u.spec.owners for u in engine.units],
            "owned": [len(zopt.owned_tensors(u)) for u in engine.units],
            "same_state_keys": {i: sorted(s) for i, s in state["state"].items()} == {i: sorted(s) for i, s in want.items()},
            "state_rel": max(((state["state"][i][k] - v).norm() / v.norm().clamp(min=1e-30)).item()
                             for i, s in want.items() for k, v in s.items() if v.dim()),
        })
    return results


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_ranks(against_ddp, 4, [1, 2, 3], timeout=300)


@pytest.mark.parametrize("index,stage", [(0, 1), (1, 2), (2, 3)])
def test_adafactor_at_world_size_4(results: list[list[dict]], index: int, stage: int) -> None:
    per_rank = [r[index] for r in results]
    for rank, got in enumerate(per_rank):
        print(f"stage {stage} rank {rank}: params {got['max_rel']:.2e}, state {got['state_rel']:.2e}, owned {got['owned']}")
        assert got["max_rel"] < 1e-6 and got["state_rel"] < 1e-6 and got["same_state_keys"], got
    assert all(len(o) > 0 for o in per_rank[0]["owners"])  # every unit laid out by owner
    owned = [r["owned"] for r in per_rank]
    assert [sum(col) for col in zip(*owned)] == [len(o) for o in per_rank[0]["owners"]]  # each tensor once
    if stage == 3:
        assert any(n == 0 for row in owned for n in row)  # some rank owns nothing of some unit
