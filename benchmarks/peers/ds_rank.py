"""One rank of a DeepSpeed peer run on CPU (gloo): environment, one thread, DeepSpeed's output kept off stdout."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any


def start_rank(rank: int, world: int, port: int) -> Any:
    """Join a ``world``-rank gloo group on 127.0.0.1:``port`` as ``rank`` through ``deepspeed.init_distributed``, one
    thread, DeepSpeed's log lines sent to stderr (stdout holds the peers' JSON lines); returns the ``deepspeed``
    module. On the CPU accelerator ``init_distributed`` JIT-builds (first run, cached in ``~/.cache/torch_extensions``)
    and loads DeepSpeed's shared-memory comm op, used only by inference all-reduce, and print()s a line about it:
    that line goes to stderr too."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    for handler in ds_logger.handlers:  # DeepSpeed logs to stdout
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed
