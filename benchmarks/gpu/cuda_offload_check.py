"""CUDA sanity check of offload: the host store's copies on a real GPU, against the same engine without offload.

World size 1 over NCCL (``LZERO_COLLECTIVES_AT_WORLD_SIZE_1=1``, so reduce-scatters and all-gathers run
through NCCL), a small demo GPT on CUDA, 10 steps, deterministic CUDA algorithms, each case with two optimizers:

- SGD at lr 2**-6 without momentum or decay: ``lr * g`` is exact, so ``p - lr * g`` rounds once in any kernel
  (CPU or CUDA, with or without FMA). Offload must then be bitwise the run without it: any difference is data
  moved wrongly.
- AdamW with ``fused=True``: the offloaded units step with torch's fused CPU kernel, the device units with its
  fused CUDA kernel. Those round differently at the last bit, and Adam amplifies that over steps (its update
  divides by the gradient's own scale), so only the size of the difference is reported, beside the two kernels
  stepping identical tensors with identical gradients (the kernels' own difference, without amplification).

For zero2 and zero3, in fp32 and bf16-mixed, it checks that:

- with SGD the offloaded run's parameters and losses are bitwise those of the run without offload;
- every host tensor the store keeps is page-locked: masters, landed gradients, offloaded parameter shards;
- the store never fell back to pageable memory (no warning);
- zero3_offload keeps less on the GPU between steps than zero3 (bytes above what was allocated before the model
  was built; cuBLAS's workspace is allocated by a warm-up first). The largest CUDA tensors alive between steps
  are listed for the offloaded runs.

    python3 -m benchmarks.gpu.cuda_offload_check      # from the repository root; prints, writes nothing

Exit status: 0 every check passed, 1 some check failed (each failure printed), 2 no CUDA (nothing checked).
"""

from __future__ import annotations

import os

os.environ.setdefault("LZERO_COLLECTIVES_AT_WORLD_SIZE_1", "1")  # read when lzero.engine.collectives is imported
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.common import run_header

STEPS = 10


@dataclass
class Run:
    params: list[torch.Tensor]
    losses: list[float]
    between_steps_bytes: int  # torch.cuda.memory_allocated after the last step above the start, engine still there
    unpinned: list[str] = field(default_factory=list)  # host tensors of the store that are not page-locked
    warnings: list[str] = field(default_factory=list)
    largest: list[str] = field(default_factory=list)  # the largest CUDA tensors alive between steps


def live_cuda_tensors(top: int = 6) -> list[str]:
    import gc

    found = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = (storage.nbytes(), f"{tuple(obj.shape)} {obj.dtype}")
        except Exception:  # noqa: BLE001 - objects gc lists may be half-built
            continue
    largest = sorted(found.values(), reverse=True)[:top]
    return [f"{n:,} B {what}" for n, what in largest] + [f"{len(found)} storages, {sum(n for n, _ in found.values()):,} B"]


def train(stage: int, bf16: bool, offload: bool, optimizer: str) -> Run:
    from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
    from lzero.checkpoint.state_dict import restore_masters
    from lzero.demo import GPT, GPTConfig
    from lzero.engine.mixed_precision import PrecisionPolicy

    device = torch.device("cuda", 0)
    torch.cuda.synchronize()
    start_bytes = torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=64)).to(device)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=2**-6, momentum=0.0, weight_decay=0.0)
    else:
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
        between = torch.cuda.memory_allocated(device) - start_bytes
        largest = live_cuda_tensors() if offload else []
        if offload:
            unpinned += host_tensors_not_pinned(engine)
        if engine.mixed:
            restore_masters(engine)
        else:
            engine.unshard()
        params = [p.detach().clone() for p in model.parameters()]
        engine.remove()
    pin_warnings = [str(w.message) for w in caught if "pinned" in str(w.message)]
    return Run(params, losses, between, unpinned, pin_warnings, largest)


