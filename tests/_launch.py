"""Run a launched multi-process script from pytest.

By default the script runs as a user runs it: one process, and Lightning starts the other ranks by re-running it
(each after the first has imported torch and Lightning, about 6 s here). ``ranks=N`` starts all N ranks at once,
as torchrun does (Lightning then finds a TorchElastic environment and starts nothing), so their imports overlap:
for scripts whose every Trainer uses ``devices=N``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

SCRIPTS = Path(__file__).parent / "scripts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(name: str, *args: str, timeout: float = 600, env: dict | None = None,
               ranks: Optional[int] = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPTS / name), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if ranks is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                 f"\n--- stderr\n{proc.stderr[-8000:]}")
        return proc
    port = str(_free_port())
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={
        **full_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks), "RANK": str(r),
        "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "NODE_RANK": "0",
        "TORCHELASTIC_RUN_ID": "lzero-tests"}) for r in range(ranks)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        report = "\n".join(f"--- rank {r} stdout\n{out[-3000:]}\n--- rank {r} stderr\n{err[-6000:]}"
                           for r, (out, err) in enumerate(outputs))
        raise AssertionError(f"{' '.join(cmd)}: ranks {failed} exited with an error\n{report}")
    return subprocess.CompletedProcess(cmd, 0, outputs[0][0], outputs[0][1])
