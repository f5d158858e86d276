"""Faults under ``zero3_offload_nvme`` at world size 2 (issue 13, acceptance 4): a rank SIGKILLed inside a swap-file
write (rank 1), and a disk that fills mid-run (``ENOSPC`` injected into rank 0's ``os.pwritev``), both at step 5, after the step-4
checkpoint was committed. See tests/offload/nvme_fault_runs.py.

Reference: the same strategy trained to step 8 without interruption; a resume from the last committed checkpoint
must reach the same parameters bitwise. The bound on the surviving rank's exit is test_failure.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _launch import run_script, script, script_env
from lzero.checkpoint.reader import ShardedCheckpoint
from lzero.offload.nvme import host_name, start_time, user_name
from test_failure import DEADLINE_S, _gone, _last_error

ROOT = Path(__file__).resolve().parents[2]
STEPS, COMMITTED = 8, 4  # nvme_fault_runs.py: STEPS, and the checkpoint before the fault (EVERY)


def _faulty_run(mode: str, out: Path, swap_root: Path) -> SimpleNamespace:
    """Launch one faulting run; the seconds from the fault until each rank's process is gone, and what the run
    left under its swap folder."""
    cmd = [sys.executable, str(script("nvme_fault_runs.py")), str(out), str(swap_root), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=script_env())
    ended = {0: time.time()}
    pid1 = int((out / mode / "rank1.pid").read_text())
    while not _gone(pid1) and time.time() - ended[0] < 120:
        time.sleep(0.1)
    ended[1] = time.time()
    failed_at = float((out / mode / "failed_at").read_text())
    left = {p.name: sorted(c.name for c in p.iterdir()) if p.is_dir() else None for p in (swap_root / mode).iterdir()}
    return SimpleNamespace(proc=proc, output=proc.stdout + proc.stderr, exit_s=[ended[r] - failed_at for r in (0, 1)],
                           left=left)


def _live_run_folder(folder: Path) -> str:
    """A run folder whose lock names a live process (this one): no start may remove it."""
    run = folder / f"lzero-{user_name()}-live_1"
    (run / "rank0").mkdir(parents=True)
    lock = {"lzero": 1, "pid": os.getpid(), "start": start_time(os.getpid()), "host": host_name()}
    (run / "rank0.lock").write_text(json.dumps(lock))
    return run.name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The two faulting runs, then one launch resuming each and training the reference without interruption.
    Swap folders on the work disk (O_DIRECT works there), as test_nvme_offload.py's ``disk``."""
    out = tmp_path_factory.mktemp("nvme_faults")
    swap_root = ROOT / ".pytest_nvme" / f"{os.getpid()}_{out.name}"
    for mode in ("kill", "enospc"):
        (swap_root / mode / "mydata").mkdir(parents=True)
        (swap_root / mode / "mydata" / "keep.txt").write_text("not lzero's")
    live = _live_run_folder(swap_root / "kill")
    try:
        kill, enospc = (_faulty_run(mode, out, swap_root) for mode in ("kill", "enospc"))
        run_script("nvme_fault_runs.py", str(out), str(swap_root), "resume_kill", "resume_enospc", "full", timeout=300)
        after = {mode: sorted(p.name for p in (swap_root / mode).iterdir()) for mode in ("kill", "enospc", "full")}
        yield SimpleNamespace(out=out, kill=kill, enospc=enospc, live=live, after=after)
    finally:
        import shutil

        shutil.rmtree(swap_root, ignore_errors=True)


def _load(runs: SimpleNamespace, name: str) -> dict:
    return torch.load(runs.out / f"{name}.pt", weights_only=True)


