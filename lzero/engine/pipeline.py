"""Pipeline parallel under ZeRO: the model cut into stages along its layer list, the user's step replayed per stage.

[Note: pipeline parallel under ZeRO]
With ``pipeline_parallel_size=P`` each rank keeps the layers of its stages only (``plan_pipeline``, ``split``): the
layer list (the ModuleList holding most parameters: a Hugging Face decoder's ``layers``, the demo GPT's ``blocks``)
is cut into S = P x ``stages_per_rank`` runs of consecutive layers, balanced by parameter count or at the user's
``pipeline_split_points``; the embeddings (``nn.Embedding`` modules outside the list) go with stage 0 and every other
parameter outside it (final norm, head) with stage S - 1. Stage s runs on pipeline rank s % P (interleaved: ranks hold
stages p, p + P, ...). What a rank does not hold becomes a parameterless ``Placeholder``, so parameter names stay
those of the whole model and ZeRO shards each stage over its own data-parallel group (see [Note: the pipeline
dimension] in mesh.py).

The user's step runs unchanged, once per stage and micro-batch (``Split.replay``): torch.distributed.pipelining's schedule
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) calls a stage module whose forward runs the whole
step (a LightningModule's ``training_step``, or the step a Fabric loop hands ``strategy.pipeline_step``) on
micro-batch i, with the rank's layers outside stage s acting as the
identity, the embeddings of later stages giving zeros, stage s's first layer taking the activation received from stage
s - 1 in place of its input, and the step ending where stage s + 1's first layer (a placeholder on this rank) is
called (``StageOutput``, carrying its input) unless s is the last stage, whose step returns the loss. So the step's
own code (the model call, the loss, ``self.log``) decides what a stage computes, and no loss function or model surgery
is asked of the user; the cost is the cheap parts of the step before the layers (embedding lookups of zeros, masks)
run on every stage.

Gradients: the schedule runs one backward per micro-batch and stage; each is a ZeRO backward round as under
gradient accumulation (stage 1 reduces once at the step, stages 2-3 every round), the loss divided by the
micro-batches (the schedule's own grad scaling is off: ZeRO has taken the gradients by then). At stage 3 every block of
the rank's stages is gathered once for the whole schedule and released after it (torchtitan's
``reshard_after_forward=False`` under pipelines): its hooks are off while pinned, so a backward that no parameter's
hook opened a round for is closed after it (``after_backward``). A parameter two stages
hold (embeddings tied to the head) has its gradients summed across them before the step (``Ties``), so both copies
take the same step. The global norm and the non-finite check sum over the pipeline group, a tied parameter counted
once.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lzero.errors import ZeroConfigError, ZeroEngineError


class StageOutput(BaseException):
    """Raised where a stage's last layer ends (not the last stage): carries its output out of the user's step. A
    BaseException, so that a step's ``except Exception`` does not swallow it."""

    def __init__(self, value: Any) -> None:
        super().__init__("a pipeline stage ended here")
        self.value = value


