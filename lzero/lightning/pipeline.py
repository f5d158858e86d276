"""Both doors' pipeline: a model cut into this rank's stages, a step run over a batch's micro-batches by the schedule.

The Trainer runs the LightningModule's ``training_step`` through it (trainer_pipeline.py), Fabric the step function a
script hands to ``strategy.pipeline_step`` (fabric_strategy.py). See [Note: pipeline parallel under ZeRO] in
lzero/engine/pipeline.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lzero.config import ZeroConfig
from lzero.engine.pipeline import PipelineRunner, Split, local_stages, plan_pipeline, split_batch


class StagePipeline:
    """This rank's stages of a module and the runner of their schedule. Made at setup, before the engine: the cut
    removes the other stages' parameters, so ZeRO shards this rank's only."""

    def __init__(self, module: torch.nn.Module, config: ZeroConfig, device_mesh: Any, device: torch.device) -> None:
        self.config = config
        pipeline_mesh = device_mesh["pipeline_parallel"]
        self.group = pipeline_mesh.get_group()
        self.rank, self.size = pipeline_mesh.get_local_rank(), pipeline_mesh.size()
        stages = config.pipeline_stages
        self.plan = plan_pipeline(module, stages, config.pipeline_split_points)
        _agree_on_weights(module, self.group)  # before the cut: every stage starts from the same model
        self.split = Split(module, self.plan, local_stages(self.rank, self.size, stages))
        self.runner = PipelineRunner(self.split, config.pipeline_schedule, self.group, device)

    @property
    def holds_first(self) -> bool:
        return 0 in self.split.local

    def attach(self, engine: Any, mesh: Any) -> None:
        """The engine learns this rank's stages, and the parameters both end stages hold (embeddings tied to the
        head), whose gradients it sums across them at each step."""
        engine.pipeline_stages = self.split.local
        if not self.plan.tied:
            return
        names = [first if self.holds_first else last for first, last in self.plan.tied]
        engine.tie_across_stages(names, mesh.pipeline_ends(),
                                 None if self.holds_first else [first for first, _ in self.plan.tied])

    def run(self, step: Callable[[Any], Any], batch: Any, train: bool, engine: Any, divisor: int = 1,
            loss_scale: float = 1.0) -> list[Any]:
        """``step`` over the micro-batches of ``batch`` (forward and backward when ``train``): the last stage's step
        outputs (empty on the other ranks). Each micro-batch's loss is multiplied by ``loss_scale`` (fp16's, which
        the engine's reductions divide out) over the micro-batches times ``divisor`` (an accumulation's)."""
        micro = split_batch(batch, self.config.microbatches, fewer=not train)
        self.runner.scale = loss_scale / (len(micro) * divisor)
        stage3 = engine is not None and engine.gatherer is not None
        # stage 3: every block of this rank's stages gathered once for the schedule ([Note: pipeline parallel under
        # ZeRO] in lzero/engine/pipeline.py)
        self.runner.after_backward = engine.close_pinned_backward if stage3 else None
        try:
            with engine.gatherer.all_gathered() if stage3 else contextlib.nullcontext():
                outputs = self.runner.run(micro, step, train)
        finally:
            if stage3:
                engine.release_all()
        if engine is not None and train:
            engine.ties_pending = True
        return outputs

    def from_last_stage(self, value: Any) -> Any:
        """``value`` as the rank holding the last stage has it, on every rank of this pipeline (a collective)."""
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, (self.plan.stages - 1) % self.size),
                                   group=self.group)
        return box[0]

    def mean_loss(self, outputs: list[Any], extra: Any = None) -> tuple[Optional[torch.Tensor], Any]:
        """The mean of the micro-batches' losses (and ``extra``) as the last stage has them, on every rank."""
        losses = [float(_loss(o)) for o in outputs if _loss(o) is not None]
        loss, extra = self.from_last_stage((sum(losses) / len(losses) if losses else None, extra))
        return (None if loss is None else torch.tensor(loss, device=self.runner.device)), extra

    def remove(self) -> None:
        self.split.remove()


def _loss(output: Any) -> Optional[torch.Tensor]:
    loss = output.get("loss") if isinstance(output, dict) else output
    return loss.detach() if isinstance(loss, torch.Tensor) else None


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
