"""Bodies run on every rank by tests/offload/test_offload.py: an offloaded engine against the same engine without
offload, step by step (importable by spawned processes)."""

from __future__ import annotations

import torch
from torch import nn

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.engine.mixed_precision import PrecisionPolicy
from _engine_cases import Net


def _run(rank: int, cfg: dict, offload: bool) -> tuple[list[torch.Tensor], list[float], ZeroEngine]:
    torch.manual_seed(0)
    model = Net(width=24, depth=3)
    if cfg.get("freeze"):  # a frozen layer: at stage 3 a frozen unit of its own (in a file under NVMe)
        model.inp.requires_grad_(False)
    fused = cfg.get("fused")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **({"fused": fused} if fused is not None else {}))
    options = {}
    if offload:
        if cfg.get("nvme"):
            options["offload_optimizer"] = {"device": "nvme", "nvme_path": cfg["nvme"], "ratio": cfg.get("ratio", 1.0),
                                             "pipeline_read": cfg.get("pipeline", False),
                                             "pipeline_write": cfg.get("pipeline", False),
                                             "buffer_count": cfg.get("buffer_count", 4)}
        elif cfg.get("offload_optimizer", True):
            options["offload_optimizer"] = {"device": "cpu", "ratio": cfg.get("ratio", 1.0)}
        if cfg.get("nvme_param"):
            options["offload_param"] = {"device": "nvme", "nvme_path": cfg["nvme_param"],
                                        "max_in_cpu": cfg.get("max_in_cpu", 0)}
        elif cfg["stage"] == 3 and cfg.get("offload_param", True):
            options["offload_param"] = "cpu"
        if "sub_group_size" in cfg:
            options["sub_group_size"] = cfg["sub_group_size"]
    policy = PrecisionPolicy(torch.bfloat16, torch.float32) if cfg.get("bf16") else None
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=cfg["stage"], reduce_bucket_size=cfg.get("bucket", 300),
                                                 unit_modules=("Linear",) if cfg["stage"] == 3 else None, **options),
                        policy)
    zopt = ZeroOptimizer(opt, engine, 0)
    gen = torch.Generator().manual_seed(7 + rank)
    acc = cfg.get("acc", 1)
    losses = []
    for step in range(cfg.get("steps", 10)):
        if step == cfg.get("pin_fails_at"):  # from now on pinning fails, and the persistent buffers are new
            for store in engine.stores:
                if store.name == "cpu":
                    store.pin = True  # as on CUDA
                    store._grads.clear()
                    store._pinned = _cannot_pin
        for micro in range(acc):
            x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
            engine.gather_root()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(cfg.get("bf16"))):
                loss = nn.functional.mse_loss(model(x).float(), y) / acc
            with (torch.enable_grad() if micro == acc - 1 else engine.no_sync()):
                loss.backward()
            losses.append(loss.item())
        if cfg.get("clip"):
            engine.clip_grad_norm_(engine.units, cfg["clip"])
        zopt.step()
        zopt.zero_grad()
    if engine.mixed:
        from lzero.checkpoint.state_dict import restore_masters
        restore_masters(engine)
    else:
        engine.unshard()
    params = [p.detach().clone() for p in model.parameters()]
    return params, losses, engine


def _cannot_pin(nbytes: int) -> torch.Tensor:
    raise RuntimeError(f"injected: cannot page-lock {nbytes} bytes")


def pinned_failure_mid_run(rank: int, world_size: int, stage: int) -> dict:
    """An offloaded run whose pinned staging allocations start failing at step 4, against the same run without
    the failure: the store falls back to pageable buffers with one warning, and training goes on unchanged."""
    import warnings

    cfg = {"stage": stage, "steps": 8}
    reference, ref_losses, engine = _run(rank, cfg, offload=True)
    engine.remove()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, losses, engine = _run(rank, {**cfg, "pin_fails_at": 4}, offload=True)
    engine.remove()
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(params, reference)) and losses == ref_losses,
            "warnings": [str(w.message) for w in caught if "pinned host memory" in str(w.message)]}


def offloaded_vs_device(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    results = []
    for cfg in configs:
        ref, ref_losses, ref_engine = _run(rank, cfg, offload=False)
        ref_engine.remove()
        got, losses, engine = _run(rank, cfg, offload=True)
        stores = sorted({u.store.name for u in engine.units})
        param_stores = sorted({u.param_store.name for u in engine.units})
        engine.remove()
        results.append({
            "bitwise": all(torch.equal(a, b) for a, b in zip(got, ref)) and losses == ref_losses,
            "max_rel": max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)),
            "stores": stores, "param_stores": param_stores,
        })
    return results


def _three_steps(config: ZeroConfig) -> tuple[ZeroEngine, ZeroOptimizer]:
    """A 6-layer Net (width 96) under ``config`` after 3 fp32 AdamW steps (between steps)."""
    torch.manual_seed(0)
    model = Net(width=96, depth=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], config)
    zopt = ZeroOptimizer(opt, engine, 0)
    x, y = torch.randn(2, 7), torch.randn(2, 5)
    for _ in range(3):
        engine.gather_root()
        nn.functional.mse_loss(model(x), y).backward()
        zopt.step()
        zopt.zero_grad()
    return engine, zopt


def memory_by_store(rank: int, world_size: int, stage: int) -> dict:
    """After 3 offloaded fp32 AdamW steps (between steps): the accounting by store and kind, the sizes the
    formulas need, and the live tensor bytes of the process."""
    import gc

    from _engine_cases import live_tensor_bytes
    from lzero.memory.accounting import model_state_bytes

    options = {"offload_optimizer": "cpu", **({"offload_param": "cpu"} if stage == 3 else {})}
    engine, zopt = _three_steps(ZeroConfig(stage=stage, reduce_bucket_size=20_000,
                                           unit_modules=("Linear",) if stage == 3 else None, **options))
    gc.collect()
    result = {
        "by_store": model_state_bytes(engine, [zopt]),
        "live": live_tensor_bytes(),
        "padded": sum(u.spec.padded_numel for u in engine.units),
        "shard": sum(u.spec.shard_numel for u in engine.units),
        "largest_shard": max(u.spec.shard_numel for u in engine.units),
        "units": len(engine.units),
        # no host tensor shares memory with a device parameter
        "aliased": any(u.master_shard.data_ptr() == u.flat_param.data_ptr() + u.spec.shard_range(rank)[0] * 4
                       for u in engine.units if u.gathered),
    }
    engine.remove()
    return result


def nvme_memory(rank: int, world_size: int, folder: str) -> dict:
    """zero3 with the optimizer on NVMe, after 3 fp32 AdamW steps: memory by store, the swap folder while the
    engine lives, and what is left of it after ``remove``."""
    import gc
    import os

    from _engine_cases import live_tensor_bytes
    from lzero.memory.accounting import model_state_bytes

    engine, zopt = _three_steps(ZeroConfig(stage=3, unit_modules=("Linear",), schedule="min_memory",  # shards only
                                           offload_optimizer={"device": "nvme", "nvme_path": folder}))
    gc.collect()
    store = next(s for s in engine.stores if s.name == "nvme")
    files = sorted(os.listdir(store.files.folder))
    modes = {oct(os.stat(store.files.folder / f).st_mode & 0o777) for f in files}
    result = {"by_store": model_state_bytes(engine, [zopt]), "live": live_tensor_bytes(),
              "shard": sum(u.spec.shard_numel for u in engine.units), "units": len(engine.units),
              "files": files, "modes": sorted(modes), "folder": str(store.files.folder)}
    engine.remove()
    result["left"] = os.path.exists(result["folder"])
    return result