def host_tensors_not_pinned(engine) -> list[str]:
    """What is wrong with the host store's pinning: the buffers a GPU copies to and from (the persistent shard
    gradients, the outgoing compute-dtype copies, stage-3 parameter shards in host memory; see [Note: persistent
    host buffers]) must be page-locked, and pinning still on."""
    found = []
    stores = [s for s in engine.stores if s.name == "cpu"]
    if not stores or not all(getattr(s, "pin", False) for s in stores):
        found.append("the host store is not pinning (pin is off or no host store)")
    for store in stores:
        grads, outgoing = store.gradient_buffers(), list(store._outgoing.values())
        shards = [u.compute_shard() for u in engine.units if u.param_store is store]
        for what, buffers in (("gradient", grads), ("outgoing", outgoing), ("parameter shard", shards)):
            for buffer in buffers:
                if not buffer.is_pinned():
                    found.append(f"a {what} buffer of {buffer.numel():,} elements is not pinned")
        if not grads:
            found.append("the host store holds no gradient buffer after a step (nothing landed?)")
    return found


def check(stage: int, bf16: bool, optimizer: str) -> list[str]:
    name = f"zero{stage}_offload vs zero{stage}, {'bf16-mixed' if bf16 else 'fp32'}, {optimizer}"
    ref = train(stage, bf16, offload=False, optimizer=optimizer)
    got = train(stage, bf16, offload=True, optimizer=optimizer)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got.params, ref.params))
    rel = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got.params, ref.params))
    bitwise = all(torch.equal(a, b) for a, b in zip(got.params, ref.params)) and got.losses == ref.losses
    print(f"{name}: bitwise {bitwise}, max|diff| {diff:.3e}, max relative {rel:.3e}, GPU bytes between steps"
          f" {got.between_steps_bytes:,} offloaded vs {ref.between_steps_bytes:,}", flush=True)
    first = next((i for i, (a, b) in enumerate(zip(got.losses, ref.losses)) if a != b), None)
    print(f"  losses first differ at step {first}; offloaded {got.losses[-1]:.6f} vs {ref.losses[-1]:.6f} at the last",
          flush=True)
    for line in got.largest:
        print(f"  alive on the GPU between steps (offloaded): {line}", flush=True)
    failures = []
    if not bitwise and optimizer == "sgd":
        failures.append(
            f"{name}: parameters or losses differ after {STEPS} steps (max|diff| {diff:.3e}, max relative {rel:.3e})."
            " SGD at lr 2**-6 rounds alike in every kernel: data moved wrongly.")
    failures += [f"{name}: not page-locked: {what}" for what in got.unpinned]
    failures += [f"{name}: pinned memory fell back to pageable: {w}" for w in got.warnings]
    if stage == 3 and got.between_steps_bytes >= ref.between_steps_bytes:
        failures.append(f"{name}: {got.between_steps_bytes:,} bytes on the GPU between steps, not fewer than"
                        f" zero3's {ref.between_steps_bytes:,}")
    return failures


def kernels_alone(steps: int = STEPS) -> None:
    """torch's fused AdamW on CUDA and on the CPU, stepping identical fp32 tensors with identical gradients."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(1 << 16, generator=gen) * 0.02
    grads = [torch.randn(1 << 16, generator=gen) * 1e-3 for _ in range(steps)]
    params = {}
    for where in ("cuda", "cpu"):
        p = torch.nn.Parameter(p0.clone().to(where))
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=True)
        for g in grads:
            p.grad = g.to(where)
            opt.step()
        params[where] = p.detach().cpu()
    diff = (params["cuda"] - params["cpu"]).abs()
    rel = ((params["cuda"] - params["cpu"]).norm() / params["cpu"].norm()).item()
    print(f"fused AdamW, CUDA kernel vs CPU kernel, same tensors and gradients, {steps} steps: bitwise"
          f" {torch.equal(params['cuda'], params['cpu'])}, max|diff| {diff.max().item():.3e}, relative {rel:.3e},"
          f" elements differing {int((diff > 0).sum())} of {diff.numel()}", flush=True)


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: nothing checked (benchmarks.gpu.cuda_offload_check needs a CUDA GPU)", file=sys.stderr)
        return 2
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    print(run_header(), flush=True)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()},"
          f" LZERO_COLLECTIVES_AT_WORLD_SIZE_1={os.environ['LZERO_COLLECTIVES_AT_WORLD_SIZE_1']}", flush=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    warm = torch.randn(64, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (warm @ warm).sum().item()  # cuBLAS's workspaces, before any run's baseline
    (warm @ warm).sum().item()
    kernels_alone()
    failures = []
    try:
        for optimizer in ("sgd", "adamw"):
            for stage in (2, 3):
                for bf16 in (False, True):
                    failures += check(stage, bf16, optimizer)
    finally:
        dist.destroy_process_group()
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
