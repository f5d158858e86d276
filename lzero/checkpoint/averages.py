"""A weight-averaging run's averages in a sharded checkpoint: written beside the parameters, read back into the
engine's averaged shards. No Lightning here.

[Note: averages in a sharded checkpoint]
With a weight-averaging callback (see [Note: weight averaging under ZeRO] in lzero/lightning/trainer_averaging.py)
every rank also writes the pieces of its averaged shards, keyed by parameter name as the masters are:
``average/<name>`` holds elements ``[a, b)`` of the flattened parameter's average, so the average re-shards at load
for another world size or stage, as ``param/<name>`` does. ``param/<name>`` stays the current masters (what training
resumes from, with the optimizer state); the callback's other state (``n_averaged``, SWA's epochs and scheduler) is
in Lightning's dict, and ``WeightAveraging``'s ``averaging_state`` and ``current_model_state`` keys there say that the
checkpoint's model state is the average, as its ``state_dict`` is in DDP's file. So readers of the model state
(:meth:`PiecedCheckpoint.model_key`: ``load_from_checkpoint``, consolidation, export, evaluation, a resume without the
callback) read ``average/<name>`` then, and a resume with the callback reads both families into their shards.
``StochasticWeightAveraging`` keeps the current weights as the model state, as under DDP, and its average in
``average/<name>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor

from lzero.checkpoint.pieces import PiecedCheckpoint

if TYPE_CHECKING:
    from lzero.engine.averaged import AveragedShards
    from lzero.engine.engine import ZeroEngine

PREFIX = "average/"


def add_average_pieces(engine: "ZeroEngine", tensors: dict[str, Tensor], ranges: dict[str, Any],
                       kept: Optional[Callable[[str], bool]] = None) -> None:
    """This rank's ``average/<name>`` pieces (views of the averaged shards) into a save's ``tensors`` and
    ``ranges``; nothing without an average. ``kept``: only the parameters whose name it accepts."""
    if engine.average is None:
        return
    for spec, a, b, piece in engine.average.pieces():
        if kept is None or kept(spec.name):
            tensors[PREFIX + spec.name], ranges[PREFIX + spec.name] = piece, [a, b]


def load_averages(average: "AveragedShards", reader: Optional[PiecedCheckpoint]) -> None:
    """The averaged shards from a sharded checkpoint's ``average/<name>`` pieces, each rank reading what it owns;
    nothing for a full checkpoint or one saved without an average (the callback's hook starts the average then)."""
    if reader is None or not reader.has_average:
        return
    average.fill(lambda spec, a, b: reader.read_range(PREFIX + spec.name, a, b)
                 if reader.holds(PREFIX + spec.name) else None)
