"""The unit-order check of stage 3: before each all-gather, every rank agrees on the block it is about to
gather (an all-gather of the block's index on a gloo group with a timeout), because ranks that gather different
blocks would all-gather buffers of different sizes, which gloo aborts the process on and NCCL hangs on. See
[Note: stage-3 parameter lifecycle] in gather.py for when it runs and how it is started a block ahead."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lzero.engine import collectives


class UnitOrderError(RuntimeError):
    """Ranks did not run the same stage-3 units in the same order."""


def show_unit(name: str) -> str:
    return name or "<root>"


class OrderCheck:
    """Agreement on each block's gather, over ``group`` (gloo, with ``timeout_s``)."""

    def __init__(self, names: list[str], group: Any, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self._names = names
        self._index = {name: torch.tensor([i], dtype=torch.int64) for i, name in enumerate(names)}
        self._world = dist.get_world_size(group)
        self._checks: dict[str, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # started ahead: name -> exchange

    def _exchange(self, name: str, async_op: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        mine = self._index[name]  # only read by the collective: one tensor per block, made once
        every = torch.empty(self._world, dtype=torch.int64)
        return collectives.all_gather_single(every, mine, group=self.group, async_op=async_op), every, mine

    def start(self, name: str) -> None:
        """Start the check of ``name`` ahead of its gather (once the order is recorded: every rank expects the same
        next block, so the exchange runs while the current one computes)."""
        if name not in self._checks:
            self._checks[name] = self._exchange(name, async_op=True)

    def agree_on(self, name: str) -> None:
        """Every rank is about to gather ``name``, or every rank raises UnitOrderError (waits for the check
        started ahead, if one was)."""
        try:
            if name in self._checks:  # started ahead: see [Note: stage-3 parameter lifecycle]
                work, every, mine = self._checks.pop(name)
                work.wait()
            else:
                _, every, mine = self._exchange(name, async_op=False)
        except RuntimeError as err:
            if "timed out" not in str(err).lower():
                raise  # a peer process died (its own error is the one to read), as any collective would report
            raise UnitOrderError(
                f"Rank {dist.get_rank()} is about to gather unit `{show_unit(name)}`, but not every rank reached a"
                f" gather within {self.timeout_s:g} s ({err}). A unit ran on only some ranks. HINT: every"
                " rank must run the same modules in the same order under ZeRO-3 (no rank-dependent branches"
                " around sharded modules), or put such a module in the root unit via `unit_modules`. A model run"
                " on some ranks only (a sample generated on rank 0) runs inside `strategy.generation()`, entered"
                " on every rank: it gathers every block once, and the forwards inside run no collective."
            ) from err
        if bool((every != mine).any()):
            seen = {r: show_unit(self._names[i]) for r, i in enumerate(every.tolist())}
            raise UnitOrderError(
                f"Ranks disagree on the next unit to gather: {seen}. A unit ran on only some ranks. HINT: every"
                " rank must run the same modules in the same order under ZeRO-3 (no rank-dependent branches"
                " around sharded modules), or put such a module in the root unit via `unit_modules`."
            )
