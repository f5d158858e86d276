"""``ZeroFabricStrategy``: the ZeRO engine behind Lightning Fabric (``Fabric(strategy="zero3")``).

The same engine, configuration, precision plugin, checkpoint format and memory accounting as the Trainer's
``ZeroStrategy``; only the glue to Fabric's calls lives here. No module wrapper: ``setup_module`` returns the
user's module with the engine's hooks on it, as the Trainer strategy does.

[Note: the engine starts at first use]
Fabric scripts written for FSDP (litgpt's among them) set the model up first, then build the optimizer from the
set-up model's ``parameters()`` and set it up, then load weights with ``model.load_state_dict`` or
``fabric.load_raw``. The engine partitions parameters by optimizer and param group, so it cannot be built at
``setup_module``. It is built at the model's first use instead, on every rank alike: the first forward,
``load_state_dict``/``state_dict``, ``fabric.load``/``save``/``load_raw``, ``no_backward_sync``, or the first call
on one of its optimizers. Whatever set-up optimizers hold the model's parameters by then are the run's.
``setup_module`` gives the model fresh ``Parameter`` objects (FSDP does the same), so an optimizer built before it
holds none of them and ``setup_optimizers`` refuses it by name.

A stage-3 model built by ``init_module(empty_init=True)`` is built on the meta device with Fabric's empty
initialization (no draws, as under DDP), its construction recorded; the record stays open until ``setup_module``,
so an initialization the script runs on the meta model in between (litgpt's ``pretrain`` calls
``reset_parameters``) is recorded too. At the first use it is materialized one unit at a time: from the state
dict being loaded when that use is a load (each rank keeps its pieces), otherwise by replaying the record (see
[Note: replayed construction] in replay.py), so the weights are the ones the same script gives under DDP.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.init import _EmptyInit
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lzero.lightning import args as strategy_args
from lzero.checkpoint.deepspeed_checkpoint import PRECISION_STATE
from lzero.checkpoint.full_state import gather_optimizer_state
from lzero.checkpoint.formats import is_checkpoint_directory, open_reader
from lzero.checkpoint.pieces import PiecedCheckpoint
from lzero.checkpoint.resume import READER, load_module_state, load_optimizer_states
from lzero.checkpoint.sharded import restore_rng, save_sharded
from lzero.checkpoint.state_dict import (ShardedTensor, consolidate, keys_as_loaded, master_state_dict,
                                         sharded_state_dict)
from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine import activation_checkpointing as checkpointing
from lzero.engine.engine import ZeroEngine
from lzero.engine.loss_scale import LossScaleConfig
from lzero.engine.materialize import has_meta
from lzero.optimizer import ZeroOptimizer, check_optimizer
from lzero.lightning.precision import ZeroFabricPrecision, to_zero_precision
from lzero.checkpoint.sources import LoadedState, ShardedCheckpointWeights, StateDictWeights
from lzero.lightning.fabric_model import SetUpModel, fresh_parameters, placeholders, state_dict_shadows, swap_parameters
from lzero.engine.recording import settle
from lzero.lightning.wiring import (AUTO_RECORD, EveryRankCheck, RanksApart, before_forward,
                                    apply_tp_plan, check_generation_arguments, choose_configuration,
                                    data_parallel_sampler_kwargs, fill_auto_sizes, generation,
                                    keep_generation_synced, meta_device, run_mesh, start_engine, sync_module_states,
                                    take_precision_state, zero_optimizer)

FABRIC_KEYS = "lzero/fabric"
"""The sharded checkpoint's entry naming the state keys of the module and of its optimizers (a Fabric save)."""
OPTIMIZER_HINT = "pass the optimizer returned by `fabric.setup_optimizers` (or `fabric.setup`)"


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO data parallelism under Fabric: ``Fabric(strategy="zero3")`` or ``Fabric(strategy=ZeroFabricStrategy(...))``.

    Args:
        config: a :class:`lzero.ZeroConfig`, or a DeepSpeed JSON configuration (a path or a dict), as for
            :class:`lzero.ZeroStrategy`. Its ``optimizer``/``scheduler`` blocks are refused: a Fabric script builds
            its own.
        stage: shortcut for ``config.stage``; ``"auto"`` chooses the stage and offload at the first use of the model.
        precision: a precision for this strategy; it wins over ``Fabric(precision=...)``.
        init_fn, activation_checkpointing, cpu_checkpointing, memory_budget_bytes, memory_margin, loss_scaling,
            allow_untested_optimizer: as for :class:`lzero.ZeroStrategy`.
        **options: any other :class:`lzero.ZeroConfig` field, applied over ``config``.

    The remaining arguments are Fabric's, as for its ``DDPStrategy``. See [Note: the engine starts at first use].
    """

    strategy_name = "zero"

    def __init__(
        self,
        config: Optional[Union[ZeroConfig, dict, str]] = ZeroConfig(),
        stage: Optional[Union[int, Literal["auto"]]] = None,
        allow_untested_optimizer: Optional[bool] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        init_fn: Optional[Callable[[nn.Module], None]] = None,
        precision: Optional[str] = None,
        activation_checkpointing: checkpointing.ModuleChoice = None,
        cpu_checkpointing: bool = False,
        memory_budget_bytes: Optional[int] = None,
        memory_margin: float = 0.2,
        loss_scaling: Optional[Union[dict, LossScaleConfig]] = None,
        parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]] = None,
        **options: Any,
    ) -> None:
        args = strategy_args.resolve(config, stage, allow_untested_optimizer, precision, loss_scaling,
                                     cpu_checkpointing, {}, options)
        if parallelize_fn is not None and args.config.tensor_parallel_size == 1:
            raise ZeroConfigError("`parallelize_fn` with `tensor_parallel_size=1`: it parallelizes over the tensor"
                                  " dimension, and there is none. HINT: pass `tensor_parallel_size=T` (T > 1).")
        if parallelize_fn is not None and args.config.tp_plan is not None:
            raise ZeroConfigError(f"`parallelize_fn` beside `tp_plan={args.config.tp_plan!r}`: both would split the"
                                  " model. HINT: keep one of them.")
        if args.config.tensor_parallel_size > 1 and args.auto:
            raise ZeroConfigError(f"`stage='auto'` with `tensor_parallel_size={args.config.tensor_parallel_size}`: the"
                                  " automatic choice does not count tensor-parallel shards yet. HINT: give the stage.")
        if args.config.pipeline_parallel_size > 1 and args.auto:
            raise ZeroConfigError(f"`stage='auto'` with `pipeline_parallel_size={args.config.pipeline_parallel_size}`:"
                                  " the automatic choice does not count a stage's share of the model yet. HINT: give"
                                  " the stage.")
        if args.deepspeed is not None and (args.deepspeed.optimizer is not None or args.deepspeed.scheduler is not None):
            raise ZeroConfigError(
                "The DeepSpeed configuration has an `optimizer` or `scheduler` block, which a Fabric script does not"
                " use: it builds its own optimizer and passes it to `fabric.setup_optimizers`. HINT: drop the block"
                " and build that optimizer in the script (`lzero convert-config` prints its class and arguments).")
        self.config, self._auto, self._deepspeed = args.config, args.auto, args.deepspeed
        self.memory_budget_bytes, self.memory_margin = memory_budget_bytes, memory_margin
        self._given_precision = args.precision  # the strategy's own (`precision=...`): it wins over Fabric's
        self._auto_record: Optional[dict] = None  # stage="auto": the choice, kept in checkpoints
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=args.precision, process_group_backend=process_group_backend, timeout=timeout,
                         start_method="popen")
        self.init_fn = init_fn
        self._checkpoint_policy = checkpointing.CheckpointPolicy(activation_checkpointing, args.cpu_checkpointing)
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self._models: list[SetUpModel] = []
        self._recording: Optional[contextlib.ExitStack] = None  # a meta build's record, open until setup_module
        self._steps = 0  # optimizer steps taken or skipped, all optimizers: the "global step" of skip reports
        self._mesh: Any = None  # the run's process groups (run_mesh), made at the first that one needs
        self.parallelize_fn = parallelize_fn  # tensor parallel: Fabric's ModelParallelStrategy contract
        self._device_mesh: Any = None  # tensor or pipeline parallel: the DeviceMesh, made at setup_environment
        self._pipeline: Any = None  # pipeline parallel: the set-up model's stages (a StagePipeline), made at setup
        self._pipeline_loss: Optional[Tensor] = None  # the last `pipeline_step`'s loss: its backward has run
        self._pipeline_running = False  # inside `pipeline_step`: the module's hooks leave the start to it
        self._ranks_check: Optional[EveryRankCheck] = None  # see [Note: every rank at a collective call]

    # --- plugins -----------------------------------------------------------------------------

    @property
    @override
    def precision(self) -> ZeroFabricPrecision:
        return self._precision if isinstance(self._precision, ZeroFabricPrecision) else ZeroFabricPrecision()

    @precision.setter
    @override
    def precision(self, plugin: Optional[Precision]) -> None:
        given = getattr(self, "_given_precision", None)
        self._precision = given if given is not None else to_zero_precision(plugin)

    # --- building the model -----------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """Stage 3 with ``empty_init=True``: the meta device, no initialization drawn (as Fabric's empty init), the
        construction recorded until ``setup_module``. See [Note: the engine starts at first use]."""
        if self.config.stage < 3 or not empty_init:
            return super().module_init_context(empty_init)
        return self._meta_build()

    @contextlib.contextmanager
    def _meta_build(self) -> Generator:
        self._close_recording()
        recording = contextlib.ExitStack()
        try:
            # the precision's dtype outside the meta context: [Note: the construction's default dtype]
            with self.precision.module_init_context(), meta_device(self.root_device, recording), \
                    _EmptyInit(enabled=True):
                yield
        except BaseException:
            recording.close()
            raise
        self._recording = recording

    def _close_recording(self) -> None:
        if self._recording is not None:
            recording, self._recording = self._recording, None
            recording.close()

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if not has_meta(module):  # a meta model is materialized unit by unit by the engine
            module.to(self.root_device)

    # --- setup: see [Note: the engine starts at first use] -------------------------------------

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
                                    ) -> tuple[nn.Module, list[Optimizer], Any]:
        module = self._setup(module, refresh=False)  # these optimizers were built from it on purpose
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._setup(module, refresh=True)

    def _run_mesh(self) -> Any:
        """The run's process groups, made once (see [Note: the mesh] in lzero/engine/mesh.py)."""
        self._mesh = run_mesh(self._mesh, self.config, self._deepspeed, self._device_mesh)
        return self._mesh

    # --- tensor parallel: see [Note: tensor parallel under ZeRO] in lzero/engine/tensor_parallel.py ----------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        config = self.config
        if (config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1) and self._device_mesh is None:
            from lzero.engine.mesh import tensor_parallel_mesh

            self._device_mesh = tensor_parallel_mesh(config.tensor_parallel_size, self.root_device.type,
                                                     config.pipeline_parallel_size)

    @property
    def device_mesh(self) -> Any:
        """Tensor parallel: the 2-D ``DeviceMesh`` ``("data_parallel", "tensor_parallel")``, as Fabric's
        ``ModelParallelStrategy`` has it (``parallelize_fn(module, device_mesh)`` receives it); with a pipeline, 3-D,
        ``("pipeline_parallel", "data_parallel", "tensor_parallel")``."""
        if self._device_mesh is None:
            raise RuntimeError("`strategy.device_mesh` exists with `tensor_parallel_size` > 1, once `fabric.launch()`"
                               f" has started the processes (tensor_parallel_size={self.config.tensor_parallel_size}).")
        return self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel rank and size: the ranks of one tensor-parallel group read the same batches."""
        return data_parallel_sampler_kwargs(self.world_size, self.global_rank, self.config.tensor_parallel_size,
                                            self.config.pipeline_parallel_size)

    def _parallelize(self, module: nn.Module, jointly: bool) -> nn.Module:
        """``parallelize_fn(module, device_mesh)`` or ``tp_plan`` over the tensor dimension, at ``fabric.setup``."""
        from lzero.engine.tensor_parallel import check_tensor_parallel_precision

        check_tensor_parallel_precision(self.config.tensor_parallel_size, self.precision.precision)
        if self.parallelize_fn is None and self.config.tp_plan is None:
            return module  # the script parallelized it itself (or holds nothing to split)
        if has_meta(module):
            raise ZeroConfigError("Tensor parallel of a model built on the meta device (`fabric.init_module("
                                  "empty_init=True)` at zero3): not built yet. HINT: build it without `empty_init`.")
        if jointly:
            raise ZeroConfigError(
                "`fabric.setup(model, optimizer)` with tensor parallel: the plan replaces the model's parameters with"
                " DTensors, which the optimizer built before does not hold. HINT: `model = fabric.setup_module(model)`,"
                " then build the optimizer from `model.parameters()` and `fabric.setup_optimizers(optimizer)`, as"
                " Fabric's ModelParallelStrategy asks.")
        if self.parallelize_fn is not None:
            return self.parallelize_fn(module, self.device_mesh)
        apply_tp_plan(module, self.config, self.device_mesh)
        return module

    def _setup(self, module: nn.Module, refresh: bool) -> nn.Module:
        self._close_recording()
        settle(module)  # the fake tensors of `init_module(empty_init=True)` become meta ones: [Note: a fake device]
        if any(m.module is module for m in self._models):
            raise RuntimeError(f"`{type(module).__name__}` is set up already. HINT: call `fabric.setup` once per model.")
        if self.config.tensor_parallel_size > 1:
            module = self._parallelize(module, jointly=not refresh)
        if self.config.pipeline_parallel_size > 1:
            self._cut_into_stages(module, jointly=not refresh)
        if self._ranks_check is None:  # for all_ranks_at; made while every rank is here
            self._ranks_check = EveryRankCheck(self._run_mesh(), self.config.exception_checkpoint_timeout_s)
        model = SetUpModel(module)
        if has_meta(module):  # Fabric refuses optimizers over meta tensors: they get placeholders until the start
            model.meta = placeholders(module, self.root_device)
        elif refresh:  # so that an optimizer built before holds none of them
            fresh_parameters(module)
        self._models.append(model)
        model.undo.enter_context(state_dict_shadows(self, model))
        # run eagerly when the model is compiled (litgpt compiles it before setup): the start and the root's gather
        # are collectives, which dynamo must not trace
        pre = module.register_forward_pre_hook(torch.compiler.disable(lambda *_: self._before_forward(model)),
                                               prepend=True)
        post = module.register_forward_hook(torch.compiler.disable(lambda *_: self._after_forward(model)))
        model.undo.callback(pre.remove)
        model.undo.callback(post.remove)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> ZeroOptimizer:
        model = next((m for m in self._models if m.owns(optimizer)), None)
        if model is None:
            raise ZeroConfigError(
                f"`{type(optimizer).__name__}` holds none of the set-up model's parameters: it was built before"
                " `fabric.setup_module(model)`, which gives the model the parameters lzero manages. HINT: build the"
                " optimizer from the set-up model (`model = fabric.setup_module(model)`, then"
                " `optimizer = torch.optim.AdamW(model.parameters())`, then `fabric.setup_optimizers(optimizer)`), or"
                " pass both at once: `fabric.setup(model, optimizer)`.")
        if model.started:
            raise ZeroConfigError(
                f"`fabric.setup_optimizers({type(optimizer).__name__})` after the model's first use: lzero partitioned"
                " the model for the optimizers set up before it. HINT: set up every optimizer right after"
                " `fabric.setup_module(model)`, before the first forward, load or save.")
        check_optimizer(optimizer, self.config.allow_untested_optimizer, self.config.optimizer_partition)
        zopt = ZeroOptimizer(optimizer, None, start=lambda: self._start(model))
        model.zero.append(zopt)
        return zopt

    def _model_of(self, module: nn.Module) -> SetUpModel:
        module = getattr(module, "_forward_module", module)
        for model in self._models:
            if model.module is module:
                return model
        raise RuntimeError(f"`{type(module).__name__}` was not set up by this strategy. HINT: `fabric.setup(model)`.")

    def _start(self, model: SetUpModel, weights: Any = None) -> None:
        """The engine of ``model``, built at its first use (a collective). ``weights``: the state being loaded, which
        a meta model is materialized from."""
        if model.started:
            return
        self.all_ranks_at("The model's first use (lzero builds its shards then)")
        model.started = True
        if model.meta:  # the meta parameters back, in the module and in the optimizers, for the engine to materialize
            swap_parameters(model.module, model.zero, model.meta)
            model.meta = {}
        module, optimizers = model.module, [z.optimizer for z in model.zero]
        self.config = fill_auto_sizes(self.config, module)  # then the stage, as at the Trainer's door
        if self._auto:
            self.config, self._auto_record = choose_configuration(
                self.config, module, self.precision, self.world_size, self.num_processes, self.root_device,
                self.memory_budget_bytes, self.memory_margin)
        if not optimizers and self.config.stage < 3:
            sync_module_states(module)  # as DDP's wrapper does: rank 0's weights everywhere
            return
        checkpointed = checkpointing.apply(module, self._checkpoint_policy, self.config)
        if checkpointed is not None:
            model.undo.callback(checkpointed.remove)
        engine, _ = start_engine(module, optimizers, self.config, self.precision, self.root_device, self.num_processes,
                                 self.init_fn, weights=weights, evaluating=not optimizers, attach_to=model.zero,
                                 deepspeed=self._deepspeed, memory_budget_bytes=self.memory_budget_bytes,
                                 mesh=self._run_mesh())
        engine.automatic = False  # stage 1 reduces in the step, whether the script uses no_backward_sync or not
        if self._pipeline is not None:
            self._pipeline.attach(engine, self._run_mesh())
        model.engine = engine
        keep_generation_synced(model.undo, module, self.config, self.world_size)

    def engine_of(self, optimizer: Any) -> tuple[Optional[ZeroEngine], list[ZeroOptimizer]]:
        """The engine that ``optimizer`` steps and all the optimizers of its model (for :class:`lzero.MemoryMonitor`)."""
        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT)
        model = next((m for m in self._models if any(z is zopt for z in m.zero)), None)
        return (model.engine, model.zero) if model is not None else (None, [])

    # --- forward, backward, step ---------------------------------------------------------------

    def _before_forward(self, model: SetUpModel) -> None:
        self._start(model)
        if self._pipeline_running:
            return  # once for the whole schedule, by pipeline_step
        before_forward(model.engine)

    def _after_forward(self, model: SetUpModel) -> None:
        if model.engine is not None and not torch.is_grad_enabled() and not self._pipeline_running:
            model.engine.release_all()  # no backward will release the root

    # --- pipeline parallel: see [Note: pipeline steps under Fabric] ---------------------------------------------

    def _cut_into_stages(self, module: nn.Module, jointly: bool) -> None:
        from lzero.lightning.pipeline import StagePipeline

        size = self.config.pipeline_parallel_size
        if jointly:
            raise ZeroConfigError(
                f"`fabric.setup(model, optimizer)` with `pipeline_parallel_size={size}`: the cut leaves this rank its"
                " stages' parameters only, and the optimizer built before holds every stage's. HINT: `model ="
                " fabric.setup_module(model)`, then build the optimizer from `model.parameters()` and"
                " `fabric.setup_optimizers(optimizer)`.")
        if self._pipeline is not None:
            raise ZeroConfigError(f"A second model under `pipeline_parallel_size={size}`: one pipeline per strategy."
                                  " HINT: set up one pipelined model per Fabric.")
        self._pipeline = StagePipeline(module, self.config, self.device_mesh, self.root_device)

    def pipeline_step(self, model: nn.Module, step: Callable[[nn.Module, Any], Tensor], batch: Any) -> Tensor:
        """[Note: pipeline steps under Fabric]
        Under ``pipeline_parallel_size`` > 1, one training step of the set-up ``model``: ``batch`` is cut into
        ``pipeline_microbatches`` micro-batches and ``step(model, micro_batch)`` (what the loop computes before
        ``fabric.backward``: the model call and the loss) runs on each, every stage replaying it on its own layers
        through the schedule, which runs every backward (see [Note: pipeline parallel under ZeRO] in
        lzero/engine/pipeline.py). Returns the mean of the micro-batches' losses, the same on every rank; a
        ``fabric.backward`` of it only calls the hooks (the backward has run), so a loop keeps its shape::

            loss = fabric.strategy.pipeline_step(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch)
            fabric.backward(loss)  # optional: the schedule ran it
            optimizer.step(); optimizer.zero_grad()

        A collective: every rank calls it with its batch (the stages of one pipeline read the same batches:
        ``distributed_sampler_kwargs`` gives the data rank)."""
        if self._pipeline is None:
            raise ZeroConfigError("`strategy.pipeline_step(...)` without `pipeline_parallel_size` > 1: there is no"
                                  " pipeline. HINT: call the model and `fabric.backward(loss)` as usual, or pass"
                                  " `ZeroFabricStrategy(pipeline_parallel_size=P)`.")
        import lightning.fabric.wrappers as wrappers

        setup = self._model_of(model)
        self._start(setup)
        before_forward(setup.engine)
        # the schedule's backwards are this step's `fabric.backward`: the set-up module's outputs check for one
        self._pipeline_running, inside = True, wrappers._in_fabric_backward
        wrappers._in_fabric_backward = True
        try:
            outputs = self._pipeline.run(lambda micro: step(model, micro), batch, True, setup.engine,
                                         loss_scale=self.precision.loss_scale)
        finally:
            self._pipeline_running, wrappers._in_fabric_backward = False, inside
        loss, _ = self._pipeline.mean_loss(outputs)
        self._pipeline_loss = loss
        return loss

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self._pipeline is not None and tensor is self._pipeline_loss:
            return  # the schedule ran every backward of this step
        scale = self.precision.loss_scale
        (tensor * scale if scale != 1.0 else tensor).backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT).started()
        self.precision.step_or_skip(zopt, self._steps, self.is_global_zero, **kwargs)
        self._steps += 1

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Over the global norm of every rank's reduced gradient shards, as ``clip_grad_norm_`` over DDP's."""
        if float(norm_type) != 2.0:
            raise ValueError(f"`clip_gradients(norm_type={norm_type!r})`: lzero clips by the global L2 norm only."
                             " HINT: use `norm_type=2` (the default), or `clip_val=` to clip by value.")
        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT).started()
        norm = zopt.engine.clip_grad_norm_(zopt.units, float(max_norm))
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of the gradients is {norm.item()}: non-finite, so they cannot be"
                               " clipped. HINT: `fabric.clip_gradients(..., error_if_nonfinite=False)` lets the step"
                               " skip it (see [Note: skipped steps] in lzero/lightning/precision.py).")
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT).started()
        zopt.engine.clip_grad_value_(zopt.units, float(clip_val))

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full per-parameter state in torch's format, on every rank (a collective)."""
        return zero_optimizer(optimizer, OPTIMIZER_HINT).state_dict()

    # --- state dicts and checkpoints -----------------------------------------------------------

    def full_state_dict(self, model: SetUpModel, to_all: bool = True) -> dict[str, Any]:
        """``model``'s whole state dict (fp32 masters under mixed precision), on every rank or on rank 0 only. A
        collective (its callers check first that every rank takes part: :meth:`all_ranks_at`)."""
        self._start(model)
        engine = model.engine
        model.inside = True
        try:
            if engine is None:
                return model.module.state_dict()
            engine.flush_delayed_update()
            if engine.mixed:
                return master_state_dict(engine, model.module, to_all=to_all)
            if engine.gatherer is None:
                return model.module.state_dict()
            return consolidate(engine, sharded_state_dict(engine, model.module), to_all=to_all)
        finally:
            model.inside = False

    def load_full_state_dict(self, model: SetUpModel, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Into the shards and their fp32 masters, each rank reading only the pieces it owns. A collective. Keys as
        the module's own loading takes them (its hooks may rename them: ``keys_as_loaded``)."""
        nested = [k for k, v in state_dict.items() if not hasattr(v, "shape")]
        if nested:
            raise TypeError(
                f"A model's state dict holds tensors, but {', '.join(f'`{k}`' for k in nested[:5])} holds a"
                f" {type(state_dict[nested[0]]).__name__}: this looks like a whole checkpoint (its keys:"
                f" {list(state_dict)[:5]}), not the model's state. HINT: `fabric.load_raw(path, model)` takes a file"
                " written by `torch.save(model.state_dict())` (what `lzero consolidate` writes for a Fabric save);"
                " for a checkpoint saved as `fabric.save(path, {\"model\": model, ...})` use `fabric.load(path, state)`.")
        state_dict = LoadedState(keys_as_loaded(model.module, state_dict))
        if model.on_meta:  # materialized from this very state (and what it lacks, as built): nothing left to load
            if strict:
                own = type(model.module).state_dict(model.module, keep_vars=True)
                missing, unexpected = [k for k in own if k not in state_dict], [k for k in state_dict if k not in own]
                if missing or unexpected:
                    raise RuntimeError(f"Error(s) in loading state_dict for {type(model.module).__name__}: missing keys"
                                       f" {missing[:10]}, unexpected keys {unexpected[:10]}. HINT: load the checkpoint"
                                       " of this model, or pass `strict=False`.")
            self._start(model, weights=StateDictWeights(state_dict))
            return
        self._start(model)
        model.inside = True
        try:
            if model.engine is None:
                model.module.load_state_dict(state_dict, strict=strict)
                return
            model.engine.flush_delayed_update()
            load_module_state(model.engine, model.module, {"state_dict": state_dict}, strict)
        finally:
            model.inside = False

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        self.all_ranks_at("`model.state_dict()`")
        return self.full_state_dict(self._model_of(module))

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        self.load_full_state_dict(self._model_of(module), state_dict, strict)

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """``checkpoint_format="sharded"`` (the default): a checkpoint directory, every rank writing its own pieces
        (the Trainer's layout, see [Note: sharded checkpoint layout]); ``"full"``: one file on rank 0 that
        ``torch.load(weights_only=True)`` reads, as Fabric's DDP writes it. A collective."""
        self.all_ranks_at("`fabric.save`")
        filter = filter or {}
        modules = {k: self._model_of(v) for k, v in state.items() if isinstance(v, nn.Module)}
        for model in modules.values():
            self._start(model)
        if self.config.checkpoint_format == "sharded" and any(m.engine is not None for m in modules.values()):
            self._save_sharded(Path(path), state, modules, filter)
            return
        out = {key: self._saved_value(key, value, modules, filter) for key, value in state.items()}
        out[PRECISION_STATE] = self.precision.state_dict()  # as the sharded form keeps it: both doors restore it
        if self._auto_record:
            out[AUTO_RECORD] = self._auto_record
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint=out, path=path, storage_options=storage_options)

    def _save_sharded(self, path: Path, state: dict[str, Any], modules: dict[str, SetUpModel],
                      filter: dict[str, Callable[[str, Any], bool]]) -> None:
        sharded = [k for k, m in modules.items() if m.engine is not None]
        if len(sharded) > 1:
            raise ValueError(f"`fabric.save` of several sharded models ({', '.join(sharded)}) in one checkpoint. HINT:"
                             " save each model in a checkpoint of its own.")
        key = sharded[0]
        model = modules[key]
        engine = model.engine
        engine.flush_delayed_update()
        optimizers = {k: v for k, v in state.items() if isinstance(v, ZeroOptimizer) and v in model.zero}
        model.inside = True  # the module's own state dict (its parameters), not the shadow's whole one
        try:
            module_state = sharded_state_dict(engine, model.module)
        finally:
            model.inside = False
        kept = None
        if key in filter:  # a sharded value reaches the filter as a ShardedTensor (shape, dtype, full_tensor())
            module_state = {k: v for k, v in module_state.items() if filter[key](k, v)}
            names = {v.spec.name for v in module_state.values() if isinstance(v, ShardedTensor)}
            kept = names.__contains__
        checkpoint: dict[str, Any] = {"state_dict": module_state, PRECISION_STATE: self.precision.state_dict(),
                                      FABRIC_KEYS: {"module": key, "optimizers": list(optimizers)}}
        checkpoint.update({name: self._saved_value(name, value, modules, filter) for name, value in state.items()
                           if name != key and name not in optimizers})
        ordered = [model.zero.index(z) for z in optimizers.values()]
        save_sharded(path, engine, [model.zero[i] for i in ordered], checkpoint, None, kept, stage=self.config.stage,
                     precision=self.precision.precision, front="fabric",
                     **({"auto": self._auto_record} if self._auto_record else {}))

    def _saved_value(self, key: str, value: Any, modules: dict[str, SetUpModel],
                     filter: dict[str, Callable[[str, Any], bool]]) -> Any:
        """A state entry as a checkpoint holds it: a module's whole state dict and an optimizer's full state on rank 0
        (collectives), another object's ``state_dict()``, a plain value as it is; ``filter[key]`` applied."""
        if key in modules:
            value = self.full_state_dict(modules[key], to_all=False)
        elif isinstance(value, ZeroOptimizer):
            value = gather_optimizer_state(value.started())
        elif hasattr(value, "state_dict") and callable(value.state_dict):
            value = value.state_dict()
        if key in filter and isinstance(value, dict):
            value = {k: v for k, v in value.items() if filter[key](k, v)}
        return value

    @override
    def load_checkpoint(self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded checkpoint directory (any world size, stage or offload choice), a DeepSpeed checkpoint folder
        (into ``state``'s module and its optimizer) or a full file; ``state``'s modules and optimizers are restored in
        place, its other entries replaced; the rest is returned."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint `{path}` does not exist. HINT: check the path given to `fabric.load`.")
        if is_checkpoint_directory(path):
            modules = [v for v in (state.values() if isinstance(state, dict) else [state]) if isinstance(v, nn.Module)]
            names = [n for n, _ in self._model_of(modules[0]).module.named_parameters(remove_duplicate=False)
                     ] if modules else None  # a DeepSpeed folder's names are matched to them
            return self._load_sharded(open_reader(path, names), state, strict)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=True if weights_only is None else weights_only)
        if not state:
            return checkpoint
        if isinstance(state, nn.Module):
            self.load_full_state_dict(self._model_of(state), checkpoint, strict)
            return {}
        if isinstance(state, Optimizer):
            zero_optimizer(state, OPTIMIZER_HINT).load_state_dict(checkpoint)
            return {}
        missing = [k for k in state if k not in checkpoint]
        if strict and missing:
            raise KeyError(f"The checkpoint `{path}` has no {missing}. HINT: pass `strict=False` to load the rest.")
        precision = take_precision_state(checkpoint)
        if precision is not None:
            self.precision.load_state_dict(precision)
        checkpoint.pop(AUTO_RECORD, None)
        for name, obj in list(state.items()):
            if name not in checkpoint:
                continue
            value = checkpoint.pop(name)
            if isinstance(obj, nn.Module):
                self.load_full_state_dict(self._model_of(obj), value, strict)
            elif hasattr(obj, "load_state_dict") and callable(obj.load_state_dict):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return checkpoint

    def _load_sharded(self, reader: PiecedCheckpoint, state: Any, strict: bool) -> dict[str, Any]:
        saved = reader.lightning_state()
        common = {k: v for k, v in saved.items() if not k.startswith("lzero/") or k == PRECISION_STATE}
        precision = take_precision_state(common)
        keys = saved.get(FABRIC_KEYS) or {"module": "state_dict", "optimizers": []}  # a Trainer's: its module state
        if reader.from_deepspeed and isinstance(state, dict):  # one module and its optimizer
            keys = {"module": next((k for k, v in state.items() if isinstance(v, nn.Module)), "state_dict"),
                    "optimizers": [k for k, v in state.items() if isinstance(v, ZeroOptimizer)][:1]}
        common.pop("state_dict", None)
        module_key, optimizer_keys = keys["module"], list(keys["optimizers"])
        checkpoint = {READER: reader, "state_dict": None}
        if isinstance(state, nn.Module):
            state = {module_key: state}
        if not state:
            return {module_key: reader.full_state_dict(), **common}
        missing = [k for k in state if k != module_key and k not in optimizer_keys and k not in common]
        if strict and missing:
            raise KeyError(f"The checkpoint `{reader.path}` has no {missing}. HINT: pass `strict=False` to load the rest.")
        module = state.get(module_key)
        if module is not None:
            model = self._model_of(module)
            self._start(model, weights=ShardedCheckpointWeights(reader) if model.on_meta else None)
            if model.engine is None:
                model.module.load_state_dict(reader.full_state_dict(), strict=strict)
            else:
                load_module_state(model.engine, model.module, checkpoint, strict)
        optimizers = [state[k] for k in optimizer_keys if k in state]
        if optimizers:
            load_optimizer_states([zero_optimizer(o, OPTIMIZER_HINT).started() for o in optimizers], checkpoint)
        restore_rng(reader, self.global_rank, self.world_size)
        if precision is not None:
            self.precision.load_state_dict(precision)
        for name, obj in list(state.items()):
            if name == module_key or name in optimizer_keys or name not in common:
                continue
            value = common.pop(name)
            if hasattr(obj, "load_state_dict") and callable(obj.load_state_dict) and not isinstance(obj, nn.Module):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return common

    def all_ranks_at(self, what: str) -> None:
        """Every rank reached the collective ``what`` within ``exception_checkpoint_timeout_s``, or a clear error
        (called where a user's call enters a collective: a save, a state dict, a model's first use). See [Note:
        every rank at a collective call] in wiring.py."""
        if self._ranks_check is None:
            return
        try:
            self._ranks_check.wait(what)
        except RanksApart as err:
            raise RanksApart(f"{what} is a collective under lzero (every rank gathers or writes its pieces), but {err}."
                             " HINT: call it on every rank, not inside `if fabric.global_rank == 0:`.") from err

    # --- the rest of Fabric's calls --------------------------------------------------------------

    @contextlib.contextmanager
    def generation(self, module: Optional[nn.Module] = None, mode: Literal["gathered", "streamed"] = "gathered"
                   ) -> Generator:
        """Stage 3, for generation on some ranks only (a sample on rank 0): entered on every rank (a collective), the
        forwards inside run no collective. ``module``: a model set up by this strategy (the default: the only one).
        The modes and their memory checks are ``ZeroStrategy.generation``'s."""
        check_generation_arguments(module, mode, "a model set up by `fabric.setup`",
                                   "with fabric.strategy.generation(model, mode='streamed'):")
        if module is None:
            if len(self._models) != 1:
                raise ValueError(f"`strategy.generation()` without a module, but {len(self._models)} models are set"
                                 " up. HINT: name one: `fabric.strategy.generation(model)`.")
            model = self._models[0]
        else:
            model = self._model_of(module)
        self._start(model)
        with generation(model.engine, model.module, mode, self.root_device, self.memory_budget_bytes,
                        self.memory_margin, self.num_processes):
            yield

    @override
    def teardown(self) -> None:
        self._close_recording()
        for model in self._models:
            if model.engine is not None:
                model.engine.flush_delayed_update()
            model.undo.close()
        self._models = []
        if self._ranks_check is not None:
            self._ranks_check.close()
            self._ranks_check = None
        super().teardown()


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=True)``: the accumulating micro-steps reduce nothing."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        model = self.strategy._model_of(module)
        self.strategy._start(model)
        return model.engine.no_sync() if model.engine is not None else contextlib.nullcontext()