@dataclass(frozen=True)
class PipelinePlan:
    """Where the model is cut: stage s holds ``layers[bounds[s]:bounds[s + 1]]``; ``first``/``last``: the modules
    outside the layer list held by stage 0 and by the last stage; ``tied``: (stage-0 name, last-stage name) of each
    parameter both hold."""

    layers: str
    bounds: tuple[int, ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_of_layer(self, index: int) -> int:
        return next(s for s in range(self.stages) if self.bounds[s] <= index < self.bounds[s + 1])

    def describe(self) -> str:
        runs = ", ".join(f"stage {s}: {self.layers}[{self.bounds[s]}:{self.bounds[s + 1]}]" for s in range(self.stages))
        return f"{runs}; with stage 0: {', '.join(self.first) or 'nothing'}; with the last: {', '.join(self.last)}"


def _layer_list(module: nn.Module, stages: int) -> tuple[str, nn.ModuleList]:
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ZeroConfigError(f"`pipeline_parallel_size` > 1 on {type(module).__name__}, which has no layer list (an"
                              " nn.ModuleList of layers) to cut into stages. HINT: keep the model's repeated layers in"
                              " an nn.ModuleList, as Hugging Face decoders and the demo GPT do.")
    name, layers = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    if len(layers) < stages:
        raise ZeroConfigError(f"{stages} pipeline stages for the {len(layers)} layers of `{name}`: each stage needs a"
                              f" layer. HINT: lower `pipeline_parallel_size` (or `pipeline_virtual_stages`) so that"
                              f" the stages are at most {len(layers)}.")
    return name, layers


def _balanced_bounds(sizes: Sequence[int], stages: int) -> tuple[int, ...]:
    """Cut points giving each stage about 1/S of the layers' parameters, at least one layer each."""
    total, n = sum(sizes), len(sizes)
    bounds, running, i = [0], 0, 0
    for s in range(1, stages):
        target = total * s / stages
        while i < n - (stages - s) and (running + sizes[i] / 2 < target or i < bounds[-1] + 1):
            running += sizes[i]
            i += 1
        bounds.append(i)
    bounds.append(n)
    return tuple(bounds)


def plan_pipeline(module: nn.Module, stages: int, split_points: Optional[Sequence[str]] = None) -> PipelinePlan:
    """How ``module`` is cut into ``stages`` (see [Note: pipeline parallel under ZeRO])."""
    name, layers = _layer_list(module, stages)
    if split_points is not None:
        if len(split_points) != stages - 1:
            raise ZeroConfigError(f"`pipeline_split_points={list(split_points)}` names {len(split_points)} layers for"
                                  f" {stages} stages. HINT: name {stages - 1} layers of `{name}`, where stages 1 to"
                                  f" {stages - 1} begin (e.g. `{name}.{len(layers) // stages}`).")
        starts = []
        for point in split_points:
            prefix, _, index = point.rpartition(".")
            if prefix != name or not index.isdigit() or not 0 < int(index) < len(layers):
                raise ZeroConfigError(f"`pipeline_split_points` names `{point}`, which is not a layer of `{name}` past"
                                      f" the first. HINT: name layers `{name}.1` to `{name}.{len(layers) - 1}`.")
            starts.append(int(index))
        if starts != sorted(set(starts)):
            raise ZeroConfigError(f"`pipeline_split_points={list(split_points)}` are not in increasing layer order."
                                  " HINT: list each stage's first layer, in order.")
        bounds = (0, *starts, len(layers))
    else:
        bounds = _balanced_bounds([sum(p.numel() for p in layer.parameters()) for layer in layers], stages)
    first, last, owners = [], [], {}
    for pname, param in module.named_parameters(remove_duplicate=False):
        if pname.startswith(name + "."):
            continue
        owner = pname.rpartition(".")[0]
        side = first if isinstance(module.get_submodule(owner), nn.Embedding) else last
        if owner not in side:
            side.append(owner)
        owners.setdefault(id(param), []).append((pname, side is first))
    tied = []
    for names in owners.values():
        on_first = [n for n, f in names if f]
        on_last = [n for n, f in names if not f]
        if on_first and on_last:
            tied.append((on_first[0], on_last[0]))
    return PipelinePlan(name, bounds, tuple(first), tuple(last), tuple(tied))


class Placeholder(nn.Module):
    """A module another pipeline stage holds. Inside a ``Replay`` a layer is the identity and an embedding gives zeros
    (its output's shape, so the step's code before the layers runs); anywhere else, calling it is an error naming the
    stage that holds it."""

    def __init__(self, name: str, stage: int, split: "Split", layer: Optional[int] = None,
                 embedding_dim: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.name, self.stage, self.layer, self.embedding_dim, self.dtype = name, stage, layer, embedding_dim, dtype
        object.__setattr__(self, "_split", split)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        replay = self._split.replaying
        if replay is not None and self.layer is not None:
            hidden = args[0] if args else kwargs["hidden_states"]
            if self.layer == self._split.plan.bounds[replay[0] + 1]:  # the next stage's first layer: this one ends
                raise StageOutput(hidden)
            return hidden  # the identity
        if replay is not None and self.embedding_dim is not None:
            ids = args[0] if args else kwargs["input"]
            return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)
        raise ZeroEngineError(
            f"`{self.name}` is held by pipeline stage {self.stage}, not by this rank (stages {self._split.local}):"
            " under pipeline parallel a rank runs its stages' modules only, inside the strategy's schedule. HINT:"
            " call the model in `training_step`, `validation_step` or `test_step` (the strategy runs them through the"
            " schedule), or run without `pipeline_parallel_size`.")

    def extra_repr(self) -> str:
        return f"{self.name!r}, stage={self.stage}"


class Split:
    """``module`` cut for this rank's ``local`` stages: the others' modules replaced by placeholders, hooks at the
    ends of each local stage. ``replay(stage, received)`` runs the user's step as that stage."""

    def __init__(self, module: nn.Module, plan: PipelinePlan, local: Sequence[int]) -> None:
        self.plan, self.local = plan, tuple(local)
        self.last_stage = plan.stages - 1
        self.replaying: Optional[tuple[int, Optional[Tensor]]] = None
        self.layers: nn.ModuleList = module.get_submodule(plan.layers)
        self._skip = Placeholder(plan.layers, -1, self, layer=-1)  # stands for a local layer of another local stage
        held = {i for s in self.local for i in range(plan.bounds[s], plan.bounds[s + 1])}
        for i in range(len(self.layers)):
            if i not in held:
                self.layers[i] = Placeholder(f"{plan.layers}.{i}", plan.stage_of_layer(i), self, layer=i)
        for names, stage in ((plan.first, 0), (plan.last, self.last_stage)):
            if stage in self.local:
                continue
            for name in names:
                parent, _, attr = name.rpartition(".")
                old = module.get_submodule(name)
                dim = old.embedding_dim if isinstance(old, nn.Embedding) else None
                dtype = old.weight.dtype if dim is not None else None
                setattr(module.get_submodule(parent) if parent else module, attr,
                        Placeholder(name, stage, self, embedding_dim=dim, dtype=dtype))
        # a stage's first layer takes the activation received; it ends where the next stage's first layer, a
        # placeholder here, is called (after its last layer's hooks, which stage 3's backward gathers rely on)
        self._hooks = [self.layers[plan.bounds[s]].register_forward_pre_hook(self._take_received(s), with_kwargs=True)
                       for s in self.local if s > 0]

    def _take_received(self, stage: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if self.replaying is None or self.replaying[0] != stage:
                return None
            received = self.replaying[1]
            if args:
                return (received, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": received}
        return hook

    @contextlib.contextmanager
    def replay(self, stage: int, received: Optional[Tensor]) -> Iterator[None]:
        """Inside: the model runs as stage ``stage`` (``received``: its input from the stage before)."""
        others = [i for s in self.local if s != stage for i in range(self.plan.bounds[s], self.plan.bounds[s + 1])]
        kept = {i: self.layers[i] for i in others}
        for i in others:
            self.layers[i] = self._skip
        self.replaying = (stage, received)
        try:
            yield
        finally:
            self.replaying = None
            for i, layer in kept.items():
                self.layers[i] = layer

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def local_stages(pipeline_rank: int, pipeline_size: int, stages: int) -> tuple[int, ...]:
    """The stages pipeline rank p runs: p, p + P, ... (torch's loop order for interleaved schedules)."""
    return tuple(range(pipeline_rank, stages, pipeline_size))


def loss_of(output: Any) -> Tensor:
    """The loss a step returned: a tensor, or a dict's ``"loss"`` (Lightning's two forms)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor):
        raise ZeroEngineError(f"The training step returned {type(output).__name__} under pipeline parallel, which"
                              " needs a loss to run the backward of every stage. HINT: return the loss (a tensor, or"
                              " a dict with 'loss').")
    return loss


class _StageModule(nn.Module):
    """What torch's ``PipelineStage`` runs for stage ``stage``: the runner's replay of the step."""

    def __init__(self, runner: "PipelineRunner", stage: int) -> None:
        super().__init__()
        object.__setattr__(self, "_runner", runner)
        self.stage = stage

    def forward(self, *inputs: Tensor) -> Tensor:
        return self._runner.run_stage(self.stage, inputs)


class PipelineRunner:
    """Runs the user's step over a batch's micro-batches with a torch pipeline schedule (see [Note: pipeline parallel
    under ZeRO]). A schedule is built per shape of the micro-batches (and per kind of step), after a forward of the
    first micro-batch without gradients through every stage finds the shapes of the activations sent between them."""

    def __init__(self, split: Split, schedule: str, group: Any, device: torch.device) -> None:
        self.split, self.schedule_name = split, schedule
        self.group, self.device = group, device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stages = split.plan.stages
        self._built: dict[Any, Any] = {}
        self._micro: list[Any] = []
        self._step: Optional[Callable[[Any], Any]] = None
        self._next: dict[int, int] = {}
        self.outputs: list[Any] = []  # the last stage's step outputs, one per micro-batch
        self.scale = 1.0  # the loss is multiplied by it before backward (1 / micro-batches, and the fp16 loss scale)
        self.after_backward: Optional[Callable[[], None]] = None  # called after each stage backward (zero3: pinned)
        self.probing = False  # inside the forward that finds the activations' shapes

    def holds_last(self) -> bool:
        return self.stages - 1 in self.split.local

    def run_stage(self, stage: int, inputs: Sequence[Tensor]) -> Tensor:
        index = self._next[stage]
        self._next[stage] = index + 1
        received = inputs[0] if stage > 0 else None
        with self.split.replay(stage, received):
            try:
                output = self._step(self._micro[index])
            except StageOutput as ended:
                if not isinstance(ended.value, Tensor):
                    raise ZeroEngineError(f"Pipeline stage {stage}'s last layer returned {type(ended.value).__name__};"
                                          " the activation sent to the next stage must be a tensor.") from None
                return ended.value
        if stage != self.stages - 1:
            raise ZeroEngineError(
                f"The step returned before the layers of pipeline stage {stage} ran to its end (its last layer is"
                f" `{self.split.plan.layers}.{self.split.plan.bounds[stage + 1] - 1}`): the step must call the model"
                " on every micro-batch. HINT: call the whole model in the step, as under DDP.")
        self.outputs.append(output)
        return loss_of(output) if torch.is_grad_enabled() or output is not None else torch.zeros((), device=self.device)

    def _begin(self, micro: list[Any], step: Callable[[Any], Any]) -> None:
        self._micro, self._step = micro, step
        self._next = {s: 0 for s in self.split.local}
        self.outputs = []

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage % self.size)

    @torch.no_grad()
    def _shapes(self, micro: Any, step: Callable[[Any], Any], train: bool) -> dict[int, tuple[Tensor, Tensor]]:
        """Each local stage's example input and output, from a forward of ``micro`` stage after stage (the
        activations between stages require gradients when ``train``)."""
        examples: dict[int, tuple[Tensor, Tensor]] = {}
        self.probing = True
        try:
            self._probe(micro, step, train, examples)
        finally:
            self.probing = False
            self.outputs = []
        return examples

    def _probe(self, micro: Any, step: Callable[[Any], Any], train: bool,
               examples: dict[int, tuple[Tensor, Tensor]]) -> None:
        for stage in self.split.local:
            if stage == 0:
                given = torch.zeros(1, 1, device=self.device)
            else:
                if stage - 1 in examples:
                    shape, dtype = examples[stage - 1][1].shape, examples[stage - 1][1].dtype
                else:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=self._peer(stage - 1), group=self.group)
                    shape, dtype = box[0]
                given = torch.zeros(shape, dtype=dtype, device=self.device)
            self._begin([micro], step)
            out = self.run_stage(stage, (given,)).detach()
            if train:
                given.requires_grad_(stage > 0)
                out.requires_grad_(stage < self.stages - 1)
            examples[stage] = (given, out)
            if stage < self.stages - 1 and stage + 1 not in self.split.local:
                dist.send_object_list([(tuple(out.shape), out.dtype)], dst=self._peer(stage + 1), group=self.group)

    def _schedule(self, key: Any, micro: list[Any], step: Callable[[Any], Any], train: bool) -> Any:
        if key in self._built:
            return self._built[key]
        m = len(micro)
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        examples = self._shapes(micro[0], step, train)
        stages = [_stage_class()(_StageModule(self, s), s, self.stages, self.device, input_args=examples[s][0],
                                 output_args=examples[s][1], group=self.group) for s in self.split.local]
        for stage in stages:
            stage.runner = self
        loss_fn = self._scaled
        if not train and len(stages) == 1:  # forward only: every schedule runs the same forwards, GPipe at any m
            built = ScheduleGPipe(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        elif self.schedule_name == "interleaved_1f1b":
            built = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
        else:
            kind = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            built = kind(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        self._built[key] = built
        return built

    def _scaled(self, output: Tensor, target: Tensor) -> Tensor:
        return output * self.scale

    def run(self, micro: list[Any], step: Callable[[Any], Any], train: bool) -> list[Any]:
        """``step`` over the micro-batches ``micro`` (forward and backward when ``train``); returns the last stage's
        step outputs (on the ranks holding it; empty elsewhere)."""
        key = (train, len(micro), _shape_key(micro[0]))
        schedule = self._schedule(key, micro, step, train)
        self._begin(micro, step)
        m = len(micro)
        args = (torch.zeros(m, 1, device=self.device),) if 0 in self.split.local else ()
        target = torch.zeros(m, 1, device=self.device) if self.holds_last() else None
        if train:
            schedule.step(*args, target=target, return_outputs=False)
        else:
            schedule.eval(*args, target=target, return_outputs=False)
        return self.outputs


@functools.cache
def _stage_class() -> type:
    """torch's ``PipelineStage``, calling its runner's ``after_backward`` after each backward it runs."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        runner: Optional[PipelineRunner] = None

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
                                       ) -> Any:
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if self.runner is not None and self.runner.after_backward is not None:
                self.runner.after_backward()
            return result

    return Stage


def _shape_key(micro: Any) -> Any:
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(micro)
    return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, Tensor) else repr(x) for x in leaves)


