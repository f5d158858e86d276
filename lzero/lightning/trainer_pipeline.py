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

import inspect
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import LightningModule

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.lightning.pipeline import StagePipeline

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


class TrainerPipeline(StagePipeline):
    """The LightningModule's stages; its steps, logs and loss through the schedule."""

    def run_step(self, module: LightningModule, hook: str, args: tuple, kwargs: dict, train: bool, engine: Any,
                 divisor: int, loss_scale: float = 1.0) -> Optional[torch.Tensor]:
        """``module.<hook>`` over the micro-batches of ``args[0]``; the step's mean loss (training) on every rank, its
        logs averaged over the micro-batches and logged on every rank."""
        batch, rest = args[0], args[1:]
        step: Callable[[Any], Any] = lambda mb: getattr(module, hook)(mb, *rest, **kwargs)
        recorded: list[tuple[tuple, dict]] = []
        # the step's logs, replayed below (not those of the forward that finds the activations' shapes)
        module.log = lambda *a, **kw: None if self.runner.probing else recorded.append((a, kw))
        try:
            outputs = self.run(step, batch, train, engine, divisor, loss_scale)
        finally:
            del module.log
        if engine is not None and train:
            engine.hold_grads = True  # until the strategy's backward: Lightning clears gradients in between
        loss, logs = self.mean_loss(outputs, _mean_logs(recorded))
        for name, value, options in logs:
            module.log(name, torch.tensor(value), **options)
        return loss


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
