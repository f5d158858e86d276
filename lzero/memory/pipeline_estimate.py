"""``lzero estimate --pipeline-parallel P``: what each pipeline rank holds, its stage's model states over its data ranks
and the activations its schedule keeps in flight.

[Note: activations in flight by schedule]
A micro-batch's activations stay on a stage from its forward to its backward. GPipe runs every forward first: each
rank holds all m micro-batches at its peak. 1F1B starts a backward as soon as the last stage can: pipeline rank p runs
P - p forwards before its first backward, so it holds min(m, P - p) micro-batches. Interleaved 1F1B (v stages per
rank) holds chunks, each one stage's share (1/v) of the rank's activations: torch's warm-up is (v - 1) x r + 2 x (P -
1 - p) forwards (r: micro-batches per round, P when m is a multiple of P), plus the steady state's one, at most m x v
chunks. ``in_flight`` counts those in micro-batches through all of the rank's layers; the activations of one
micro-batch through the whole model (``--microbatch-activations``, e.g. measured by a run without pipelines) are
divided among the ranks by their share of the layers.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from lzero.config import PIPELINE_SCHEDULES
from lzero.memory.estimate import EstimateError, ModelCount, estimate

ROWS = ("zero1", "zero2", "zero3")


def in_flight(schedule: str, pipeline_size: int, microbatches: int, rank: int, virtual: int = 1) -> float:
    """The micro-batches (through all of pipeline rank ``rank``'s layers) whose activations it holds at its peak (see
    [Note: activations in flight by schedule])."""
    if schedule not in PIPELINE_SCHEDULES:
        raise EstimateError(f"`--pipeline-schedule {schedule}` is not one of {', '.join(PIPELINE_SCHEDULES)}.")
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, pipeline_size - rank))
    per_round = microbatches // max(1, microbatches // pipeline_size)
    warmup = min((virtual - 1) * per_round + 2 * (pipeline_size - 1 - rank), microbatches * virtual)
    return min(warmup + 1, microbatches * virtual) / virtual


def rank_counts(count: ModelCount, pipeline_size: int, virtual: int, module: Optional[nn.Module] = None
                ) -> tuple[list[ModelCount], list[float]]:
    """Each pipeline rank's parameters (a ``ModelCount``) and share of the layers: from ``module`` cut as the strategy
    cuts it (``plan_pipeline``; a tied weight counted on both end stages), else ``count`` divided evenly."""
    if module is None:
        even = ModelCount(count.trainable // pipeline_size, count.frozen // pipeline_size,
                          tensor_sharded=count.tensor_sharded // pipeline_size)
        return [even] * pipeline_size, [1 / pipeline_size] * pipeline_size
    from lzero.engine.pipeline import local_stages, plan_pipeline

    stages = pipeline_size * virtual
    plan = plan_pipeline(module, stages)
    counts, shares = [], []
    layers = len(module.get_submodule(plan.layers))
    for rank in range(pipeline_size):
        mine = local_stages(rank, pipeline_size, stages)
        held = [f"{plan.layers}.{i}." for s in mine for i in range(plan.bounds[s], plan.bounds[s + 1])]
        held += [f"{m}." for m in plan.first] if 0 in mine else []
        held += [f"{m}." for m in plan.last] if stages - 1 in mine else []
        params = [p for name, p in module.named_parameters(remove_duplicate=False)
                  if any(name.startswith(prefix) for prefix in held)]
        unique = list({id(p): p for p in params}.values())
        counts.append(ModelCount(sum(p.numel() for p in unique if p.requires_grad),
                                 sum(p.numel() for p in unique if not p.requires_grad)))
        shares.append(sum(plan.bounds[s + 1] - plan.bounds[s] for s in mine) / layers)
    return counts, shares


def _schedule_shape(args: Any) -> tuple[int, int]:
    """The stages per rank and micro-batches per step the flags ask for, with the strategy's defaults (2 stages per
    rank under interleaved 1F1B, else 1; as many micro-batches as stages)."""
    virtual = args.virtual_stages or (2 if args.pipeline_schedule == "interleaved_1f1b" else 1)
    return virtual, args.microbatches if args.microbatches is not None else args.pipeline_parallel * virtual


def pipeline_rows(count: ModelCount, args: Any, module: Optional[nn.Module] = None) -> list[dict]:
    """One row per pipeline rank: its parameters, micro-batches in flight, activations and per-device model states
    of ``ROWS`` over its data ranks (bytes)."""
    size, (virtual, microbatches) = args.pipeline_parallel, _schedule_shape(args)
    if virtual > 1 and args.pipeline_schedule != "interleaved_1f1b":
        raise EstimateError(f"`--virtual-stages {virtual}` with `--pipeline-schedule {args.pipeline_schedule}`. HINT:"
                            " several stages per rank need `--pipeline-schedule interleaved_1f1b`.")
    counts, shares = rank_counts(count, size, virtual, module)
    rows = []
    for rank, (stage_count, share) in enumerate(zip(counts, shares)):
        states = estimate(stage_count, args.num_gpus, args.num_nodes, args.precision, args.optimizer_bytes,
                          strategies=ROWS, tensor_parallel_size=args.tensor_parallel, pipeline_parallel_size=size)
        flight = in_flight(args.pipeline_schedule, size, microbatches, rank, virtual)
        rows.append({"pipeline_rank": rank, "trainable_params": stage_count.trainable,
                     "frozen_params": stage_count.frozen, "microbatches_in_flight": flight,
                     "activations_bytes": round(flight * share * args.microbatch_activations),
                     "per_device": {row.strategy: row.per_device for row in states}})
    return rows


def pipeline_table(rows: Sequence[dict], args: Any, gb: Any) -> str:
    """The rows as text, after the main table."""
    data = args.num_gpus * args.num_nodes // (args.pipeline_parallel * args.tensor_parallel)
    virtual, microbatches = _schedule_shape(args)
    head = ("pipeline rank", "params", "in flight", "activations", *(f"{r} per device" for r in ROWS))
    body = [(str(r["pipeline_rank"]), f"{r['trainable_params'] + r['frozen_params']:,}",
             f"{r['microbatches_in_flight']:g}", gb(r["activations_bytes"]),
             *(gb(r["per_device"][name]) for name in ROWS)) for r in rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    lines = ["", f"Pipeline P = {args.pipeline_parallel} ({args.pipeline_schedule}, {microbatches} micro-batches,"
                 f" {virtual} stage(s) per rank): each pipeline rank's stage over N / (P x T) = {data} data ranks, in"
                 " GB; in flight: the micro-batches (through the rank's layers) whose activations it holds at its peak"
                 + ("" if args.microbatch_activations else " (activations: give --microbatch-activations)")]
    for line in (head, tuple("-" * w for w in widths), *body):
        lines.append("  ".join([line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:]))]))
    return "\n".join(lines)
