"""Bodies run on every rank by tests/engine/test_delayed_update.py (importable by spawned processes)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from _engine_cases import Net

STEPS = 5


def _adamw(params) -> torch.optim.Optimizer:
    # torch's for-loop kernel on both sides (the host runs the user's kernel with fused=False): the fused one
    # rounds an element by where it falls in its tensor's vector lanes, and shards start elsewhere than parameters
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=False)


def delayed_against_reference(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    """For each config: ``STEPS`` steps of an engine with ``delayed_update`` against a DDP reference that runs the
    delay by hand. The reference computes each step's gradients with DDP at its published parameters, steps a
    separate copy (its masters) with them, and publishes the masters as they were before that step:

        g(t) at published = m(t-1);  m(t+1) = AdamW(m(t), g(t));  published = m(t)

    Returns, per step, whether the engine's parameters (stages 1-2: what the next forward uses) equal the
    reference's published ones, and at the end, after a flush, whether they equal the reference's masters."""
    results = []
    for cfg in configs:
        torch.manual_seed(1000 + rank)  # unseeded: every rank starts elsewhere, rank 0 wins
        model = Net()
        ref = DDP(copy.deepcopy(model))
        masters = copy.deepcopy(ref.module)
        ref_opt = _adamw(masters.parameters())
        opt = _adamw(model.parameters())
        stage = cfg["stage"]
        engine = ZeroEngine(model, [opt], ZeroConfig(
            stage=stage, reduce_bucket_size=cfg.get("bucket", 60),
            offload_optimizer={"device": "cpu", "delayed_update": cfg.get("delayed", True)},
            unit_modules=("Linear",) if stage == 3 else None))
        zopt = ZeroOptimizer(opt, engine, 0)
        gen = torch.Generator().manual_seed(7 + rank)
        acc, clip = cfg.get("acc", 1), cfg.get("clip")
        published_equal, published_rel = [], []
        for _ in range(STEPS):
            for micro in range(acc):
                x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
                last = micro == acc - 1
                with (torch.enable_grad() if last else ref.no_sync()):
                    (nn.functional.mse_loss(ref(x), y) / acc).backward()
                engine.gather_root()
                with (torch.enable_grad() if last else engine.no_sync()):
                    (nn.functional.mse_loss(model(x), y) / acc).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                engine.clip_grad_norm_(zopt.units, clip)
            before = [m.detach().clone() for m in masters.parameters()]
            for m, r in zip(masters.parameters(), ref.module.parameters()):
                m.grad = r.grad.clone()
            ref_opt.step()
            ref_opt.zero_grad()
            ref.zero_grad()
            with torch.no_grad():
                for r, b in zip(ref.module.parameters(), before):
                    r.copy_(b)
            zopt.step()
            zopt.zero_grad()
            if stage < 3:  # stage 3 holds shards between steps: compared once, at the end
                pairs = list(zip(model.parameters(), ref.module.parameters()))
                published_equal.append(all(torch.equal(a, b) for a, b in pairs))
                published_rel.append(max(((a - b).norm() / b.norm()).item() for a, b in pairs))
        in_flight = engine.delayed is not None and engine.delayed.in_flight
        engine.flush_delayed_update()
        engine.unshard()
        pairs = list(zip(model.parameters(), masters.parameters()))
        results.append({
            "published_equal": published_equal,
            "published_rel": published_rel,
            "in_flight_before_flush": in_flight,
            "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "max_rel": max(((a - b).norm() / b.norm()).item() for a, b in pairs),
        })
        engine.remove()
    return results
