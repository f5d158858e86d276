"""Whatever stops the engine's setup part way, that error is the last one every rank prints, at both doors (see
[Note: a setup that stops part way] in lzero/engine/engine.py): a ZeRO-3 model at world size 2 whose setup raises in
its partition, its gather hooks (after the process groups and the shards exist), hpZ (a real misconfiguration), its
shard stores, or the optimizers' wrapping (after the engine is whole). Before, Lightning's teardown then called
``.cpu()`` on released parameters and a ``ReleasedParameterError`` was the last error printed."""

from __future__ import annotations

import re

import pytest

from _launch import run_ranks

ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): ?(.*)$")
"""A traceback's last line, as torch.distributed's excepthook prints it (``[rank1]: ``) or not."""

EXPECTED = {
    "partition": ("RuntimeError", "injected at partition"),
    "gather": ("RuntimeError", "injected at gather"),
    "hpz": ("ZeroConfigError", "does not divide the world size 2"),
    "stores": ("RuntimeError", "injected at stores"),
    "optimizers": ("RuntimeError", "injected at optimizers"),
}


def last_error(stderr: str) -> tuple[str, str]:
    """The class and message of the last error line a process printed (a traceback's last line)."""
    found = [m.groups() for m in map(ERROR_LINE.match, stderr.splitlines()) if m]
    assert found, f"no error printed:\n{stderr[-3000:]}"
    return found[-1]


@pytest.mark.parametrize("door", ["trainer", "fabric"])
@pytest.mark.parametrize("phase", list(EXPECTED))
def test_the_setup_error_is_the_last_error_printed(door: str, phase: str) -> None:
    codes, outputs = run_ranks("setup_failure.py", door, phase, ranks=2, timeout=180)
    kind, says = EXPECTED[phase]
    for rank, (code, (_, stderr)) in enumerate(zip(codes, outputs)):
        assert code != 0, f"rank {rank} exited 0"
        name, message = last_error(stderr)
        assert (name, says in message) == (kind, True), \
            f"rank {rank}'s last error is {name}: {message}, not the {kind} ({says}):\n{stderr[-3000:]}"
