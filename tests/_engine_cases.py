"""Bodies run on every rank by the engine tests (test_stage_equivalence, test_memory, test_stage3_gather,
test_reducer, test_engine_state_dicts, test_engine_precision, test_sharded_init); importable by spawned processes."""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.engine.mixed_precision import PrecisionPolicy


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
                                                     overlap_comm=cfg.get("overlap", True),
                                                     prefetch=cfg.get("prefetch"), schedule=cfg.get("schedule", "auto"),
                                                     gather_bucket_size=cfg.get("gather_bucket"),
                                                     unit_modules=("Linear",) if cfg["stage"] == 3 else None))
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
                engine.gather_root()
                with (torch.enable_grad() if last else engine.no_sync()):
                    (nn.functional.mse_loss(model(x, use_spare), y) / acc).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            zopt.step()
            zopt.zero_grad()
        engine.unshard()
        pairs = list(zip(model.parameters(), ref.module.parameters()))
        results.append({
            "bitwise": all(torch.equal(a, b) for a, b in pairs),
            "max_rel": max(((a - b).norm() / b.norm()).item() for a, b in pairs),
            "units": len(engine.units),
            "kept": None if engine.auto_schedule is None else  # blocks schedule="auto" chose to keep gathered
            engine.auto_schedule.record["persistent_blocks"] + engine.auto_schedule.record["kept_blocks"],
        })
        engine.remove()
    return results


def count_live_peak(gatherer: Any) -> list[int]:
    """``[peak]``: from now on, the most parameter elements ``gatherer`` holds gathered, sampled at every launch (the
    caller may lower or reset it between steps)."""
    peak, launch = [0], gatherer.launch

    def counted(block: str, **kwargs: Any) -> None:
        launch(block, **kwargs)
        peak[0] = max(peak[0], gatherer.live_numel())

    gatherer.launch = counted
    return peak


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable by the garbage collector, each storage counted once;
    the least of a few samples, because gloo's worker thread drops its reference to a finished
    collective's buffer a moment after ``wait()`` returns."""
    import time

    samples = []
    for _ in range(3):
        gc.collect()
        samples.append(_live_tensor_bytes_once())
        time.sleep(0.01)
    return min(samples)


def _live_tensor_bytes_once() -> int:
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


