import sys
from pathlib import Path

import pytest

# tests/ (the shared helpers: _launch, _dist, _engine_cases, ...) and each folder of tests, which holds the scripts its
# tests launch: a test imports a script's models by name, some from a folder beside its own (ckpt_runs.py, of
# tests/checkpoint/, imports skip_runs.py of tests/lightning/)
_TESTS = Path(__file__).parent
sys.path[:0] = [str(_TESTS), *sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))]


@pytest.fixture
def in_process_fit():
    """A devices=1 fit in the pytest process sets MASTER_PORT/rank variables and a process group;
    undo both so later launched scripts do not inherit them."""
    import os

    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
