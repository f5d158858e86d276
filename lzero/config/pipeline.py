"""ZeroConfig's pipeline section: how many stages the model is cut into, which schedule runs them, over how many
micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lzero.config.checks import whole_number
from lzero.errors import ZeroConfigError

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""The schedules lzero runs (torch.distributed.pipelining's ``ScheduleGPipe``, ``Schedule1F1B`` and
``ScheduleInterleaved1F1B``)."""

REFUSED_SCHEDULES = {
    "zero_bubble": "its split of the weight gradient from the input gradient bypasses the gradient hooks ZeRO reduces"
                   " from",
    "interleaved_zero_bubble": "its split of the weight gradient from the input gradient bypasses the gradient hooks"
                               " ZeRO reduces from",
    "zbv": "its split of the weight gradient from the input gradient bypasses the gradient hooks ZeRO reduces from",
    "dualpipev": "its split of the weight gradient from the input gradient bypasses the gradient hooks ZeRO reduces"
                 " from",
    "looped_bfs": "not built; `interleaved_1f1b` runs the same virtual stages with less activation memory",
}
"""Schedules torch has that lzero refuses by name, with why."""


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallel: the model cut into stages along its layer list, each stage on its own ranks, ZeRO over each
    stage's data-parallel ranks. See [Note: pipeline parallel under ZeRO] in lzero/engine/pipeline.py."""

    pipeline_parallel_size: int = 1
    """The pipeline's ranks: ``world = pipeline x data x tensor``, the pipeline dimension outermost (rank r is on
    pipeline rank r // (data x tensor)). The model is cut into this many stages (times ``pipeline_virtual_stages``)
    along its layer list: the embeddings with the first stage, the final norm and head with the last. Must divide the
    world size. 1: off."""

    pipeline_schedule: str = "1f1b"
    """``"gpipe"`` (every forward, then every backward), ``"1f1b"`` (one forward, one backward once the pipeline is
    full: at most P micro-batches' activations in flight) or ``"interleaved_1f1b"`` (each rank runs
    ``pipeline_virtual_stages`` stages, a smaller bubble)."""

    pipeline_microbatches: Optional[int] = None
    """The micro-batches a training step's batch is split into (along its first dimension, which they must divide):
    each data rank's batch is ``pipeline_microbatches`` x micro batch. None: as many as stages (P x virtual stages)."""

    pipeline_virtual_stages: Optional[int] = None
    """Stages per rank. None: 2 under ``"interleaved_1f1b"``, else 1; more than 1 needs ``"interleaved_1f1b"``."""

    pipeline_split_points: Optional[tuple[str, ...]] = None
    """Where stages start: the names of the layers (modules of the layer list, e.g. ``"model.model.layers.4"``)
    that begin stages 1, 2, ... None: stages balanced by parameter count."""

    def __post_init__(self) -> None:
        size = whole_number("pipeline_parallel_size", self.pipeline_parallel_size, 1, " of ranks",
                            "e.g. `pipeline_parallel_size=2` (a divisor of the world size), or 1 for no pipeline.")
        object.__setattr__(self, "pipeline_parallel_size", size)
        schedule = self.pipeline_schedule
        if schedule in REFUSED_SCHEDULES:
            raise ZeroConfigError(f"`pipeline_schedule={schedule!r}` is refused: {REFUSED_SCHEDULES[schedule]}."
                                  f" HINT: use one of {', '.join(PIPELINE_SCHEDULES)}.")
        if schedule not in PIPELINE_SCHEDULES:
            raise ZeroConfigError(f"`pipeline_schedule={schedule!r}` is not a schedule lzero runs. HINT: use one of"
                                  f" {', '.join(PIPELINE_SCHEDULES)}.")
        if self.pipeline_microbatches is not None:
            object.__setattr__(self, "pipeline_microbatches", whole_number(
                "pipeline_microbatches", self.pipeline_microbatches, 1, "", "e.g. 4 (it must divide the batch)."))
        virtual = self.pipeline_virtual_stages
        if virtual is not None:
            virtual = whole_number("pipeline_virtual_stages", virtual, 1, "", "e.g. 2 with 'interleaved_1f1b'.")
            object.__setattr__(self, "pipeline_virtual_stages", virtual)
            if virtual > 1 and schedule != "interleaved_1f1b":
                raise ZeroConfigError(f"`pipeline_virtual_stages={virtual}` with `pipeline_schedule={schedule!r}`:"
                                      " only an interleaved schedule runs several stages per rank. HINT: set"
                                      " `pipeline_schedule='interleaved_1f1b'`, or drop `pipeline_virtual_stages`.")
        points = self.pipeline_split_points
        if points is not None:
            if isinstance(points, str) or not all(isinstance(p, str) and p for p in points):
                raise ZeroConfigError(f"`pipeline_split_points={points!r}` must be a list of module names. HINT: e.g."
                                      " `['model.model.layers.4']`, the layers where stages 1, 2, ... begin.")
            object.__setattr__(self, "pipeline_split_points", tuple(points))
        m = self.pipeline_microbatches
        if m is not None and schedule != "gpipe" and m < size:
            raise ZeroConfigError(f"`pipeline_microbatches={m}` under `pipeline_schedule={schedule!r}` with"
                                  f" `pipeline_parallel_size={size}`: 1F1B schedules need at least as many"
                                  f" micro-batches as pipeline ranks. HINT: `pipeline_microbatches` >= {size}, or"
                                  " 'gpipe'.")
        if m is not None and schedule == "interleaved_1f1b" and m % max(1, m // size):
            raise ZeroConfigError(f"`pipeline_microbatches={m}` under 'interleaved_1f1b' with `pipeline_parallel_size="
                                  f"{size}`: torch's schedule runs rounds of equal micro-batches ({m // size} rounds"
                                  f" here). HINT: a multiple of {size}.")
        if size == 1 and (self.pipeline_microbatches is not None or virtual not in (None, 1) or points is not None):
            given = [n for n in ("pipeline_microbatches", "pipeline_virtual_stages", "pipeline_split_points")
                     if getattr(self, n) is not None]
            raise ZeroConfigError(f"`{given[0]}` with `pipeline_parallel_size=1`: there is no pipeline to apply it to."
                                  " HINT: set `pipeline_parallel_size=P` (P > 1), or drop it.")

    @property
    def stages_per_rank(self) -> int:
        """The stages each pipeline rank runs."""
        if self.pipeline_virtual_stages is not None:
            return self.pipeline_virtual_stages
        return 2 if self.pipeline_schedule == "interleaved_1f1b" else 1

    @property
    def pipeline_stages(self) -> int:
        """The stages the model is cut into."""
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def microbatches(self) -> int:
        """Micro-batches per training step."""
        return self.pipeline_microbatches if self.pipeline_microbatches is not None else self.pipeline_stages