def memory_after_backward(rank: int, world_size: int, stage: int, bucket: int,
                          param_dtype: torch.dtype | None = None) -> dict:
    """Live tensor bytes after the backward of step 3 (optimizer state exists), before its step, and after that
    step (between steps).
    With ``param_dtype=torch.bfloat16``: bf16 working parameters, fp32 masters (bf16-mixed)."""
    torch.manual_seed(0)
    model = Net(width=96, depth=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = PrecisionPolicy(param_dtype, torch.float32) if param_dtype is not None else None
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, reduce_bucket_size=bucket), policy)
    zopt = ZeroOptimizer(opt, engine, 0)
    x, y = torch.randn(2, 7), torch.randn(2, 5)
    measured = 0
    between = 0
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        if step == 2:
            gc.collect()
            measured = live_tensor_bytes()
        zopt.step()
        zopt.zero_grad()
        del loss
        if step == 2:
            between = live_tensor_bytes()
    psi = sum(p.numel() for p in model.parameters())
    result = {"bytes": measured, "between": between, "psi": psi, "padding": engine.partition.padding_numel,
              "units": len(engine.units)}
    engine.remove()
    return result


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class Deep(nn.Module):
    """8 blocks between a tied embedding and head: 8 block units and a root unit."""

    def __init__(self, vocab: int = 64, width: int = 48, depth: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def param_storage_bytes(model: nn.Module, buffers: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the module's parameters and the given flat buffers
    (a prefetched unit's buffer is filled before its parameters point at it), as they are now."""
    storages = [t.untyped_storage() for t in [*model.parameters(), *buffers]]
    return sum({st.data_ptr(): st.nbytes() for st in storages if st.nbytes()}.values())


def stage3_memory(rank: int, world_size: int, prefetch: int) -> dict:
    """Peak parameter storage during forward/backward, and live bytes between steps."""
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, prefetch=prefetch, schedule="min_memory"))
    zopt = ZeroOptimizer(opt, engine, 0)
    peak = [0]

    flat_buffers = [u.flat_param for u in engine.units]

    def probe(*_: object) -> None:
        peak[0] = max(peak[0], param_storage_bytes(model, flat_buffers))

    hooks = [m.register_forward_pre_hook(probe) for m in model.modules()]
    hooks += [m.register_forward_hook(probe) for m in model.modules()]
    hooks += [p.register_post_accumulate_grad_hook(probe) for p in model.parameters()]
    x, y = torch.randint(0, 64, (4, 3)), torch.randint(0, 64, (4,))
    between = []
    for step in range(3):
        engine.gather_root()
        nn.functional.cross_entropy(model(x), y).backward()
        zopt.step()
        zopt.zero_grad()
        if step == 2:
            between.append(live_tensor_bytes())
    for h in hooks:
        h.remove()
    blocks = engine.gatherer.blocks
    unit_bytes = {name: sum(u.spec.padded_numel * 4 for u in b.units) for name, b in blocks.items()}
    result = {
        "peak_params": peak[0], "between": between[-1], "units": len(engine.units),
        "root_bytes": unit_bytes[""], "max_block_bytes": max(v for k, v in unit_bytes.items() if k),
        "psi": sum(p.numel() for p in model.parameters()), "padding": engine.partition.padding_numel,
        "full_bytes": 4 * sum(p.numel() for p in model.parameters()),
    }
    engine.remove()
    return result


def stage3_unit_on_some_ranks(rank: int, world_size: int) -> str:
    """Rank 1 skips a sharded Linear that rank 0 runs: every rank must get an error naming it."""
    from lzero.engine.unit_order import UnitOrderError

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, unit_modules=("Linear",), unit_order_timeout_s=20,
                                                  schedule="min_memory"))  # persistent blocks gather no unit
    x, y = torch.randn(4, 7), torch.randn(4, 5)
    try:
        nn.functional.mse_loss(model(x, use_spare=rank == 0), y).backward()
    except UnitOrderError as err:
        return str(err)
    return "no error"


def stage3_unit_skipped_after_recording(rank: int, world_size: int) -> str:
    """Three steps agree (the order is recorded, order checks start ahead), then rank 1 skips a unit: every rank
    must get the error naming it, before a mismatched all-gather is launched."""
    from lzero.engine.unit_order import UnitOrderError

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, unit_modules=("Linear",), unit_order_timeout_s=20,
                                                  schedule="min_memory"))  # persistent blocks gather no unit
    zopt = ZeroOptimizer(opt, engine, 0)
    x, y = torch.randn(4, 7), torch.randn(4, 5)
    for step in range(4):
        try:
            engine.gather_root()
            nn.functional.mse_loss(model(x, use_spare=rank == 0 or step < 3), y).backward()
        except UnitOrderError as err:
            return f"step {step}: {err}"
        zopt.step()
        zopt.zero_grad()
    return "no error"


def stage3_gathered_parameters(rank: int, world_size: int) -> dict:
    """Full access to one sharded block outside forward; a write is carried back to the shards."""
    torch.manual_seed(0)
    model = Deep()
    expected = model.blocks[3].fc.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3))
    released_numel = model.blocks[3].fc.weight.untyped_storage().nbytes()  # the shared NaN placeholder
    from lzero.engine.parameters import ReleasedParameterError

    stray = []
    for touch in (lambda w: w.sum(), lambda w: w.add_(1.0), lambda w: copy.deepcopy(w), lambda w: w.data.clone()):
        try:
            touch(model.blocks[3].fc.weight)
            stray.append("no error")
        except ReleasedParameterError as err:
            stray.append(str(err))
    with engine.gathered(model.blocks[3]):
        seen = torch.equal(model.blocks[3].fc.weight, expected)
        others_released = model.blocks[2].fc.weight.untyped_storage().nbytes() <= 4
        with torch.no_grad():
            model.blocks[3].fc.weight.add_(1.0)
    after_exit = model.blocks[3].fc.weight.untyped_storage().nbytes()
    engine.unshard()
    carried = torch.equal(model.blocks[3].fc.weight, expected + 1.0)
    engine.remove()
    return {"released_before": released_numel <= 4, "seen_full": seen, "others_released": others_released,
            "released_after": after_exit <= 4, "write_carried": carried,
            "stray_access_refused": all("`blocks.3.fc.weight`" in e and "gathered_parameters" in e for e in stray)}


