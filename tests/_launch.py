"""Run a launched multi-process script from pytest.

By default the script runs as a user runs it: one process, and Lightning starts the other ranks by re-running it
(each after the first has imported torch and Lightning, about 6 s here). ``ranks=N`` starts all N ranks at once,
as torchrun does (Lightning then finds a TorchElastic environment and starts nothing): for scripts whose every
Trainer uses ``devices=N``. Those ranks are forked from the test session's fork server (tests/_dist.py), which has
imported torch, Lightning and lzero once, so a launch no longer costs each rank those imports (about 8 s of CPU here):
the script then runs as ``__main__`` in the forked process, with the environment, ``sys.argv`` and ``sys.path[0]``
a fresh ``python script.py`` would have, and its output in files read back. Where the ``LZERO_*`` variables differ
from the fork server's (lzero reads them at import), fresh interpreters are started instead."""

from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import _dist

TESTS = Path(__file__).parent


def script(name: str) -> Path:
    """A launched script by its file name: it lives beside the tests that launch it (tests/<area>/NAME); a name with
    a folder is a path from the repository's root (an example, a benchmark, run as a user runs it)."""
    if "/" in name:
        return TESTS.parent / name
    found = sorted(TESTS.glob(f"*/{name}"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} launched scripts named {name!r} under {TESTS}/*/: {found}")
    return found[0]


def script_path() -> str:
    """The PYTHONPATH of a launched script: tests/ (shared helpers such as _teardown.py) and every folder of tests,
    since a script imports the models of scripts beside other tests (ckpt_runs.py those of skip_runs.py)."""
    folders = [TESTS, *sorted(d for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))]
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*map(str, folders), *([inherited] if inherited else [])])


def script_env(env: dict | None = None) -> dict:
    """``os.environ`` for a launched script: its PYTHONPATH (``script_path``), unbuffered output, then ``env``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": script_path(), **(env or {})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(name: str, *args: str, timeout: float = 600, env: dict | None = None,
               ranks: Optional[int] = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script(name)), *args]
    full_env = script_env(env)
    if ranks is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                 f"\n--- stderr\n{proc.stderr[-8000:]}")
        return proc
    codes, outputs = run_ranks(name, *args, ranks=ranks, timeout=timeout, env=env)
    failed = [(r, code) for r, code in enumerate(codes) if code != 0]
    if failed:
        report = "\n".join(f"--- rank {r} stdout\n{out[-3000:]}\n--- rank {r} stderr\n{err[-6000:]}"
                           for r, (out, err) in enumerate(outputs))
        raise AssertionError(f"{' '.join(cmd)}: ranks {failed} exited with an error\n{report}")
    return subprocess.CompletedProcess(cmd, 0, outputs[0][0], outputs[0][1])


def run_ranks(name: str, *args: str, ranks: int, timeout: float = 600, env: dict | None = None
              ) -> tuple[list[int], list[tuple[str, str]]]:
    """Each rank's exit code and (stdout, stderr), as torchrun starts them, whether they fail or not."""
    cmd = [sys.executable, str(script(name)), *args]
    full_env = script_env(env)
    port = str(_free_port())
    envs = [{**full_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks), "RANK": str(r),
             "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "NODE_RANK": "0",
             "TORCHELASTIC_RUN_ID": "lzero-tests"} for r in range(ranks)]
    ctx = _dist.context()
    if ctx.get_start_method() == "forkserver":
        return _forked(ctx, str(script(name)), list(args), envs, timeout)
    return _fresh(cmd, envs, timeout)


def _fresh(cmd: list[str], envs: list[dict], timeout: float) -> tuple[list[int], list[tuple[str, str]]]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for env in envs]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [p.returncode for p in procs], outputs


def _forked(ctx, path: str, args: list[str], envs: list[dict], timeout: float
            ) -> tuple[list[int], list[tuple[str, str]]]:
    with tempfile.TemporaryDirectory(prefix="lzero-launch-") as folder:
        files = [(os.path.join(folder, f"rank{r}.out"), os.path.join(folder, f"rank{r}.err")) for r in range(len(envs))]
        procs = [ctx.Process(target=_run_as_main, args=(path, args, env, out, err)) for env, (out, err) in zip(envs, files)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout  # one bound for the whole launch
        try:
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        outputs = [(Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")) for out, err in files]
    return [p.exitcode for p in procs], outputs


def _run_as_main(path: str, args: list[str], environ: dict, out: str, err: str) -> None:
    """In the forked rank: what ``python PATH ARGS`` with ``environ`` would run, its stdout and stderr into the
    files ``out`` and ``err``. An exception or ``sys.exit`` ends the process as it would end the interpreter: an
    uncaught exception printed by ``sys.excepthook`` (which lzero may have replaced: [Note: the misuse named on every
    rank] in lzero/engine/unit_order.py), exit code 1."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [path, *args]
    known = set(sys.path)
    sys.path[:0] = [os.path.dirname(path), *(p for p in environ.get("PYTHONPATH", "").split(os.pathsep)
                                             if p and p not in known)]
    try:
        runpy.run_path(path, run_name="__main__")
    except Exception:
        sys.excepthook(*sys.exc_info())
        sys.exit(1)
