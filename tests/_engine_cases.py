"""Bodies run on every rank by tests/test_engine.py (importable by spawned processes)."""

from __future__ import annotations

import copy
import gc
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer


class Net(nn.Module):
    """Two param groups' worth of layers and a `spare` layer a rank may skip."""

    def __init__(self, width: int = 13, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.hidden = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.spare = nn.Linear(width, width)
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, use_spare: bool = True) -> torch.Tensor:
        h = self.hidden(torch.tanh(self.inp(x)))
        if use_spare:
            h = h + self.spare(h)
        return self.out(h)


def adamw(params) -> torch.optim.Optimizer:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)


def against_ddp(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    """For each config: 5 optimizer steps of DDP and of the engine from one unseeded init; the
    max relative parameter difference and whether they are bitwise equal."""
    results = []
    for cfg in configs:
        torch.manual_seed(1000 + rank)  # unseeded: every rank starts elsewhere, rank 0 wins
        model = Net()
        ref = DDP(copy.deepcopy(model), find_unused_parameters=cfg.get("rank_skips_spare", False))
        ref_opt = adamw(list(ref.parameters()))
        opt = adamw(list(model.parameters()))
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=cfg["stage"], reduce_bucket_size=cfg.get("bucket", 60),
                                                     overlap_comm=cfg.get("overlap", True)))
        zopt = ZeroOptimizer(opt, engine, 0)
        gen = torch.Generator().manual_seed(7 + rank)
        acc = cfg.get("acc", 1)
        for step in range(5):
            for micro in range(acc):
                x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
                use_spare = not (cfg.get("rank_skips_spare") and rank == 1)
                last = micro == acc - 1
                with (torch.enable_grad() if last else ref.no_sync()):
                    (nn.functional.mse_loss(ref(x, use_spare), y) / acc).backward()
                with (torch.enable_grad() if last else engine.no_sync()):
                    (nn.functional.mse_loss(model(x, use_spare), y) / acc).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            zopt.step()
            zopt.zero_grad()
        pairs = list(zip(model.parameters(), ref.module.parameters()))
        results.append({
            "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "max_rel": max(((a - b).norm() / b.norm()).item() for a, b in pairs),
            "units": len(engine.units),
        })
        engine.remove()
    return results


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable by the garbage collector, each storage counted once."""
    storages: dict[int, int] = {}
    warnings.simplefilter("ignore")  # isinstance() on torch.distributed's deprecated aliases warns
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:
            continue
    return sum(storages.values())


def memory_after_backward(rank: int, world_size: int, stage: int, bucket: int) -> dict:
    """Live tensor bytes after the backward of step 3 (optimizer state exists), before its step."""
    torch.manual_seed(0)
    model = Net(width=96, depth=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, reduce_bucket_size=bucket))
    zopt = ZeroOptimizer(opt, engine, 0)
    x, y = torch.randn(2, 7), torch.randn(2, 5)
    measured = 0
    for step in range(3):
        nn.functional.mse_loss(model(x), y).backward()
        if step == 2:
            gc.collect()
            measured = live_tensor_bytes()
        zopt.step()
        zopt.zero_grad()
    psi = sum(p.numel() for p in model.parameters())
    result = {"bytes": measured, "psi": psi, "padding": engine.partition.padding_numel, "units": len(engine.units)}
    engine.remove()
    return result


def everything(rank: int, world_size: int, ddp_configs: list[dict], memory_bucket: int) -> dict:
    """One process group per world size: DDP comparisons, then memory at stages 1 and 2."""
    return {
        "ddp": against_ddp(rank, world_size, ddp_configs),
        "memory": {stage: memory_after_backward(rank, world_size, stage, memory_bucket) for stage in (1, 2)},
    }