def rss_bytes() -> int:
    """Resident anonymous memory (heap, tensors): not the pages of shared libraries, which a rank forked from a
    server that loaded them faults in again as it first runs each kernel."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def stage3_sharded_init(rank: int, world_size: int) -> dict:
    """A model built on the meta device, materialized block by block: RSS growth vs full size."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    with torch.device("meta"):
        model = Deep(vocab=256, width=1024, depth=8)  # ~8.7M params: 35 MB in fp32
    full_bytes = 4 * sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    libc.malloc_trim(0)
    before = rss_bytes()
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3))
    gc.collect()
    libc.malloc_trim(0)
    growth = rss_bytes() - before
    with engine.gathered(model):  # the materialized initial weights, to train a plain copy from
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    zopt = ZeroOptimizer(opt, engine, 0)
    gen = torch.Generator().manual_seed(5)  # the same batch on every rank: the average is that batch's gradient
    x, y = torch.randint(0, 256, (16, 3), generator=gen), torch.randint(0, 256, (16,), generator=gen)
    losses = []
    for _ in range(4):
        engine.gather_root()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        losses.append(loss.item())
    engine.unshard()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = flat.clone()
    torch.distributed.broadcast(rank0, src=0)
    engine.remove()
    ref = Deep(vocab=256, width=1024, depth=8)
    ref.load_state_dict(initial, strict=False)  # head.weight is tied to embed.weight
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    ref_losses = []
    for _ in range(4):
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    max_rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"full_bytes": full_bytes, "growth": growth, "losses": losses, "ref_losses": ref_losses,
            "max_rel": max_rel, "same_as_rank0": torch.equal(flat, rank0), "tied": model.head.weight is model.embed.weight,
            "initial_std": {n: v.std().item() for n, v in initial.items() if v.dim() == 2}}


