"""Which format a checkpoint directory holds, and its reader (:func:`open_reader`): a DeepSpeed checkpoint folder
(deepspeed_checkpoint.py) or lzero's own sharded checkpoint (reader.py), both read by pieces (pieces.py). Storage
only: no Lightning, no torch.distributed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Optional

from lzero.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from lzero.checkpoint.deepspeed_files import deepspeed_tag_folder
from lzero.checkpoint.pieces import PiecedCheckpoint
from lzero.checkpoint.reader import ShardedCheckpoint


def is_checkpoint_directory(path: Any) -> bool:
    """Whether ``path`` is read by :func:`open_reader` rather than as one file: any directory. One that holds
    neither format, or a save that never finished, is refused there, naming what it lacks."""
    return Path(path).is_dir()


def open_reader(path: Any, names: Optional[Collection[str]] = None) -> PiecedCheckpoint:
    """A checkpoint directory's reader: a DeepSpeed checkpoint folder's, else lzero's sharded checkpoint's.
    ``names``: the module's parameter names, which a DeepSpeed run's are matched to (``prefix_renaming``,
    pieces.py)."""
    if deepspeed_tag_folder(path) is not None:
        return DeepSpeedCheckpoint(path, names)
    return ShardedCheckpoint(path, names)