def _assert_resumes_exactly(runs: SimpleNamespace, source: str) -> None:
    """The committed step-4 checkpoint is intact (nothing else in the folder is a checkpoint), and resuming it under
    the same strategy reaches the uninterrupted run's parameters bitwise."""
    folder = runs.out / source / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == [f"epoch=0-step={COMMITTED}.ckpt", "last.ckpt"]
    for directory in folder.iterdir():
        assert ShardedCheckpoint(directory).manifest["global_step"] == COMMITTED, directory
    full, resumed = _load(runs, "full"), _load(runs, f"resume_{source}")
    assert len(full["losses"]) == STEPS and resumed["losses"] == full["losses"][COMMITTED:]
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_rank_killed_during_swap_writes(runs: SimpleNamespace) -> None:
    """Rank 1 is SIGKILLed inside its third swap-file write of step 5 (half a chunk written). Rank 0 fails in its
    next collective and exits within the bound, and on its way out removes the run folder, rank 1's files included
    (rank 1 is its child, dead: ``sweep_at_exit``). Where Lightning's launcher SIGKILLs rank 0 first, rank 1's folder
    stays behind until the next start with the same ``nvme_path``, which removes it (its lock names a dead pid) and
    nothing else. The step-4 checkpoint resumes to the uninterrupted run's parameters bitwise."""
    kill = runs.kill
    print(f"kill: rank 0 exit {kill.exit_s[0]:.1f} s after the fault (rc {kill.proc.returncode}); left {kill.left}")
    # rank 0 fails in its next collective, or Lightning's launcher, polling its child every 5 s, SIGKILLs it first
    assert kill.proc.returncode in (1, -9), kill.output[-6000:]
    assert max(kill.exit_s) < DEADLINE_S, kill.exit_s
    dead = [name for name in kill.left if name.startswith(f"lzero-{user_name()}-") and name != runs.live]
    if kill.proc.returncode == 1:  # rank 0 ended through its exception and removed the whole run folder on the way out
        assert "Connection closed by peer" in _last_error(kill.output, 0) or "Connection reset by peer" in kill.output
        assert dead == [], kill.left
    else:
        assert len(dead) == 1, kill.left
        assert "rank1" in kill.left[dead[0]] and "rank1.lock" in kill.left[dead[0]], kill.left
    # the next start (the resume) found the dead folder gone after its cleanup, the unrelated ones still there
    resumed = _load(runs, "resume_kill")
    own = [Path(f).name for f in resumed["own_folders"]]
    assert resumed["swap_at_start"] == sorted([*own, "mydata", runs.live]), resumed["swap_at_start"]
    assert runs.after["kill"] == sorted(["mydata", runs.live])  # and the resume removed its own at the end
    _assert_resumes_exactly(runs, "kill")


def test_disk_full_mid_run(runs: SimpleNamespace) -> None:
    """Every swap-file write of rank 0 fails with ENOSPC from step 5: rank 0 raises an NvmeError naming the swap
    file, 'No space left' and a HINT; both ranks exit within the bound; both swap folders are removed (teardown
    after a failure closes the store; rank 1 fails in its next collective); the step-4 checkpoint is intact and
    resumes bitwise. (The faulting rank is 0: see nvme_fault_runs.py on Lightning's launcher and a failing child.)"""
    enospc = runs.enospc
    print(f"enospc: rank 0 exit {enospc.exit_s[0]:.1f} s, rank 1 {enospc.exit_s[1]:.1f} s after the fault"
          f" (rc {enospc.proc.returncode}); left {enospc.left}")
    assert enospc.proc.returncode == 1  # rank 0 ended through its own exception
    error = _last_error(enospc.output, 0)
    assert error.startswith("[rank0]: lzero.offload.nvme.NvmeError: "), enospc.output[-6000:]
    assert "to swap file " in error and "/rank0/unit" in error and "No space left on device" in error, error
    assert "HINT: the file system of `nvme_path`" in error and "is full" in error, error
    assert "Connection closed by peer" in _last_error(enospc.output, 1) or "Connection reset by peer" in enospc.output
    assert max(enospc.exit_s) < DEADLINE_S, enospc.exit_s
    assert enospc.left == {"mydata": ["keep.txt"]}, enospc.left  # no swap folder of either rank
    resumed = _load(runs, "resume_enospc")
    assert resumed["swap_at_start"] == sorted([*(Path(f).name for f in resumed["own_folders"]), "mydata"])
    assert runs.after["enospc"] == ["mydata"]
    _assert_resumes_exactly(runs, "enospc")

def test_a_killed_rank_not_yet_reaped_is_dead_to_the_next_start(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Regression: a rank SIGKILLed while its parent (the launcher, rank 0 under Lightning) is still alive stays a
    zombie until reaped; signal 0 still reaches it, so ``cleanup_stale`` took its folder for a live run's."""
    from lzero.offload.nvme_checks import cleanup_stale

    folder = ROOT / ".pytest_nvme" / f"{os.getpid()}_{tmp_path_factory.mktemp('z').name}"
    folder.mkdir(parents=True)
    code = (f"import os, signal; from lzero.offload.nvme import SwapFiles; SwapFiles({str(folder)!r}, 1);"
            " os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        while Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":  # dead, not reaped
            time.sleep(0.05)
        dead = [p for p in folder.iterdir()]
        assert len(dead) == 1 and sorted(c.name for c in dead[0].iterdir()) == ["rank1", "rank1.lock"]
        assert cleanup_stale(folder) == dead and list(folder.iterdir()) == []
    finally:
        child.wait(timeout=30)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