class Reused(nn.Module):
    """A block called twice per forward, and a block under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.blocks[0](self.blocks[0](self.embed(x)))  # the same module twice
        h = checkpoint(self.blocks[1], h, use_reentrant=False) if checkpointed else self.blocks[1](h)
        return self.out(self.blocks[2](h))


def stage3_reuse_and_checkpointing(rank: int, world_size: int) -> dict:
    """Stage 3 with a module called twice and activation checkpointing, against DDP without it."""
    torch.manual_seed(3)
    model = Reused()
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, unit_modules=("Block",)))
    zopt = ZeroOptimizer(opt, engine, 0)
    gen = torch.Generator().manual_seed(11 + rank)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
        nn.functional.mse_loss(ref(x, False), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.gather_root()
        nn.functional.mse_loss(model(x, True), y).backward()
        assert engine.gatherer.gathered_names() == []
        zopt.step()
        zopt.zero_grad()
    engine.unshard()
    pairs = list(zip(model.parameters(), ref.module.parameters()))
    engine.remove()
    return {"bitwise": all(torch.equal(a, b) for a, b in pairs),
            "max_rel": max(((a - b).norm() / b.norm()).item() for a, b in pairs)}


def stage3_state_dicts(rank: int, world_size: int) -> dict:
    """Sharded and consolidated state dicts against the plain state_dict of the same model."""
    from lzero.checkpoint.state_dict import ShardedTensor, consolidate, sharded_state_dict

    torch.manual_seed(0)
    model = Deep()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
    sharded = sharded_state_dict(engine, model)
    pieces_differ = []  # keys whose pieces, gathered from every rank, differ from the reference
    for key, value in sharded.items():
        if isinstance(value, ShardedTensor):
            start, local = value.local_shard()
            pieces = [None] * world_size
            torch.distributed.all_gather_object(pieces, (start, local.tolist()))
            rebuilt = torch.zeros(value.shape.numel())
            for s0, vals in pieces:
                rebuilt[s0 : s0 + len(vals)] = torch.tensor(vals)
            if not torch.equal(rebuilt.view(value.shape), reference[key]):
                pieces_differ.append(key)
    full_tensor_differs = [k for k, v in sharded.items()
                           if isinstance(v, ShardedTensor) and not torch.equal(v.full_tensor(), reference[k])]
    still_gathered = engine.gatherer.gathered_names()
    full = consolidate(engine, sharded)
    result = {
        "keys": list(sharded), "reference_keys": list(reference),
        "shapes": {k: tuple(v.shape) for k, v in sharded.items()},
        "reference_shapes": {k: tuple(v.shape) for k, v in reference.items()},
        "tied_same_object": sharded["embed.weight"] is sharded["head.weight"],
        "pieces_differ": pieces_differ, "full_tensor_differs": full_tensor_differs, "still_gathered": still_gathered,
        "consolidated_keys": list(full),  # rank 0 only; the others get {}
        "consolidated_differ": [k for k in full if not torch.equal(full[k], reference[k])],
    }
    engine.remove()
    return result


def bf16_against_ddp(rank: int, world_size: int, stages: tuple[int, ...] = (1, 2, 3)) -> dict:
    """20 AdamW steps per precision mode against DDP: "mixed" (bf16 working parameters, fp32 masters)
    and "autocast" (fp32 parameters) against DDP under bf16 autocast; "true" (all bf16) against DDP
    on a bf16 model."""
    results = {}
    for stage in stages:
        for mode in ("mixed", "kept", "autocast", "true"):
            torch.manual_seed(1000 + rank)
            model = Deep(width=32, depth=4)
            if mode == "true":
                model = model.to(torch.bfloat16)
            ref = DDP(copy.deepcopy(model))
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            kept = ("Embedding", "LayerNorm") if mode == "kept" else ()
            policy = PrecisionPolicy(torch.bfloat16, torch.float32, kept) if mode in ("mixed", "kept") else None
            engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage), policy)
            zopt = ZeroOptimizer(opt, engine, 0)
            gen = torch.Generator().manual_seed(21 + rank)
            diffs = []
            for _ in range(20):
                x, y = torch.randint(0, 64, (64, 3), generator=gen), torch.randint(0, 64, (64,), generator=gen)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "true"):
                    ref_loss = nn.functional.cross_entropy(ref(x).float(), y)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                engine.gather_root()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "true"):
                    loss = nn.functional.cross_entropy(model(x).float(), y)
                loss.backward()
                zopt.step()
                zopt.zero_grad()
                diffs.append(abs(loss.item() - ref_loss.item()))
            engine.unshard()
            pairs = list(zip(model.parameters(), ref.module.parameters()))
            results[(stage, mode)] = {
                "worst_loss_diff": max(diffs), "first_loss": diffs and ref_loss.item(),
                "masters": sorted({str(u.master_shard.dtype) for u in engine.units}),
                "params": sorted({str(p.dtype) for p in model.parameters()}),
                "max_rel": max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in pairs),
            }
            engine.remove()
    return results


def equivalence(rank: int, world_size: int, configs: list[dict]) -> dict:
    """tests/engine/test_stage_equivalence.py: every config against DDP, and stage 3 with module reuse."""
    return {"ddp": against_ddp(rank, world_size, configs), "reuse": stage3_reuse_and_checkpointing(rank, world_size)}


def stage3_bf16_between_steps(rank: int, world_size: int) -> dict:
    """bf16-mixed stage 3: live bytes after the third step (bf16 shard, fp32 master, Adam; no gradient)."""
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, schedule="min_memory"),  # no block kept between steps
                        PrecisionPolicy(torch.bfloat16, torch.float32))
    zopt = ZeroOptimizer(opt, engine, 0)
    x, y = torch.randint(0, 64, (4, 3)), torch.randint(0, 64, (4,))
    for _ in range(3):
        engine.gather_root()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        del loss
    result = {"between": live_tensor_bytes(), "psi": sum(p.numel() for p in model.parameters()),
              "padding": engine.partition.padding_numel}
    engine.remove()
    return result


def memory(rank: int, world_size: int, bucket: int, stages_1_2: bool) -> dict:
    """tests/memory/test_memory.py: live bytes at stages 1-2 (fp32 and bf16-mixed), stage-3 peaks and totals."""
    result = {"stage3": {prefetch: stage3_memory(rank, world_size, prefetch) for prefetch in (0, 1, 2)},
              "stage3_bf16": stage3_bf16_between_steps(rank, world_size)}
    if stages_1_2:
        result["fp32"] = {stage: memory_after_backward(rank, world_size, stage, bucket) for stage in (1, 2)}
        result["bf16"] = {stage: memory_after_backward(rank, world_size, stage, bucket, torch.bfloat16)
                          for stage in (1, 2)}
    return result


def stage3_gather(rank: int, world_size: int) -> dict:
    """tests/engine/test_stage3_gather.py: the block state machine, gathered_parameters and (last: it leaves the
    engine mid-step) a unit run on only some ranks."""
    result = {"gathered": stage3_gathered_parameters(rank, world_size)}
    if world_size == 2:
        result["states"] = stage3_block_states(rank, world_size)
        b = sum(p.numel() for p in Block(48).parameters())  # elements of one block of Deep()
        result["block_numel"] = b
        result["schedules"] = {name: stage3_block_states(rank, world_size, **knobs) for name, knobs in {
            "bucket": dict(prefetch_bucket_size=b + b // 2),  # 1.5 blocks: two blocks ahead
            "live": dict(prefetch=2, max_live_parameters=3072 + 2 * b),  # root + 2 blocks: one ahead, not two
            "reuse": dict(max_reuse_distance=2 * b + 1),  # blocks 3 (distance 0) and 2 (2b) kept
            "reuse_live": dict(max_reuse_distance=10 * b, max_live_parameters=3072 + b + b // 2),  # 3 kept, no prefetch
            "persist": dict(param_persistence_threshold=b, prefetch=0),
            "run": dict(gather_bucket_size=4 * b),  # the four blocks: one run, one all-gather each way
        }.items()}
        result["penalty"] = stage3_gradient_penalty(rank, world_size)
        result["partial"] = stage3_unit_on_some_ranks(rank, world_size)
    return result


def stage3_gradient_penalty(rank: int, world_size: int) -> dict:
    """A gradient penalty (``torch.autograd.grad`` with ``create_graph`` through the blocks, then ``backward()``)
    at stage 3 against the plain model: every rank trains on the same batch, so the average is that batch's
    gradient. Three steps; max |difference| of the parameters and whether they are bitwise equal."""
    torch.manual_seed(0)
    model = Deep(depth=4)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, gather_bucket_size=8 * 2448))
    zopt = ZeroOptimizer(opt, engine, 0)
    gen = torch.Generator().manual_seed(3)

    def loss_of(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h0 = m.embed(x).mean(1)
        h = h0
        for block in m.blocks:
            h = block(h)
        (slope,) = torch.autograd.grad(h.square().sum(), h0, create_graph=True)
        return nn.functional.cross_entropy(m.head(h), y) + 0.1 * slope.square().mean()

    for _ in range(3):
        x, y = torch.randint(0, 64, (4, 3), generator=gen), torch.randint(0, 64, (4,), generator=gen)
        loss_of(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.gather_root()
        loss_of(model, x, y).backward()
        zopt.step()
        zopt.zero_grad()
    engine.unshard()
    pairs = list(zip(model.parameters(), ref.parameters()))
    result = {"bitwise": all(torch.equal(a, b) for a, b in pairs),
              "max_abs": max((a - b).abs().max().item() for a, b in pairs)}
    engine.remove()
    return result


def stage3_block_states(rank: int, world_size: int, **schedule: Any) -> dict:
    """Every block's state seen from inside forward and backward of the second step (the first one
    records the order): by default the computing block gathered, the next ``prefetch`` launched, the rest
    released; ``schedule``: ZeroConfig's gather-schedule knobs. Also the parameters after the two steps."""
    from lzero.engine.blocks import BlockState

    torch.manual_seed(0)
    model = Deep(depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, **{"schedule": "min_memory", **schedule}))
    zopt = ZeroOptimizer(opt, engine, 0)
    blocks = engine.gatherer.blocks
    names = [f"blocks.{i}" for i in range(4)]
    seen: dict[str, list] = {"forward": [], "backward": [], "after_root_gather": None, "after_backward": None}

    def states() -> dict[str, str]:
        return {n: blocks[n].state.name for n in ["", *names]}

    hooks = [model.blocks[i].register_forward_pre_hook(lambda m, a, i=i: seen["forward"].append((i, states())))
             for i in range(4)]
    hooks += [model.blocks[i].fc.weight.register_post_accumulate_grad_hook(
        lambda p, i=i: seen["backward"].append((i, states()))) for i in range(4)]
    x, y = torch.randint(0, 64, (4, 3)), torch.randint(0, 64, (4,))
    for step in range(2):
        seen["forward"].clear()
        seen["backward"].clear()
        engine.gather_root()
        seen["after_root_gather"] = states()
        nn.functional.cross_entropy(model(x), y).backward()
        seen["after_backward"] = states()
        zopt.step()
        zopt.zero_grad()
    for h in hooks:
        h.remove()
    engine.unshard()
    seen["params"] = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}  # exact floats
    engine.remove()
    assert BlockState.GATHERED.name == "GATHERED"
    return seen


