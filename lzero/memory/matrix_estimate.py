"""``lzero estimate --model ... --optimizer muon|adafactor``: the model states of optimizers that step whole tensors,
each rank owning some ([Note: per-tensor ownership] in lzero/engine/partition.py). Their state depends on each
tensor's shape and owner, so the rows are computed from the model's partition at each row's stage and world size
(the engine's own partition functions, no processes), with the state formulas of [Note: optimizer state by rank] in
optimizer_states.py: every zero row takes its largest rank's optimizer state and the padding of per-tensor units; the
ddp row every tensor's state.

``muon`` is Muon on the 2-D weights of the model's blocks (the repeated modules stage 3 shards one by one: transformer
layers) and AdamW on the rest (embeddings, head, norms and biases), as Muon is used; ``adafactor`` is Adafactor on
every parameter; ``adamw`` AdamW on every parameter (elementwise), for comparison.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from torch import nn

from lzero.engine.partition import ParamSpec, UnitSpec, partition_by_label, partition_by_size
from lzero.memory.estimate import COMPUTE_BYTES, Estimate, EstimateError
from lzero.memory.optimizer_states import (StateBytes, imbalance, optimizer_store_shares, padding_bytes,
                                           rank_state_bytes, shard_rates, state_bytes_of)

OPTIMIZERS = ("adamw", "muon", "adafactor")


def param_specs(module: nn.Module, optimizer: str) -> tuple[list[ParamSpec], dict[str, str], frozenset]:
    """The trainable parameters as the engine sees them, each in its optimizer's group ((0, 0) Muon or Adafactor or
    AdamW, (1, 0) Muon's AdamW); their stage-3 block labels; and the groups laid out by owner."""
    from lzero.engine.units import find_blocks, label_parameters

    labels = label_parameters(module, find_blocks(module, None))
    specs = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        in_muon = optimizer == "muon" and p.dim() == 2 and labels[name] != ""
        group = (0, 0) if optimizer != "muon" or in_muon else (1, 0)
        specs.append(ParamSpec(name, tuple(p.shape), group))
    return specs, labels, frozenset() if optimizer == "adamw" else frozenset({(0, 0)})


def formulas(optimizer: str) -> tuple[dict[tuple[int, int], Optional[StateBytes]], dict[tuple[int, int], Any]]:
    adamw = shard_rates("AdamW", {})
    if optimizer == "muon":
        return {(0, 0): state_bytes_of("Muon"), (1, 0): state_bytes_of("AdamW")}, {(1, 0): adamw}
    if optimizer == "adafactor":
        return {(0, 0): state_bytes_of("Adafactor")}, {}
    return {(0, 0): state_bytes_of("AdamW")}, {(0, 0): adamw}


def units_at(config: Any, specs: Sequence[ParamSpec], labels: dict[str, str], world: int,
             whole: frozenset) -> tuple[UnitSpec, ...]:
    """The partition the engine makes of ``specs`` under ``config`` at ``world`` data-parallel ranks."""
    if config.stage >= 3:
        return partition_by_label(specs, world, labels, per_tensor=whole).units
    return partition_by_size(specs, world, config.reduce_bucket_size, per_tensor=whole).units


def matrix_rows(module: nn.Module, optimizer: str, rows: list[Estimate], world: int, precision: str,
                offload_ratio: float, max_in_cpu: Optional[int]) -> tuple[list[Estimate], dict[str, list[int]]]:
    """``rows`` (estimated with no optimizer state) with ``optimizer``'s state and padding added; and each row's
    optimizer state per rank."""
    from lzero.memory.estimate import preset_config
    from lzero.presets import PRESET_CONFIGS

    if optimizer not in OPTIMIZERS:
        raise EstimateError(f"`--optimizer {optimizer}` is not one of {', '.join(OPTIMIZERS)}.")
    specs, labels, whole = param_specs(module, optimizer)
    per_tensor, per_element = formulas(optimizer)
    c, mixed = COMPUTE_BYTES[precision], precision != "32-true"
    out, by_rank = [], {}
    for row in rows:
        table = {store: dict(kinds) for store, kinds in row.per_rank.items()}

        def add(store: str, kind: str, nbytes: float) -> None:
            if nbytes:
                table.setdefault(store, {k: 0 for k in next(iter(row.per_rank.values()))})
                table[store][kind] = table[store].get(kind, 0) + round(nbytes)

        if row.strategy == "ddp":
            whole_model = units_at(preset_config(PRESET_CONFIGS["zero1"], 1.0, None), specs, labels, 1, whole)
            states = rank_state_bytes(whole_model, 1, per_tensor, per_element)
            add("device", "optimizer_state", states[0])
        else:
            config = preset_config(PRESET_CONFIGS[row.strategy.removesuffix("_hpz")], offload_ratio, max_in_cpu)
            if whole and config.offload_optimizer.device == "nvme":
                by_rank[row.strategy] = []
                continue  # refused: per-tensor state is not swapped to NVMe (lzero/optimizer.py)
            units = units_at(config, specs, labels, world, whole)
            states = rank_state_bytes(units, world, per_tensor, per_element)
            for share, store in optimizer_store_shares(config):
                add(store, "optimizer_state", share * max(states))
            for (store, kind), nbytes in padding_bytes(config, units, world, c, mixed).items():
                add(store, kind, nbytes)
        by_rank[row.strategy] = states
        out.append(replace(row, per_rank=table, paper_bytes=None))
    return out, by_rank


def imbalance_lines(by_rank: dict[str, list[int]], optimizer: str) -> str:
    """Each row's optimizer state: the largest rank's, the mean, and their ratio."""
    what = {"muon": "Muon on the blocks' matrices, AdamW on the rest", "adafactor": "Adafactor",
            "adamw": "AdamW"}[optimizer]
    lines = [f"\nOptimizer state per rank ({what}; [Note: optimizer state by rank]):"]
    for name, states in by_rank.items():
        if not states:
            lines.append(f"  {name}: refused (per-tensor optimizer state is not swapped to NVMe)")
            continue
        mean = sum(states) / len(states)
        lines.append(f"  {name}: largest rank {max(states):,} bytes, mean {mean:,.0f},"
                     f" imbalance {imbalance(states):.3f}")
    return "\n".join(lines)
