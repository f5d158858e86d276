"""The Trainer's pipeline: the LightningModule cut into this rank's stages, its steps run by the schedule.

[Note: pipeline steps under the Trainer]
With ``pipeline_parallel_size`` > 1 the strategy's ``training_step`` cuts the batch into ``pipeline_microbatches``
micro-batches and runs the user's ``training_step`` on them through the schedule (see [Note: pipeline parallel under
ZeRO] in lzero/engine/pipeline.py): the schedule runs every forward and backward, so the strategy's ``backward``
then only calls the hooks around it (``on_before_backward``, ``on_after_backward``). What the step logs with
``self.log`` is recorded on the last stage, averaged over the micro-batches and logged on every rank, as the step's
loss is (the mean of the micro-batches' losses, what one process logs on the whole batch when they are equal); so
every rank's progress bar and logger see the same numbers. ``validation_step``, ``test_step`` run forward-only
schedules the same way.

Lightning clears the gradients between ``training_step`` and ``backward`` (its closure's ``zero_grad_fn``, so that a
backward starts from none); here the step's backwards have run by then, so the engine keeps them (``hold_grads``)
until the strategy's ``backward``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine.pipeline import PipelineRunner, Split, local_stages, plan_pipeline, split_batch

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


class TrainerPipeline:
    """This rank's stages of the LightningModule and the runner of their schedule."""

    def __init__(self, module: LightningModule, config: ZeroConfig, device_mesh: Any, device: torch.device) -> None:
        self.config = config
        pipeline_mesh = device_mesh["pipeline_parallel"]
        self.group = pipeline_mesh.get_group()
        self.rank, self.size = pipeline_mesh.get_local_rank(), pipeline_mesh.size()
        stages = config.pipeline_stages
        self.plan = plan_pipeline(module, stages, config.pipeline_split_points)
        _agree_on_weights(module, self.group)  # before the cut: every stage starts from the same model
        self.split = Split(module, self.plan, local_stages(self.rank, self.size, stages))
        self.runner = PipelineRunner(self.split, config.pipeline_schedule, config.microbatches, self.group, device)
        self.logs: list[tuple[tuple, dict]] = []

    @property
    def holds_first(self) -> bool:
        return 0 in self.split.local

    def attach(self, engine: Any, mesh: Any) -> None:
        """The engine learns this rank's stages, and the parameters both end stages hold (embeddings tied to the
        head), whose gradients it sums across them at each step."""
        engine.pipeline_stages = self.split.local
        if not self.plan.tied:
            return
        module_params = dict(_named(engine))
        names = [first if self.holds_first else last for first, last in self.plan.tied]
        engine.tie_across_stages([module_params[n] for n in names], mesh.pipeline_ends(),
                                 None if self.holds_first else [first for first, _ in self.plan.tied])

    def run(self, module: LightningModule, hook: str, args: tuple, kwargs: dict, train: bool, engine: Any,
            divisor: int, loss_scale: float = 1.0) -> Optional[torch.Tensor]:
        """``module.<hook>`` over the micro-batches of ``args[0]``; the step's mean loss (training) on every rank.
        Each micro-batch's loss is multiplied by ``loss_scale`` (fp16's, which the engine's reductions divide out)
        over the micro-batches times ``divisor`` (Lightning's accumulation)."""
        batch, rest = args[0], args[1:]
        micro = split_batch(batch, self.config.microbatches)
        step: Callable[[Any], Any] = lambda mb: getattr(module, hook)(mb, *rest, **kwargs)
        self.runner.scale = loss_scale / (len(micro) * divisor)
        recorded: list[tuple[tuple, dict]] = []
        # the step's logs, replayed below (not those of the forward that finds the activations' shapes)
        module.log = lambda *a, **kw: None if self.runner.probing else recorded.append((a, kw))
        stage3 = engine is not None and engine.gatherer is not None
        # stage 3: every block of this rank's stages gathered once for the schedule ([Note: pipeline parallel under
        # ZeRO] in lzero/engine/pipeline.py)
        self.runner.after_backward = engine.close_pinned_backward if stage3 else None
        try:
            with engine.gatherer.all_gathered() if stage3 else contextlib.nullcontext():
                outputs = self.runner.run(micro, step, train)
        finally:
            del module.log
            if stage3:
                engine.release_all()
        if engine is not None and train:
            engine.ties_pending = True
            engine.hold_grads = True  # until the strategy's backward: Lightning clears gradients in between
        losses = [float(_loss(o)) for o in outputs if _loss(o) is not None]
        summary = [sum(losses) / len(losses) if losses else None, _mean_logs(recorded)]
        dist.broadcast_object_list(summary, src=dist.get_global_rank(self.group, (self.plan.stages - 1) % self.size),
                                   group=self.group)
        loss, logs = summary
        for name, value, options in logs:
            module.log(name, torch.tensor(value), **options)
        return None if loss is None else torch.tensor(loss, device=self.runner.device)

    def remove(self) -> None:
        self.split.remove()


