"""CUDA sanity check of offload: the host store's copies on a real GPU, against the same engine without offload.

World size 1 over NCCL (``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1``, so reduce-scatters and all-gathers run
through NCCL), a small demo GPT on CUDA, torch AdamW with ``fused=True`` (the offloaded units step with
torch's fused CPU kernel, the device units with its fused CUDA kernel), 10 steps. For zero2 and zero3, in
fp32 and bf16-mixed, it checks that:

- the offloaded run's parameters and losses are bitwise those of the run without offload (max|diff| printed);
- every host tensor the store keeps is page-locked: masters, landed gradients, offloaded parameter shards;
- the store never fell back to pageable memory (no warning);
- zero3_offload keeps less on the GPU between steps than zero3.

    PYTHONPATH=. python3 benchmarks/cuda_offload_check.py

Exit status: 0 every check passed, 1 some check failed (each failure printed), 2 no CUDA (nothing checked).
"""

from __future__ import annotations

import os

os.environ.setdefault("LZERO_COLLECTIVES_AT_WORLD_SIZE_1", "1")  # read when lzero.engine.collectives is imported
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")

import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

STEPS = 10


@dataclass
class Run:
    params: list[torch.Tensor]
    losses: list[float]
    between_steps_bytes: int  # torch.cuda.memory_allocated after the last step, before the engine is removed
    unpinned: list[str] = field(default_factory=list)  # host tensors of the store that are not page-locked
    warnings: list[str] = field(default_factory=list)


def train(stage: int, bf16: bool, offload: bool) -> Run:
    from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
    from lzero.checkpoint.state_dict import restore_masters
    from lzero.demo import GPT, GPTConfig
    from lzero.engine.mixed_precision import PrecisionPolicy

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    options = {}
    if offload:
        options["offload_optimizer"] = "cpu"
        if stage == 3:
            options["offload_param"] = "cpu"
    policy = PrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, reduce_bucket_size=20_000, **options), policy,
                            device=device)
        zopt = ZeroOptimizer(opt, engine, 0)
        gen = torch.Generator().manual_seed(7)
        losses, unpinned = [], []
        for step in range(STEPS):
            x = torch.randint(0, 256, (4, 16), generator=gen).to(device)
            y = torch.randint(0, 256, (4, 16), generator=gen).to(device)
            engine.gather_root()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            if step == 0 and offload:
                engine.wait()  # the gradients have landed in host memory
                unpinned = host_tensors_not_pinned(engine)
            losses.append(loss.item())
            zopt.step()
            zopt.zero_grad()
        torch.cuda.synchronize()
        between = torch.cuda.memory_allocated(device)
        if offload:
            unpinned += host_tensors_not_pinned(engine)
        if engine.mixed:
            restore_masters(engine)
        else:
            engine.unshard()
        params = [p.detach().clone() for p in model.parameters()]
        engine.remove()
    pin_warnings = [str(w.message) for w in caught if "pinned" in str(w.message)]
    return Run(params, losses, between, unpinned, pin_warnings)


def host_tensors_not_pinned(engine) -> list[str]:
    """What is wrong with the host store's pinning: it copies through page-locked staging buffers (the state itself
    stays pageable, see [Note: host store copies]); every staging buffer must be pinned and pinning still on."""
    found = []
    stores = [s for s in engine.stores if s.name == "cpu"]
    if not stores or not all(getattr(s, "pin", False) for s in stores):
        found.append("the host store is not pinning (pin is off or no host store)")
    for store in stores:
        for buffer in store._free:
            if not buffer.is_pinned():
                found.append(f"a staging buffer of {buffer.numel():,} bytes is not pinned")
        if not store._free:
            found.append("the host store holds no staging buffer after a step (nothing went through it?)")
    return found


def check(stage: int, bf16: bool) -> list[str]:
    name = f"zero{stage}_offload vs zero{stage}, {'bf16-mixed' if bf16 else 'fp32'}"
    ref = train(stage, bf16, offload=False)
    got = train(stage, bf16, offload=True)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got.params, ref.params))
    rel = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got.params, ref.params))
    bitwise = all(torch.equal(a, b) for a, b in zip(got.params, ref.params)) and got.losses == ref.losses
    print(f"{name}: bitwise {bitwise}, max|diff| {diff:.3e}, max relative {rel:.3e}, GPU bytes between steps"
          f" {got.between_steps_bytes:,} offloaded vs {ref.between_steps_bytes:,}", flush=True)
    failures = []
    if not bitwise:
        failures.append(
            f"{name}: parameters or losses differ after {STEPS} steps (max|diff| {diff:.3e}, max relative {rel:.3e})."
            " The device step ran torch's fused CUDA AdamW and the host step its fused CPU AdamW: a relative difference"
            " near 1e-7 means those kernels round differently at the last bit; a larger one means data moved wrongly.")
    failures += [f"{name}: not page-locked: {what}" for what in got.unpinned]
    failures += [f"{name}: pinned memory fell back to pageable: {w}" for w in got.warnings]
    if stage == 3 and got.between_steps_bytes >= ref.between_steps_bytes:
        failures.append(f"{name}: {got.between_steps_bytes:,} bytes on the GPU between steps, not fewer than"
                        f" zero3's {ref.between_steps_bytes:,}")
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA: nothing checked (benchmarks/cuda_offload_check.py needs a CUDA GPU)", file=sys.stderr)
        return 2
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()},"
          f" LZERO_COLLECTIVES_AT_WORLD_SIZE_1={os.environ['LZERO_COLLECTIVES_AT_WORLD_SIZE_1']}", flush=True)
    failures = []
    try:
        for stage in (2, 3):
            for bf16 in (False, True):
                failures += check(stage, bf16)
    finally:
        dist.destroy_process_group()
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
