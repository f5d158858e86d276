"""A failure on one rank: every rank exits within seconds, and the user's error is the last one printed.

See [Note: teardown after a failure] in lzero/lightning/trainer_strategy.py. Reference: DDP, whose ranks exit within
seconds of a peer's failure (the survivors' collectives see the closed connection).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _launch import script, script_env

DEADLINE_S = 30.0


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a reparented child may stay a zombie until init reaps it


def _run(strategy: str, mode: str, failing_rank: int, out: Path) -> tuple[subprocess.CompletedProcess, list[float]]:
    """Run the script (in a session of its own: ``ctrl_c`` signals its whole process group); the seconds from the
    failure until each rank's process is gone."""
    cmd = [sys.executable, str(script("failure_runs.py")), strategy, mode, str(failing_rank), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, start_new_session=True,
                          env=script_env())
    ended = {0: time.time()}
    pid1 = int((out / "rank1.pid").read_text())
    while not _gone(pid1) and time.time() - ended[0] < 120:
        time.sleep(0.1)
    ended[1] = time.time()
    failed_at = float((out / "failed_at").read_text())  # the last rank to write it: the later failure
    return proc, [ended[r] - failed_at for r in (0, 1)]


def _last_error(output: str, rank: int) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith(f"[rank{rank}]: ")]
    errors = [ln for ln in lines if re.match(rf"\[rank{rank}\]: [\w.]*(Error|Exception)\b", ln)]
    return errors[-1] if errors else ""


@pytest.mark.parametrize("strategy,failing_rank", [
    pytest.param("zero1", 0, marks=pytest.mark.slow),  # zero3 covers the fault on each rank in the default run
    pytest.param("zero2", 1, marks=pytest.mark.slow),
    ("zero3", 0), ("zero3", 1)])
def test_exception_on_one_rank(tmp_path: Path, strategy: str, failing_rank: int) -> None:
    """``training_step`` raises on one rank at step 3: the user's error is that rank's last, no lzero error
    (a unit-order check, a teardown collective) follows it, and both ranks exit within seconds."""
    proc, exit_s = _run(strategy, "raise", failing_rank, tmp_path)
    output = proc.stdout + proc.stderr
    print(f"{strategy} failing rank {failing_rank}: ranks exit {exit_s[0]:.1f} s, {exit_s[1]:.1f} s after the error")
    assert proc.returncode != 0
    assert f"RuntimeError: user error on rank {failing_rank} at step 3" in _last_error(output, failing_rank), output[-6000:]
    assert "UnitOrderError" not in output and "meta tensor" not in output, output[-6000:]
    assert "Connection closed by peer" in output or "Connection reset by peer" in output, output[-6000:]
    assert max(exit_s) < DEADLINE_S, exit_s


@pytest.mark.parametrize("strategy", [pytest.param("zero2_offload", marks=pytest.mark.slow),
                                      pytest.param("zero3_offload", marks=pytest.mark.slow), "zero3_offload_nvme"])
def test_exception_on_one_rank_under_offload(tmp_path: Path, strategy: str) -> None:
    """As above, under each offload preset (host stores, NVMe swap files): rank 1's error is its last, rank 0 ends
    within the bound, and no swap folder is left behind."""
    proc, exit_s = _run(strategy, "raise", 1, tmp_path)
    output = proc.stdout + proc.stderr
    print(f"{strategy}: ranks exit {exit_s[0]:.1f} s, {exit_s[1]:.1f} s after the error")
    assert proc.returncode != 0
    assert "RuntimeError: user error on rank 1 at step 3" in _last_error(output, 1), output[-6000:]
    assert max(exit_s) < DEADLINE_S, exit_s
    assert _swap_left(tmp_path) == [], _swap_left(tmp_path)


def _swap_left(out: Path) -> list[str]:
    swap = out / "swap"
    return sorted(str(p.relative_to(swap)) for p in swap.rglob("*")) if swap.exists() else []


def test_ctrl_c_under_nvme_offload_ends_every_rank_and_removes_the_swap_files(tmp_path: Path) -> None:
    """SIGINT to the whole process group at step 3 (Ctrl+C in the terminal that runs the launcher) under
    zero3_offload_nvme: both ranks exit within 10 s and their swap folders are gone."""
    proc, exit_s = _run("zero3_offload_nvme", "ctrl_c", 0, tmp_path)
    output = proc.stdout + proc.stderr
    print(f"Ctrl+C: ranks exit {exit_s[0]:.1f} s, {exit_s[1]:.1f} s after the signal; exit code {proc.returncode}")
    assert proc.returncode != 0, output[-4000:]
    assert (tmp_path / "swap").exists()  # the run did use the folder
    assert max(exit_s) < 10.0, (exit_s, output[-4000:])
    assert _swap_left(tmp_path) == [], _swap_left(tmp_path)


def test_uninitializable_module_error_is_last(tmp_path: Path) -> None:
    """A meta-device module lzero cannot initialize: its UninitializedModuleError ends the output; teardown
    does not try to move the half-materialized model to the CPU (``Cannot copy out of meta tensor``)."""
    proc, exit_s = _run("zero3", "noinit", 0, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        assert "UninitializedModuleError: `blocks.0.gain.scale`" in _last_error(output, rank), output[-6000:]
    assert "meta tensor" not in output, output[-6000:]
    assert max(exit_s) < DEADLINE_S, exit_s


def test_exception_checkpoint_on_one_rank_is_skipped_within_the_bound(tmp_path: Path) -> None:
    """``OnExceptionCheckpoint`` with an exception on one rank: a checkpoint needs every rank, so after
    ``exception_checkpoint_timeout_s`` (5 s here) it is skipped with a warning and both ranks exit. (DDP waits
    in Lightning's barrier for the process group timeout.) See [Note: checkpoints after an exception]."""
    proc, exit_s = _run("zero3", "ckpt", 1, tmp_path)
    output = proc.stdout + proc.stderr
    print(f"zero3 + OnExceptionCheckpoint, failing rank 1: ranks exit {exit_s[0]:.1f} s, {exit_s[1]:.1f} s after the error")
    assert proc.returncode != 0
    assert "RuntimeError: user error on rank 1 at step 3" in _last_error(output, 1), output[-6000:]
    assert "rank 1 skips the checkpoint asked for after an exception" in output, output[-6000:]
    assert "UnitOrderError" not in output
    assert not (tmp_path / "on_exception.ckpt").exists()
    assert max(exit_s) < 5 + DEADLINE_S, exit_s


def test_exception_checkpoint_on_every_rank_is_written(tmp_path: Path) -> None:
    """Every rank raises at the same step: every rank reaches the checkpoint, which is written as usual."""
    from lzero.checkpoint.reader import is_sharded_checkpoint

    proc, exit_s = _run("zero2", "ckpt_all", -1, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"RuntimeError: user error on rank {rank} at step 3" in _last_error(output, rank), output[-6000:]
    assert "skips the checkpoint" not in output
    assert is_sharded_checkpoint(tmp_path / "on_exception.ckpt")
    assert max(exit_s) < DEADLINE_S, exit_s
