"""Peak memory of one training step (forward + backward) with and without activation checkpointing.

The demo GPT (configs/demo_zero2.yaml's n_layer 4, n_head 4, n_embd 128, vocab 256, dropout 0) at
4x the demo sequence length (block_size 256), batch 16, fp32, AdamW, driven through ``ZeroEngine``
at stages 1-3 on one process (world size 1: every unit is this rank's shard, so the activation
figures are those of any world size). Per row: one warm-up step (forward, backward, optimizer step,
so the optimizer state exists), then the measured forward + backward:

* peak in step: the highest growth of live tensor bytes over the start of the measured step. On CPU
  from the profiler's allocator events (``profile_memory``; every allocation and free of the CPU
  allocator, in time order); on CUDA ``max_memory_allocated`` minus ``memory_allocated`` at the start.
* activations saved: the bytes autograd keeps for backward at the end of forward, as a
  ``saved_tensors_hooks`` pair outside the model sees them (distinct storages, parameters left out). Under non-reentrant
  checkpointing that is each checkpointed module's input plus what the unchecked layers save.

Gradients: every unit's reduced shard gradient after the measured backward, compared bitwise
with the run without checkpointing at the same stage.

    python -m benchmarks.memory.bench_activation_checkpointing [--device cuda] [--out PATH]
    # default: results/memory/activation_checkpointing.<machine>.<date>.md
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import out_path, run_header, write_report
from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.engine import activation_checkpointing as ac
from lzero.demo.model import GPT, GPTConfig

SHAPE = dict(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
BATCH = 16
MB = 1e6


def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"] + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]  # each (B, T)


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while the context is active, except the
    model's parameters (at stage 3 a parameter's storage is wherever its unit is gathered at that moment)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.storages: dict[int, int] = {}

    def __enter__(self) -> "SavedBytes":
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in {p.untyped_storage().data_ptr() for p in self.model.parameters()}:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def cpu_peak_growth(prof: torch.profiler.profile) -> int:
    """Highest running sum of the CPU allocator's allocations minus frees, in time order."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
    net = peak = 0
    for _, size in sorted(events):
        net += size
        peak = max(peak, net)
    return peak


def run(stage: int, checkpointing: bool, cpu: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(stage=stage)
    engine = ZeroEngine(model, [opt], config, device=device)
    zopt = ZeroOptimizer(opt, engine, 0)
    handle = ac.apply(model, ac.CheckpointPolicy(checkpointing or None, cpu), config)
    x, y = batch(device)

    def forward_backward(saved: SavedBytes | None = None) -> float:
        engine.gather_root()
        if saved is not None:
            with saved:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        else:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        engine.prepare_step(engine.units)
        return loss.item()

    forward_backward()
    zopt.step()
    zopt.zero_grad()
    gc.collect()
    saved = SavedBytes(model)
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = forward_backward(saved)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = forward_backward(saved)
        peak = cpu_peak_growth(prof)
    seconds = time.perf_counter() - start
    grads = [u.shard_grad.detach().clone() for u in engine.units if u.shard_grad is not None]
    checkpointed = sorted(handle.modules) if handle is not None else []
    if handle is not None:
        handle.remove()
    engine.remove()
    return {"stage": stage, "checkpointing": checkpointing, "cpu": cpu, "peak": peak, "saved": saved.total,
            "loss": loss, "grads": grads, "seconds": seconds, "checkpointed": checkpointed}


def render(rows: list[dict], device: torch.device, command: str) -> str:
    params = sum(p.numel() for p in GPT(GPTConfig(**SHAPE)).parameters())
    lines = [
        "# Activation checkpointing: peak memory of one forward + backward",
        "",
        run_header(),
        "",
        f"Command: `{command}`",
        "",
        f"DemoGPT {params:,} parameters ({SHAPE}), batch {BATCH}, fp32, AdamW, `ZeroEngine` at world size 1 on"
        f" {device.type} ({torch.get_num_threads()} thread(s)). The measured step follows one full warm-up step."
        " MB = 10^6 bytes.",
        "",
        f"Checkpointed modules (`activation_checkpointing=True`, the stage-3 unit classes): {rows[-1]['checkpointed']}.",
        "",
        "| stage | activation_checkpointing | cpu_checkpointing | peak in step (MB) | activations saved for backward (MB) |"
        " loss | gradients vs. no checkpointing | time of the measured step (s, profiled) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ref = next(r for r in rows if r["stage"] == row["stage"] and not r["checkpointing"])
        same = len(row["grads"]) == len(ref["grads"]) and all(torch.equal(a, b) for a, b in zip(row["grads"], ref["grads"]))
        verdict = "reference" if row is ref else ("bitwise equal" if same else "DIFFERENT")
        lines.append(f"| {row['stage']} | {row['checkpointing']} | {row['cpu']} | {row['peak'] / MB:.1f} |"
                     f" {row['saved'] / MB:.1f} | {row['loss']:.6f} | {verdict} | {row['seconds']:.2f} |")
    lines += [
        "",
        "*peak in step*: highest growth of live tensor bytes over the start of the measured forward + backward"
        " (CPU: the profiler's allocator events, every allocation and free in time order; CUDA:"
        " `max_memory_allocated` minus `memory_allocated` before the step). It includes the logits, gradient"
        " buffers and, under checkpointing, one block's recomputed activations in backward.",
        "*activations saved for backward*: distinct storages autograd holds for backward at the end of forward,"
        " parameters left out, seen by a `saved_tensors_hooks` pair around the model (under checkpointing: each"
        " checkpointed module's input and what the layers outside it save).",
        "*gradients*: every unit's reduced shard gradient after the measured backward, compared with `torch.equal`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/memory/activation_checkpointing.<machine>.<date>.md)")
    args = parser.parse_args()
    out = out_path(args.out, "memory", "activation_checkpointing")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = torch.device(args.device)
    variants = [(False, False), (True, False)] + ([(True, True)] if device.type == "cuda" else [])
    rows = [run(stage, c, cpu, device) for stage in (1, 2, 3) for c, cpu in variants]
    text = render(rows, device, f"python -m {__spec__.name} " + " ".join(sys.argv[1:]))
    if out is not None:
        write_report(out, text)
    print(text)


if __name__ == "__main__":
    main()
