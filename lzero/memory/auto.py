"""``strategy="zero_auto"``: the least-communication configuration whose model states fit the memory available.

[Note: choosing a stage]
At setup, before anything is sharded, the model's parameters are counted (trainable and frozen; a model on
the meta device costs nothing to count) and each candidate, in order of communication, is priced with
``lzero.memory.estimate.model_states`` (the same formulas ``lzero estimate`` prints and the memory monitor checks):
zero1, zero2, zero3, zero3_offload, zero3_offload_nvme. The first whose per-rank bytes fit the budget, less
``margin`` (activations, buffers and the allocator need the rest), is chosen. The budget: on CUDA the
device's free memory for device-resident states and the host's available memory shared by the node's ranks
for host-resident ones; on CPU, where the "device" is host memory, the two add up against the host budget.
``memory_budget_bytes`` replaces the device budget (the host one on CPU). No trial runs. The choice and
the numbers behind it are logged in one line and kept in checkpoints (the manifest's ``auto``).

Across nodes (the world is more than the node's processes, a whole number of nodes) the hybrid layouts come first:
zero1, zero2, zero3 sharded within one node (``shard_group_size`` = the node's processes), priced with G in place of
N. Their links between nodes carry one all-reduce of a 1/G shard of the gradients per step, less than any flat stage
(a flat zero1-2 moves about DDP's all-reduce, a flat zero3 1.5 times that; see benchmarks/cluster/two_level.py), so
the first hybrid stage that fits is chosen; a model too large for a node's G ranks falls through to the flat stages.
A ``shard_group_size`` set by hand is kept for every candidate (NVMe offload, which refuses it, is then skipped).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine.rank_memory import rank_budget_bytes
from lzero.memory.estimate import ModelCount, model_states
from lzero.presets import PRESET_CONFIGS

CANDIDATES: tuple[tuple[str, dict[str, Any]], ...] = tuple(
    (name, PRESET_CONFIGS[name]) for name in ("zero1", "zero2", "zero3", "zero3_offload", "zero3_offload_nvme"))
"""The presets in order of communication: the first that fits is chosen."""


def choose(base: ZeroConfig, model: ModelCount, world_size: int, local_processes: int, precision: str,
           device: torch.device, budget_bytes: Optional[int] = None, margin: float = 0.2) -> tuple[ZeroConfig, dict]:
    """The chosen configuration (``base`` with a candidate's fields) and a record of the choice. See [Note: choosing
    a stage]."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ZeroConfigError(f"`memory_margin={margin!r}` must be a fraction in [0, 1). HINT: e.g. 0.2.")
    if device.type == "cuda":
        device_budget = rank_budget_bytes(device, budget_bytes, local_processes)
        host_budget = rank_budget_bytes(torch.device("cpu"), None, local_processes)
    else:
        device_budget, host_budget = None, rank_budget_bytes(device, budget_bytes, local_processes)
    if host_budget is None and device_budget is None:
        raise ZeroConfigError("`strategy='zero_auto'` cannot read how much memory this machine has (no"
                              " /proc/meminfo). HINT: pass `ZeroStrategy(stage='auto', memory_budget_bytes=...)`.")
    priced = []
    for name, fields, sharded_over in candidates(base, world_size, local_processes):
        try:
            config = base.with_overrides(**fields)
        except ZeroConfigError:  # NVMe offload with a hand-set shard_group_size
            continue
        per_rank = model_states(config, model, sharded_over, precision)
        on_device = sum(per_rank.get("device", {}).values())
        on_host = sum(per_rank.get("cpu", {}).values())
        if device_budget is None:  # CPU: the device is host memory
            fits = host_budget is not None and on_device + on_host <= (1 - margin) * host_budget
        else:
            fits = on_device <= (1 - margin) * device_budget and (
                host_budget is None or on_host <= (1 - margin) * host_budget)
        priced.append({"name": name, "device_bytes": on_device, "host_bytes": on_host, "fits": fits})
        if fits:
            record = {"chosen": name, "trainable": model.trainable, "frozen": model.frozen, "world_size": world_size,
                      "precision": precision, "device_budget_bytes": device_budget, "host_budget_bytes": host_budget,
                      "margin": margin, "candidates": priced}
            return config, record
    last = priced[-1]
    raise ZeroConfigError(
        f"`strategy='zero_auto'`: no configuration fits. Even {last['name']} needs {last['device_bytes']:,} bytes"
        f" on the device and {last['host_bytes']:,} in host memory per rank (budgets {device_budget}, {host_budget};"
        f" margin {margin:.0%}) for {model.trainable + model.frozen:,} parameters at world size {world_size}."
        " HINT: use more devices, a smaller model, or a larger `memory_budget_bytes` if the budget was set by hand."
    )


def candidates(base: ZeroConfig, world_size: int, local_processes: int) -> list[tuple[str, dict[str, Any], int]]:
    """(name, fields, ranks the states are sharded over) in the order tried: [Note: choosing a stage]."""
    group = base.shard_group_size
    if group is not None:  # kept for every candidate
        size = local_processes if group == "node" else group
        return [(f"{name}_hybrid", fields, size) for name, fields in CANDIDATES]
    flat = [(name, fields, world_size) for name, fields in CANDIDATES]
    if local_processes < 1 or world_size <= local_processes or world_size % local_processes:
        return flat
    hybrid = [(f"{name}_hybrid", {**PRESET_CONFIGS[name], "shard_group_size": local_processes}, local_processes)
              for name in ("zero1", "zero2", "zero3")]
    return hybrid + flat


def summary(record: dict) -> str:
    """The one line the strategy logs."""
    tried = ", ".join(f"{c['name']} {_size(c['device_bytes'])} + {_size(c['host_bytes'])}"
                      f"{'' if c['fits'] else ' (no)'}" for c in record["candidates"])
    budget = record["device_budget_bytes"] if record["device_budget_bytes"] is not None else record["host_budget_bytes"]
    return (f"lzero zero_auto: {record['chosen']} for {record['trainable']:,} trainable + {record['frozen']:,} frozen"
            f" parameters at world size {record['world_size']} ({record['precision']}); per rank device + host:"
            f" {tried}; budget {_size(budget)} less {record['margin']:.0%}.")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"

