"""Run a function on N gloo ranks under torch.multiprocessing (no Lightning).

The ranks are forked from a fork server that has imported torch, Lightning and lzero once per test session (0.1 s
a call instead of about 8 s for a fresh interpreter each; tests/_launch.py forks launched scripts' ranks from it too); it has run no OpenMP region, so the forked ranks start with
clean thread pools. Each rank takes the caller's environment as it is at the call; lzero reads its ``LZERO_*``
variables when it is imported, which a forked rank did before the call, so a call whose ``LZERO_*`` variables
differ from the fork server's starts fresh interpreters instead."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", "lzero", "lzero.lightning.trainer_strategy"])
_SERVER_ENV: dict = {}  # the LZERO_* variables the fork server started with


def _lzero_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("LZERO_")}


def context() -> Any:
    """The fork server's context, or spawn where this call's ``LZERO_*`` variables differ from the server's."""
    global _SERVER_ENV
    if not _SERVER_ENV:
        _SERVER_ENV = {"started": True, **_lzero_env()}
    return _CONTEXT if {"started": True, **_lzero_env()} == _SERVER_ENV else mp.get_context("spawn")


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, environ: dict) -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(110, exit=True, file=sys.stderr)  # a hung rank shows where
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank, world_size, *args), None))
    except BaseException:  # the parent re-raises it with the rank's traceback
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the results in rank order."""
    ctx = context()
    queue = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, value, error = queue.get(timeout=timeout if not errors else 30)
            except Exception:
                break  # a peer of a failed rank may never report
            if error is not None:
                errors[rank] = error
            results[rank] = value
        missing = sorted(set(range(world_size)) - set(results))
        if missing:
            errors.update({r: f"no result within {timeout} s (hung?)" for r in missing})
        if errors:
            raise AssertionError("\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items())))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
