import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


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
