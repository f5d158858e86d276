"""lzero's log: the lines lzero writes while it runs (the offload it set up, the gather schedule it chose), on rank 0.

Plain ``logging`` under the logger ``"lzero"``, so that the engine and the offload stores import no Lightning. The
Lightning glue shows these lines as Lightning shows its own (lzero/lightning/__init__.py); a plain-torch user sees
them once ``logging`` is configured to show INFO.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("lzero")


def rank() -> int:
    """This process's global rank: torch.distributed's once it runs, else the launcher's ``RANK``, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def info_on_rank_zero(message: str) -> None:
    """Log ``message`` at INFO on rank 0 only."""
    if rank() == 0:
        logger.info(message)
