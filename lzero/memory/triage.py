"""What to do when a step runs out of memory.

[Note: out-of-memory triage]
When a training step raises an out-of-memory error (``torch.OutOfMemoryError`` on CUDA, or the host allocator's
``MemoryError`` / "can't allocate memory" under offload or on CPU), the strategy appends to that error's message,
which it keeps whole:
- what the rank held: its model states by kind as the engine measures them (``accounting``), beside what
  ``lzero estimate`` predicts for the configuration; lzero's working set (reduce buckets, gathered blocks:
  ``estimate.working_set``); and the activations, measured in the first training step as the bytes autograd
  saved for backward (``ActivationProbe``: ``saved_tensors_hooks``, parameters excluded, each storage once);
- remedies, each priced in device bytes per rank by the same formulas with the measured activations: the next
  stages, activation checkpointing, both, half the micro batch with twice the accumulation (the global batch
  kept), and the offload presets (on a GPU); and the cheapest of them that fits the budget, with the bytes it saves and how
  to ask for it. The order is the price in time: a stage first (zero2 costs no more communication than zero1,
  zero3 half as much again), then recomputation (about a third more compute), then smaller micro batches (less
  work per kernel), then offload (host steps and PCIe copies). A shorter sequence is named, not priced.

Activation checkpointing keeps each checkpointed block's input instead of what the block saves, and recomputes
one block at a time in backward: priced as the activations, less what the blocks saved, plus their inputs, plus
the largest block's saved bytes (all measured). Half the micro batch halves the activations.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lzero.config import ZeroConfig
from lzero.engine.tensor_parallel import local
from lzero.memory.estimate import ModelCount, model_states, working_set
from lzero.presets import PRESET_CONFIGS


@dataclass
class ActivationProbe:
    """Bytes autograd saves for backward during one forward: in all, inside each block, and each block's input.
    See [Note: out-of-memory triage]."""

    blocks: dict[str, nn.Module]
    total: int = 0
    saved_in: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, int] = field(default_factory=dict)
    measured: bool = False

    @contextmanager
    def measuring(self, module: nn.Module) -> Iterator[None]:
        params = {id(p) for p in module.parameters()}
        seen: set[int] = set()
        current: list[str] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                base = t._base if t._base is not None else t
                if id(base) in params or id(t) in params or t.device.type == "meta":
                    return t
                storage = local(t).untyped_storage()  # a DTensor's: its local tensor's (tensor parallel)
                storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor without plain storage (sparse, nested...)
                return t
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.total += storage.nbytes()
                if current:
                    self.saved_in[current[-1]] = self.saved_in.get(current[-1], 0) + storage.nbytes()
            return t

        def enter(name: str):
            def hook(_: nn.Module, args: Any) -> None:
                current.append(name)
                self.inputs[name] = sum(a.untyped_storage().nbytes() for a in tree_flatten(args)[0]
                                        if isinstance(a, torch.Tensor))
            return hook

        def leave(_: nn.Module, args: Any, output: Any) -> None:
            if current:
                current.pop()

        handles = [h for name, block in self.blocks.items()
                   for h in (block.register_forward_pre_hook(enter(name)), block.register_forward_hook(leave))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
            self.measured = True
        finally:
            for h in handles:
                h.remove()

    def checkpointed(self) -> int:
        """The activations with every block checkpointed (see [Note: out-of-memory triage])."""
        inside = sum(self.saved_in.values())
        return self.total - inside + sum(self.inputs.values()) + max(self.saved_in.values(), default=0)


@dataclass(frozen=True)
class Situation:
    """What the triage prices: the run's configuration and what was measured."""

    config: ZeroConfig
    count: ModelCount
    world_size: int
    precision: str
    budget: Optional[int]  # device bytes per rank (the host's share on CPU); None: unknown
    measured_states: dict[str, dict[str, int]]
    activations: Optional[int]  # measured in the first step; None: not measured
    checkpointed_activations: Optional[int]
    activation_checkpointing: bool  # already on
    micro_batch: Optional[int]
    accumulation: int
    on_cpu: bool  # the device is host memory: host-resident states count against the same budget
    schedule: Optional[dict[str, Any]] = None  # what stage 3's schedule="auto" chose (its record), if it has


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _device_bytes(config: ZeroConfig, s: Situation) -> int:
    states = model_states(config, s.count, s.world_size, s.precision)
    work = working_set(config, s.count, s.world_size, s.precision)
    stores = ("device", "cpu") if s.on_cpu else ("device",)
    return sum(sum(states.get(k, {}).values()) + work.get(k, 0) for k in stores)


def price(s: Situation) -> dict[str, Any]:
    """Each remedy's predicted bytes per rank and whether it fits; the current configuration's too."""
    acts = s.activations or 0
    ckpt = s.checkpointed_activations if s.checkpointed_activations is not None else acts
    stage = s.config.stage
    options: list[tuple[str, ZeroConfig, int, str]] = []  # name, config, activations, how to ask for it
    current = _device_bytes(s.config, s) + acts

    def add(name: str, fields: dict, activations: int, how: str) -> None:
        options.append((name, s.config.with_overrides(**fields), activations, how))

    for next_stage in range(stage + 1, 4):
        add(f"zero{next_stage}", {"stage": next_stage}, acts, f'strategy="zero{next_stage}"')
    if not s.activation_checkpointing:
        add("activation checkpointing", {}, ckpt, "ZeroStrategy(..., activation_checkpointing=True)")
        for next_stage in range(stage + 1, 4):
            add(f"zero{next_stage} + activation checkpointing", {"stage": next_stage}, ckpt,
                f'ZeroStrategy(stage={next_stage}, activation_checkpointing=True)')
    if s.micro_batch and s.micro_batch > 1:
        half = s.micro_batch // 2
        how = (f"DataLoader(batch_size={half}) with Trainer(accumulate_grad_batches={2 * s.accumulation})"
               " (the global batch kept)")
        add(f"micro batch {half} x accumulation {2 * s.accumulation}", {}, acts * half // s.micro_batch, how)
        if stage < 3:
            add(f"zero3 + micro batch {half} x accumulation {2 * s.accumulation}", {"stage": 3},
                acts * half // s.micro_batch, 'strategy="zero3" and ' + how)
    for preset in ("zero2_offload", "zero3_offload"):
        if int(preset[4]) >= stage and not s.on_cpu:  # on CPU the device is host memory: offload moves nothing
            add(preset, PRESET_CONFIGS[preset], acts, f'strategy="{preset}"')
            if not s.activation_checkpointing:
                add(f"{preset} + activation checkpointing", PRESET_CONFIGS[preset], ckpt,
                    f'ZeroStrategy(stage={preset[4]}, offload_optimizer="cpu"'
                    + (', offload_param="cpu"' if preset.startswith("zero3") else "") + ", activation_checkpointing=True)")
    priced = []
    for name, config, activations, how in options:
        total = _device_bytes(config, s) + activations
        priced.append({"name": name, "bytes": total, "saves": current - total, "how": how,
                       "fits": s.budget is not None and total <= s.budget})
    chosen = next((p for p in priced if p["fits"]), None)
    return {"current": current, "activations": s.activations, "remedies": priced, "chosen": chosen}


def _mb(n: Optional[float]) -> str:
    return "unknown" if n is None else f"{n / 2**20:,.1f} MiB ({int(n):,} B)"


def explain(s: Situation, probe: Optional[ActivationProbe] = None) -> tuple[str, dict[str, Any]]:
    """The text appended to the error, and the record behind it."""
    record = price(s)
    if probe is not None and probe.measured:
        record["probe"] = {"total": probe.total, "saved_in": dict(probe.saved_in), "inputs": dict(probe.inputs)}
    stores = ("device", "cpu") if s.on_cpu else ("device",)
    measured = {f"{kind}{'' if store == 'device' else ' in ' + store}": v
                for store, kinds in s.measured_states.items() if store in stores for kind, v in kinds.items() if v}
    predicted = {k: v for k, v in model_states(s.config, s.count, s.world_size, s.precision).items() if k in stores}
    lines = [
        "",
        "lzero out-of-memory triage (see [Note: out-of-memory triage] in lzero/memory/triage.py):",
        f"  per rank at stage {s.config.stage}, {s.precision}, world size {s.world_size}:"
        f" model states {_mb(sum(measured.values()))} measured ("
        + ", ".join(f"{k} {v:,} B" for k, v in measured.items()) + f"); `lzero estimate` predicts"
        f" {_mb(sum(sum(d.values()) for d in predicted.values()))}; lzero's buffers and gathers"
        f" {_mb(sum(v for k, v in working_set(s.config, s.count, s.world_size, s.precision).items() if k in stores))};"
        f" activations"
        f" {_mb(s.activations)}" + (" (saved for backward in the first step)" if s.activations is not None else
                                     " (not measured: the first step did not finish a forward)")
        + f"; predicted in all {_mb(record['current'])} against a budget of {_mb(s.budget)}.",
        "  remedies, priced by the estimator with the measured activations:",
    ]
    for p in record["remedies"]:
        lines.append(f"    - {p['name']}: {_mb(p['bytes'])}, saves {_mb(p['saves'])}"
                     + (" - fits" if p["fits"] else ""))
    lines.append("    - a shorter sequence: activations shrink with it (attention scores with its square); not priced")
    if s.schedule is not None:
        lines.append(schedule_line(s.schedule))
    chosen = record["chosen"]
    if chosen is not None:
        lines.append(f"  HINT: the cheapest that fits is {chosen['name']}, which saves {_mb(chosen['saves'])}"
                     f" per rank: {chosen['how']}.")
    else:
        lines.append("  HINT: none of these fits the budget: more devices, a smaller model or a shorter sequence.")
    return "\n".join(lines), record


def schedule_line(r: dict[str, Any]) -> str:
    """The gather schedule ``schedule="auto"`` chose after the first two steps, and the knob that holds less."""
    if not r["persistent_blocks"] and not r["kept_blocks"]:
        return "  gather schedule (schedule='auto'): memory-minimal, nothing kept gathered."
    knob = "param_persistence_threshold" if r["persistent_blocks"] else "max_reuse_distance"
    return (f"  gather schedule (schedule='auto'): {r['persistent_blocks']} of {r['blocks']} blocks persistent"
            f" (param_persistence_threshold={r['param_persistence_threshold']}), {r['kept_blocks']} kept across the turn"
            f" (max_reuse_distance={r['max_reuse_distance']}), predicted peak {_mb(r['predicted_peak_bytes'])} from"
            f" the first steps' {_mb(r['measured_peak_bytes'])}. HINT: a lower `{knob}`, or `schedule='min_memory'`"
            f" (every block gathered per use), holds {_mb(r['predicted_peak_bytes'] - r['measured_peak_bytes'])}"
            " less.")


def annotate(error: BaseException, text: str, record: dict[str, Any]) -> None:
    """``error``'s message followed by ``text``; the record on ``error.lzero_triage``. Keeps the error's type."""
    error.args = (f"{error.args[0] if error.args else ''}{text}",) + tuple(error.args[1:])
    error.lzero_triage = record  # type: ignore[attr-defined]
