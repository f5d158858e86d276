"""This rank's memory: what it may use (its budget) and what it used (its peak), read from the device or, on CPU, from
the host's ``/proc``. One computation of the budget serves every consumer: stage 3's ``schedule="auto"``
(engine/schedule.py), ``stage="auto"`` (memory/auto.py), the out-of-memory triage and ``strategy.generation()``'s
check (lightning/). Engine floor: the engine's schedule needs it, and nothing here knows Lightning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch


def rank_budget_bytes(device: torch.device, limit: Optional[int], processes: int, total: bool = False,
                      held: bool = False) -> Optional[int]:
    """This rank's memory budget on ``device``: ``limit`` (``memory_budget_bytes``) when given; else on CUDA the
    device's free memory, and on CPU the host's available memory shared by the node's ``processes``; None when it
    cannot be read.

    ``total``: the device's whole memory instead of its free memory (the triage prices every state, held or not).
    ``held``: plus what this process holds already (torch's cached device memory; on CPU its resident memory): the
    ceiling of a peak measured over the whole process (the schedule's, see [Note: choosing the gather schedule]),
    where the free figure alone would count the memory already in use twice."""
    if limit is not None:
        return limit
    if device.type == "cuda":
        free, whole = torch.cuda.mem_get_info(device)
        if total:
            return whole
        return free + (torch.cuda.memory_reserved(device) if held else 0)
    available = host_available_bytes()
    resident = proc_bytes("/proc/self/status", "VmRSS:") if held else 0
    if available is None or resident is None:
        return None
    return available // max(1, processes) + resident


@dataclass(frozen=True)
class MemoryBudget:
    """What one rank's in-step peak may reach: ``limit`` bytes (``memory_budget_bytes``), or what the machine has
    (see [Note: choosing the gather schedule]); ``processes``: the ranks sharing this host."""

    limit: Optional[int] = None
    processes: int = 1

    def read(self, device: torch.device) -> Optional[int]:
        return rank_budget_bytes(device, self.limit, self.processes, held=True)


def host_available_bytes() -> Optional[int]:
    """MemAvailable of this host (Linux), or None."""
    return proc_bytes("/proc/meminfo", "MemAvailable:")


def peak_bytes(device: torch.device) -> Optional[int]:
    """This rank's peak since :func:`reset_peak`: allocated device bytes on CUDA, the process's VmHWM on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return proc_bytes("/proc/self/status", "VmHWM:")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass  # not allowed here: the peak runs from the start of the process (an overestimate)


def proc_bytes(path: str, key: str) -> Optional[int]:
    """A ``key: N kB`` line of a ``/proc`` file, in bytes, or None."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