def split_batch(batch: Any, microbatches: int, fewer: bool = False) -> list[Any]:
    """``batch`` cut into ``microbatches`` equal parts along the first dimension of each of its tensors. ``fewer``
    (evaluation): a batch they do not divide (a short last batch) is cut into the most equal parts up to that many."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(batch)
    sizes = {x.shape[0] for x in leaves if isinstance(x, Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise ZeroEngineError(f"A batch of tensors with first dimensions {sorted(sizes)} under pipeline parallel: the"
                              " strategy cuts a batch into micro-batches along one first dimension. HINT: give batches"
                              " whose tensors share the batch dimension first.")
    size = sizes.pop()
    if fewer:
        microbatches = max(d for d in range(1, microbatches + 1) if size % d == 0)
    if size % microbatches:
        raise ZeroConfigError(f"A batch of {size} cut into `pipeline_microbatches={microbatches}`: the micro-batches"
                              f" must be equal. HINT: a batch size that {microbatches} divides (micro batch x"
                              f" {microbatches}), `DataLoader(drop_last=True)` where the last batch is short, or"
                              " another `pipeline_microbatches`.")
    parts = [x.chunk(microbatches) if isinstance(x, Tensor) and x.dim() > 0 else [x] * microbatches for x in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(microbatches)]
