"""The unit-order check of stage 3: before each all-gather, every rank agrees on the block it is about to
gather (an all-gather of the block's index on a gloo group with a timeout), because ranks that gather different
blocks would all-gather buffers of different sizes, which gloo aborts the process on and NCCL hangs on. See
[Note: stage-3 parameter lifecycle] in gather.py for when it runs and how it is started a block ahead.

[Note: the misuse named on every rank]
A rank whose check times out raises UnitOrderError, but its peers are elsewhere: in a collective of their own, often
the misuse itself (``generate`` on rank 0 alone waits in transformers' all-reduce of its finished flags), which fails
only once that rank's process is gone, with gloo's "Connection closed by peer", naming nothing. So that rank first
publishes its message under its check's key in the default store (the TCPStore every rank reached at
``init_process_group``), and a process with a live check prints an uncaught collective failure (a RuntimeError) as
that UnitOrderError, raised from the failure: ``sys.excepthook``, whatever door or call the failure came through (a
Trainer hook, a Fabric script's own ``model.generate``), and ``named_cause`` for code that catches it. The rank that
published may host the store (rank 0 under Lightning's launcher; torchrun's agent hosts it otherwise), so its own
excepthook, once its error is printed, closes its process groups (a peer blocked in a collective with it fails now,
not when the process is gone) and waits up to ``READ_WAIT_S`` for every peer to say it has read the message.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from lzero.engine import collectives
from lzero.errors import ZeroError

KEY = "lzero/unit_order_error/"
"""The default store's key prefix of a published UnitOrderError (the check's number in this process follows)."""

READ_WAIT_S = 10.0
"""How long the rank that published a UnitOrderError waits, before it exits, for its peers to read it."""


class UnitOrderError(ZeroError, RuntimeError):
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
        self._key = KEY + str(next(_MADE))  # the same on every rank: every rank makes the same engines in order
        self.published_here = False
        _name_failures(self)

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
            message = (
                f"Rank {dist.get_rank()} is about to gather unit `{show_unit(name)}`, but not every rank reached a"
                f" gather within {self.timeout_s:g} s ({err}). A unit ran on only some ranks. HINT: every"
                " rank must run the same modules in the same order under ZeRO-3 (no rank-dependent branches"
                " around sharded modules), or put such a module in the root unit via `unit_modules`. A model run"
                " on some ranks only (a sample generated on rank 0) runs inside `strategy.generation()`, entered"
                " on every rank: it gathers every block once, and the forwards inside run no collective.")
            self._publish(message)  # see [Note: the misuse named on every rank]
            raise UnitOrderError(message) from err
        if bool((every != mine).any()):
            seen = {r: show_unit(self._names[i]) for r, i in enumerate(every.tolist())}
            raise UnitOrderError(
                f"Ranks disagree on the next unit to gather: {seen}. A unit ran on only some ranks. HINT: every"
                " rank must run the same modules in the same order under ZeRO-3 (no rank-dependent branches"
                " around sharded modules), or put such a module in the root unit via `unit_modules`."
            )

    def _publish(self, message: str) -> None:
        store = _default_store()
        if store is not None:
            with contextlib.suppress(Exception):  # the error is raised here all the same
                store.set(self._key, message)
                self.published_here = True

    def published(self) -> Optional[str]:
        """The UnitOrderError message a rank of this check published, or None (none, or the store is gone)."""
        store = _default_store()
        try:
            return store.get(self._key).decode() if store is not None and store.check([self._key]) else None
        except Exception:  # the rank that hosted the store has exited
            return None

    def mark_read(self) -> None:
        """Tell the rank that published that this one has read its message."""
        with contextlib.suppress(Exception):
            _default_store().set(f"{self._key}/read/{dist.get_rank()}", "1")

    def let_peers_read(self) -> None:
        """On the rank that published, about to exit: close every process group, then wait up to ``READ_WAIT_S`` for
        every peer to have read the message (the store may live in this process)."""
        store, world, rank = _default_store(), dist.get_world_size(), dist.get_rank()
        dist.destroy_process_group()  # every group: a peer blocked in a collective with this rank fails now
        read = [f"{self._key}/read/{r}" for r in range(world) if r != rank]
        deadline = time.monotonic() + READ_WAIT_S
        with contextlib.suppress(Exception):
            while not store.check(read) and time.monotonic() < deadline:
                time.sleep(0.05)


_LIVE: "weakref.WeakSet[OrderCheck]" = weakref.WeakSet()  # the checks of this process's engines
_MADE = itertools.count()  # the checks made in this process, for their keys


def named_cause(failure: BaseException) -> Optional[UnitOrderError]:
    """The UnitOrderError a peer published, with ``failure`` (this rank's collective that failed after it) as its
    cause; None when ``failure`` is no collective's or no live check has a message. See [Note: the misuse named on
    every rank]."""
    if not isinstance(failure, RuntimeError) or isinstance(failure, UnitOrderError):
        return None
    for check in list(_LIVE):
        message = check.published()
        if message is not None:
            check.mark_read()
            rank = dist.get_rank() if dist.is_initialized() else 0
            error = UnitOrderError(f"{message} (Rank {rank}'s own collective failed after it: the other end is gone.)")
            error.__cause__ = failure
            return error
    return None


def _name_failures(check: OrderCheck) -> None:
    """Register ``check``; the first one installs the excepthook that prints a failure as its ``named_cause``."""
    _LIVE.add(check)
    if getattr(sys.excepthook, "lzero_unit_order", False):
        return
    previous = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        named = named_cause(value)
        if named is None:
            previous(kind, value, tb)
        else:
            previous(UnitOrderError, named, None)
        for check in list(_LIVE) if isinstance(value, UnitOrderError) and dist.is_initialized() else ():
            if check.published_here:
                check.let_peers_read()
                break

    excepthook.lzero_unit_order = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _default_store() -> Optional[Any]:
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