def reducer_order(rank: int, world_size: int) -> dict:
    """Rank 1 skips the ``spare`` layer: every rank launches the same units in unit order, each shard gets
    the average of the ranks' gradients (zeros for what a rank lacks), and a layer no rank used keeps no
    gradient. Stage 2, one parameter per unit."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, reduce_bucket_size=1, max_inflight_reductions=1))
    launched = []
    original = engine.reducer.launch

    def logging_launch(unit):
        launched.append(unit.spec.index)
        return original(unit)

    engine.reducer.launch = logging_launch
    try:
        gen = torch.Generator().manual_seed(3 + rank)
        x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
        use_spare = rank == 0
        nn.functional.mse_loss(model(x, use_spare), y).backward()
        engine.wait()
        # reference: each rank's full gradients, averaged over ranks (what DDP holds)
        nn.functional.mse_loss(ref(x, use_spare), y).backward()
        expected_ok, no_grad_units = True, []
        for unit in engine.units:
            full = torch.zeros(unit.spec.padded_numel)
            for spec, start, end in unit.spec.param_ranges():
                p = ref.get_parameter(spec.name)
                if p.grad is not None:
                    full[start:end] = p.grad.reshape(-1)
            dist.all_reduce(full)
            lo, hi = unit.spec.shard_range(rank)
            if unit.master_shard.grad is None:
                no_grad_units.append(unit.spec.index)
            else:
                expected_ok &= torch.allclose(unit.master_shard.grad, full[lo:hi] / world_size, rtol=0, atol=1e-7)
        # a second backward where no rank uses ``spare``: its unit is not reduced, keeps no gradient
        engine.zero_grad(engine.units)
        launched_before = len(launched)
        nn.functional.mse_loss(model(x, False), y).backward()
        engine.wait()
        spare_units = [u.spec.index for u in engine.units if any(s.name.startswith("spare.") for s in u.spec.params)]
        spare_no_grad = all(engine.units[i].master_shard.grad is None for i in spare_units)
        second = launched[launched_before:]
    finally:
        engine.remove()
    return {"launched": launched[:launched_before], "second": second, "units": len(engine.units),
            "expected_ok": expected_ok, "no_grad_units": no_grad_units, "spare_units": spare_units,
            "spare_no_grad": spare_no_grad}