def _named(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(unit.spec.params[i].name, p) for unit in engine.units for i, p in enumerate(unit.params)]


def _loss(output: Any) -> Optional[torch.Tensor]:
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss.detach() if isinstance(loss, torch.Tensor) else None


def _mean_logs(recorded: list[tuple[tuple, dict]]) -> list[tuple[str, float, dict]]:
    """The recorded ``self.log`` calls, one per name: the mean of its values over the micro-batches."""
    by_name: dict[str, tuple[list[float], dict]] = {}
    for args, kwargs in recorded:
        bound = _LOG_SIGNATURE.bind(None, *args, **kwargs)
        named = dict(bound.arguments)
        named.pop("self")
        name, value = named.pop("name"), named.pop("value")
        value = value.detach().float().mean().item() if isinstance(value, torch.Tensor) else float(value)
        values, _ = by_name.setdefault(name, ([], named))
        values.append(value)
    return [(name, sum(values) / len(values), options) for name, (values, options) in by_name.items()]


@torch.no_grad()
def _agree_on_weights(module: torch.nn.Module, group: Any) -> None:
    """Every parameter and buffer as pipeline rank 0 holds it, so that the stages cut one model (a model built
    without a common seed, or a tied weight both end stages keep). Meta tensors (built in ``configure_model`` at
    stage 3) are materialized later from a common seed."""
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type != "meta":
            dist.broadcast(local.data, src=src, group=group)


def refuse_beside_pipeline(config: ZeroConfig, checkpointing: bool, automatic: bool,
                           auto_stage: bool) -> None:
    """What pipeline parallel does not run with yet, refused at setup by name."""
    size = config.pipeline_parallel_size
    if not automatic:
        raise ZeroConfigError(f"`pipeline_parallel_size={size}` with manual optimization: the schedule runs every"
                              " backward inside `training_step`, where `self.manual_backward` would run another."
                              " HINT: use automatic optimization (return the loss from `training_step`).")
    if auto_stage:
        raise ZeroConfigError(f"`stage='auto'` with `pipeline_parallel_size={size}`: the automatic choice does not"
                              " count a stage's share of the model yet. HINT: give the stage.")
    if config.shard_group_size is not None:
        raise ZeroConfigError(f"`pipeline_parallel_size={size}` with `shard_group_size={config.shard_group_size!r}`:"
                              " hybrid sharding within a stage is not built. HINT: drop `shard_group_size`.")
    unbuilt = ("`checkpoint_format='full'`" if config.checkpoint_format != "sharded"
               else "`async_save=True`" if config.async_save else None)
    if checkpointing and unbuilt is not None:
        raise ZeroConfigError(f"`pipeline_parallel_size={size}` with a checkpoint callback and {unbuilt}: checkpoints"
                              " of pipeline runs are sharded directories written synchronously, so far. HINT: drop"
                              f" {unbuilt}, or `Trainer(enable_checkpointing=False)`.")
