"""ZeroConfig's checkpoint section: what checkpoints and state dicts hold, and how they are written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lzero.config.checks import true_or_false
from lzero.errors import ZeroConfigError

@dataclass(frozen=True)
class CheckpointConfig:
    """What checkpoints and state dicts hold, and how they are written."""

    exception_checkpoint_timeout_s: float = 30.0
    """After an exception, a checkpoint asked for by an ``on_exception`` hook (``OnExceptionCheckpoint``)
    is written only if every rank reaches it within this many seconds; otherwise it is skipped with a
    warning and the ranks go on to exit (under DDP such a save waits in Lightning's barrier for the
    process group timeout). A checkpoint needs every rank, so an exception on one rank only skips it."""

    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Stage 3, ``strategy.lightning_module_state_dict()``: "sharded" values expose this rank's piece
    and ``full_tensor()``; "full" gathers plain tensors onto rank 0, one unit at a time."""

    checkpoint_format: Literal["sharded", "full"] = "sharded"
    """What ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write while fitting: "sharded", a
    directory in which every rank writes its own pieces (resumable at any world size and stage;
    ``lzero consolidate`` turns it into one file), or "full", one DDP-format file gathered onto rank 0
    one unit at a time (readable by plain Lightning)."""

    async_save: bool = False
    """Sharded checkpoints only: copy this rank's pieces to CPU memory and write them on a background
    thread (its collectives on a process group of their own) while training continues. At most one
    save is in flight; the checkpoint a save replaces is deleted only after the new one commits."""

    save_frozen: bool = False
    """Sharded checkpoints: also write the frozen parameters that are still what their pretrained files hold (a
    LoRA or QLoRA base read by ``from_pretrained`` in a zero3 ``configure_model``). False: the checkpoint records those
    files (paths, sizes, SHA-256) and every reader reads the base back from them, refusing a file that changed or is
    missing. Frozen parameters from anywhere else are always written."""

    def __post_init__(self) -> None:
        timeout = self.exception_checkpoint_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ZeroConfigError(
                f"`exception_checkpoint_timeout_s={timeout!r}` must be a number of seconds > 0. HINT: e.g. 30."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ZeroConfigError(
                f"`state_dict_type={self.state_dict_type!r}` is not one of 'sharded', 'full'. HINT: use 'sharded'."
            )
        true_or_false("async_save", self.async_save)
        true_or_false("save_frozen", self.save_frozen)
        if self.async_save and self.checkpoint_format != "sharded":
            raise ZeroConfigError("`async_save=True` needs `checkpoint_format='sharded'`: a full checkpoint is gathered"
                                  " onto rank 0. HINT: drop one of the two.")
        if self.checkpoint_format not in ("sharded", "full"):
            raise ZeroConfigError(
                f"`checkpoint_format={self.checkpoint_format!r}` is not one of 'sharded', 'full'."
                " HINT: 'sharded' (a directory per checkpoint) or 'full' (one DDP-format file)."
            )
