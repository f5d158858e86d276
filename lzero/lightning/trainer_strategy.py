"""``ZeroStrategy``: thin Lightning glue over the ZeRO engine.

It reuses ``DDPStrategy`` for everything that is not ZeRO-specific (launching, process groups,
barrier/broadcast/reduce, samplers) and replaces the DDP wrapper with the engine: no module
wrapper, gradient hooks on the parameters, and optimizers re-targeted at the shards.
"""

from __future__ import annotations

import contextlib
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.optim import Optimizer
from typing_extensions import override

from lzero.engine import activation_checkpointing as checkpointing
from lzero.deepspeed import config as deepspeed_config
from lzero.checkpoint.full_state import gather_optimizer_state
from lzero.checkpoint.averages import load_averages
from lzero.checkpoint.resume import READER, load_module_state, load_optimizer_states, open_checkpoint
from lzero.checkpoint.sharded import AsyncSaver, save_sharded
from lzero.checkpoint.state_dict import consolidate, has_sharded, module_state_dict
from lzero.lightning import args as strategy_args
from lzero.config import ZeroConfig, ZeroConfigError
from lzero.engine.engine import ZeroEngine
from lzero.engine.loss_scale import LossScaleConfig
from lzero.engine.materialize import has_meta
from lzero.optimizer import check_optimizer
from lzero.lightning.precision import to_zero_precision
from lzero.lightning.trainer_kept import gather_back, keep, kept_engine, take_kept
from lzero.lightning.trainer_precision import OPTIMIZER_HINT, ZeroPrecision
from lzero.engine.rank_memory import rank_budget_bytes
from lzero.engine.recording import settle
from lzero.engine.tensor_parallel import check_same_inputs, check_tensor_parallel_precision
from lzero.lightning.trainer_averaging import defer_setup, shard_weight_averaging
from lzero.lightning.trainer_wiring import (activation_probe, add_memory_monitor, guard_lr_schedulers, micro_batch_size,
                                            optimizers_from_deepspeed_blocks, watch_gradient_reads)
from lzero.lightning.wiring import (AUTO_RECORD, EveryRankCheck, RanksApart, apply_tp_plan, before_forward,
                                    check_generation_arguments, choose_configuration, data_parallel_sampler_kwargs,
                                    fill_auto_sizes, generation,
                                    keep_generation_synced, meta_device, named, run_mesh, start_engine,
                                    sync_module_states, take_precision_state, zero_optimizer)


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism: ``Trainer(strategy="zero2")`` or ``Trainer(strategy=ZeroStrategy(...))``.

    Args:
        config: the full configuration; see :class:`lzero.ZeroConfig` for every field. Or a DeepSpeed JSON
            configuration (a path or a dict), as for Lightning's ``DeepSpeedStrategy(config=...)``: translated by
            :func:`lzero.deepspeed.config.translate`, every key honoured or refused by name; its batch keys,
            ``gradient_clipping`` and precision are checked against the Trainer's at setup. The other arguments
            given here win over it.
        stage: shortcut for ``config.stage``; ``"auto"`` (the ``zero_auto`` preset) chooses the stage and offload at
            setup from the model's size and the memory available (see [Note: choosing a stage] in auto.py).
        memory_budget_bytes: with ``stage="auto"``, the device's budget (the host's on CPU) instead of the memory
            found free; at stage 3 with ``schedule="auto"`` (the default), the bytes a rank's in-step peak may reach
            (see [Note: choosing the gather schedule] in engine/schedule.py).
        memory_margin: with ``stage="auto"``, the fraction of the budget kept for activations and buffers.
        allow_untested_optimizer: shortcut for ``config.allow_untested_optimizer``.
        precision: a precision for this strategy (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``);
            it wins over ``Trainer(precision=...)``.
        init_fn: stage 3, for models built on the meta device (``configure_model`` or
            ``Trainer.init_module(empty_init=True)``): called on every module, children before parents,
            after the modules' own ``reset_parameters()``, as ``model.apply(init_fn)`` after building the
            model eagerly would be; by default a Hugging Face model's ``_init_weights`` for the modules
            inside one. See [Note: meta-device initialization] in materialize.py.
        activation_checkpointing: modules that recompute their forward in backward instead of keeping its
            activations (non-reentrant ``torch.utils.checkpoint``), while fitting: True for the stage-3 unit
            classes (the transformer blocks, at every stage), or a list of module classes or class names.
            Parameter and state_dict names are unchanged. See [Note: checkpointing inside the module's hooks]
            in activation_checkpointing.py.
        cpu_checkpointing: keep the checkpointed modules' saved inputs in host memory (DeepSpeed's option).
        loss_scaling: with ``precision="16-mixed"``, DeepSpeed's fp16 loss-scaling knobs (a dict of
            :class:`lzero.LossScaleConfig` fields, or one).
        deepspeed_optimizer: a DeepSpeed ``optimizer`` block (``{"type": "AdamW", "params": {...}}``), built when
            ``configure_optimizers`` returns nothing (``lzero convert-config`` writes a file's block here).
        deepspeed_scheduler: a DeepSpeed ``scheduler`` block (``{"type": "WarmupLR", "params": {...}}``), stepped
            every optimizer step with DeepSpeed's rates (see lzero/deepspeed/schedules.py).
        **options: any other :class:`lzero.ZeroConfig` field, applied over ``config``.

    The remaining arguments are Lightning's, as for ``DDPStrategy``.
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
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
        precision: Optional[str] = None,
        activation_checkpointing: checkpointing.ModuleChoice = None,
        cpu_checkpointing: bool = False,
        memory_budget_bytes: Optional[int] = None,
        memory_margin: float = 0.2,
        loss_scaling: Optional[Union[dict, LossScaleConfig]] = None,
        deepspeed_optimizer: Optional[dict] = None,
        deepspeed_scheduler: Optional[dict] = None,
        **options: Any,
    ) -> None:
        blocks = {k: v for k, v in (("optimizer", deepspeed_optimizer), ("scheduler", deepspeed_scheduler))
                  if v is not None}
        args = strategy_args.resolve(config, stage, allow_untested_optimizer, precision, loss_scaling,
                                     cpu_checkpointing, blocks, options, precision_type=ZeroPrecision)
        self.config, self._auto, self._deepspeed = args.config, args.auto, args.deepspeed
        self._auto_record: Optional[dict] = None
        self.memory_budget_bytes, self.memory_margin = memory_budget_bytes, memory_margin
        self._given_precision = args.precision  # the strategy's own (`precision=...`): it wins over the Trainer's
        if args.precision is not None:
            precision_plugin = args.precision
        cpu_checkpointing = args.cpu_checkpointing
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",  # the spawn launcher's state_dict round trip does not fit sharding
        )
        self._engine: Optional[ZeroEngine] = None
        self._saver: Optional[AsyncSaver] = None
        self._global_batch: Optional[int] = None
        self._failure: Optional[BaseException] = None  # set by on_exception; see [Note: teardown after a failure]
        self._mesh: Optional[Any] = None  # the run's process groups (run_mesh), made at the first that one needs
        self._ranks_check: Optional[EveryRankCheck] = None  # see [Note: checkpoints after an exception]
        self._inputs_unchecked = False  # tensor parallel: the first training step checks its batch (check_same_inputs)
        self._ranks_together: Optional[bool] = None  # every rank reached the exception's checkpoint in time
        self.init_fn = init_fn
        self._checkpoint_policy = checkpointing.CheckpointPolicy(activation_checkpointing, cpu_checkpointing)
        self._checkpointed: Optional[checkpointing.Checkpointed] = None
        self._exit_stack = contextlib.ExitStack()  # what setup changed on the module until teardown
        self._probe: Optional[Any] = None  # activations of the first step; see [Note: out-of-memory triage]
        self._micro_batch: Optional[int] = None
        self._device_mesh: Optional[Any] = None  # tensor parallel: the 2-D DeviceMesh, made at setup_environment
        self._pipeline: Optional[Any] = None  # pipeline parallel: the module's stages and their schedule (setup)
        if self._auto and self.config.tensor_parallel_size > 1:
            raise ZeroConfigError(f"`stage='auto'` with `tensor_parallel_size={self.config.tensor_parallel_size}`: the"
                                  " automatic choice does not count tensor-parallel shards yet. HINT: choose"
                                  " `stage=1` or `stage=2`.")

    # --- plugins -----------------------------------------------------------------------------

    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        given = getattr(self, "_given_precision", None) is not None and self._precision_plugin is not None
        if given and not isinstance(plugin, ZeroPrecision):
            return  # the strategy's own precision wins over the Trainer's generic plugin
        self._precision_plugin = None if plugin is None else to_zero_precision(plugin, ZeroPrecision)
        knobs = self._deepspeed.loss_scaling_if_fp16 if getattr(self, "_deepspeed", None) is not None else None
        if knobs and not isinstance(plugin, ZeroPrecision) and self.precision_plugin.precision == "16-mixed":
            # a DeepSpeed `fp16: {enabled: "auto", ...}` block: its loss scaling, now that the Trainer says 16-mixed
            self._precision_plugin = ZeroPrecision("16-mixed", loss_scaling=LossScaleConfig(**knobs))

    @property
    def engine(self) -> Optional[ZeroEngine]:
        """The engine of the current ``fit`` (or, at stage 3, of the current ``validate``/``test``/``predict``; see
        [Note: evaluating under zero3]); None outside them.

        [Note: evaluating under zero3]
        At stage 3 ``validate``, ``test`` and ``predict`` run on an engine of their own, without optimizer:
        every parameter is sharded as while training (its store as the preset says), each block gathered for
        its forward and released after it, with the training prefetch schedule. A model built in
        ``configure_model`` (on the meta device) is materialized unit by unit first: from its ``init_fn`` (or
        Hugging Face's ``_init_weights``), or read from a pretrained checkpoint; a ``ckpt_path`` is then read
        into the shards, each rank reading only its pieces. So no rank holds the whole model while evaluating.
        At the end the model stays sharded, as at the end of ``fit`` (see [Note: the model stays sharded after
        fit]); a later run on the same world size reuses that engine."""
        return self._engine

    # --- setup -------------------------------------------------------------------------------

    @property
    def device_mesh(self) -> Any:
        """Tensor parallel (``tensor_parallel_size`` > 1): the run's 2-D torch ``DeviceMesh``, dimensions
        ``("data_parallel", "tensor_parallel")``, as Lightning's ``ModelParallelStrategy`` has it, so that
        ``configure_model`` can call ``parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)``.
        See [Note: the tensor dimension] in lzero/engine/mesh.py."""
        if self._device_mesh is None:
            raise RuntimeError("`strategy.device_mesh` exists with `tensor_parallel_size` > 1, once the processes have"
                               f" started (tensor_parallel_size={self.config.tensor_parallel_size}). HINT: read it in"
                               " `configure_model` or later, with `ZeroStrategy(tensor_parallel_size=T)`.")
        return self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        """The ranks ZeRO shards over: the world size divided by ``tensor_parallel_size`` and
        ``pipeline_parallel_size``."""
        return self.world_size // (self.config.tensor_parallel_size * self.config.pipeline_parallel_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel rank and size: the ranks of one tensor-parallel group read the same batches."""
        return data_parallel_sampler_kwargs(self.world_size, self.global_rank, self.config.tensor_parallel_size,
                                            self.config.pipeline_parallel_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.config.tensor_parallel_size > 1 or self.config.pipeline_parallel_size > 1:  # see mesh.py's Notes
            from lzero.engine.mesh import tensor_parallel_mesh

            if self._device_mesh is None or self._mesh is None or not self._mesh.current():  # once per process group
                self._device_mesh = tensor_parallel_mesh(self.config.tensor_parallel_size, self.root_device.type,
                                                         self.config.pipeline_parallel_size)
            if self.lightning_module is not None:  # `self.device_mesh` in the LightningModule, as Lightning's
                self.lightning_module._device_mesh = self._device_mesh
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None:  # see [Note: weight averaging under ZeRO]
            defer_setup(trainer, self._exit_stack, fitting=trainer.state.fn == TrainerFn.FITTING)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.config.tensor_parallel_size > 1:
            self._refuse_beside_tensor_parallel(trainer, fitting)
            self._apply_tp_plan()
        kept = take_kept(self.lightning_module)
        if kept is not None:  # see [Note: the model stays sharded after fit]
            same_world = kept.world_size * self.config.tensor_parallel_size == self.world_size  # its data ranks
            if not fitting and self.config.stage >= 3 and same_world:
                self._engine = kept
                self.precision_plugin.bind(kept)
                keep_generation_synced(self._exit_stack, self.lightning_module, self.config, self.world_size)
                self.setup_precision_plugin()
                return
            gather_back(kept)
        settle(self.model)  # a model built under `trainer.init_module(empty_init=True)`: [Note: a fake device]
        if self.config.pipeline_parallel_size > 1:
            self._cut_into_stages(trainer, fitting)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        if not has_meta(self.model):  # a meta model is materialized unit by unit by the engine
            self.model_to_device()
        if fitting:
            if self._deepspeed is not None:
                deepspeed_config.apply_to_trainer(self._deepspeed, trainer)
            self.config = fill_auto_sizes(self.config, self.lightning_module)
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                check_optimizer(optimizer, self.config.allow_untested_optimizer,
                                self.config.optimizer_partition)
            if self._auto:
                self._choose_configuration()
            self._checkpointed = checkpointing.apply(self.model, self._checkpoint_policy, self.config)
            self._probe = activation_probe(self.lightning_module, self.config) if self._pipeline is None else None
            self._engine, self.optimizers = start_engine(
                self.model, self.optimizers, self.config, self.precision_plugin, self.root_device, self.num_processes,
                self.init_fn, deepspeed=self._deepspeed, memory_budget_bytes=self.memory_budget_bytes,
                mesh=self._run_mesh())
            self._engine.automatic = self.lightning_module.automatic_optimization and self._pipeline is None
            if self._pipeline is not None:  # stage 1 reduces at the step: [Note: pipeline parallel under ZeRO]
                self._pipeline.attach(self._engine, self._run_mesh())
            shard_weight_averaging(trainer, self._engine, lambda: self._sharded_checkpoint, self._exit_stack)
            add_memory_monitor(trainer, self.config)
            if self.config.async_save:
                self._saver = AsyncSaver(self._run_mesh().group("saver"))
            guard_lr_schedulers(self.lightning_module, self.precision_plugin)
            watch_gradient_reads(self.lightning_module)
            keep_generation_synced(self._exit_stack, self.lightning_module, self.config, self.world_size)
            self._ranks_check = EveryRankCheck(self._run_mesh(), self.config.exception_checkpoint_timeout_s)
            self._inputs_unchecked = self.config.tensor_parallel_size > 1
        elif self.config.stage >= 3:  # validate/test/predict sharded: see [Note: evaluating under zero3]
            self._engine, _ = start_engine(self.model, [], self.config, self.precision_plugin, self.root_device,
                                           self.num_processes, self.init_fn, evaluating=True, deepspeed=self._deepspeed,
                                           mesh=self._run_mesh())
            keep_generation_synced(self._exit_stack, self.lightning_module, self.config, self.world_size)
        else:
            sync_module_states(self.model, self._run_mesh().group("world") if self._device_mesh is not None else None)
        self.setup_precision_plugin()

    def _cut_into_stages(self, trainer: Trainer, fitting: bool) -> None:
        """Pipeline parallel: the module cut into this rank's stages, once per module (see [Note: pipeline steps
        under the Trainer] in trainer_pipeline.py)."""
        from lzero.lightning.trainer_pipeline import TrainerPipeline, refuse_beside_pipeline

        if trainer.state.fn == TrainerFn.PREDICTING:
            raise ZeroConfigError("`predict` under pipeline parallel is not built: a prediction is the last stage's"
                                  " output, which the other stages never see. HINT: save a checkpoint and predict from"
                                  " it with a strategy without `pipeline_parallel_size`.")
        refuse_beside_pipeline(self.config, fitting and bool(trainer.checkpoint_callbacks),
                               self.lightning_module.automatic_optimization, self._auto)
        module = self.lightning_module
        if getattr(module, "_lzero_pipeline", None) is None:
            module._lzero_pipeline = TrainerPipeline(module, self.config, self.device_mesh, self.root_device)
        self._pipeline = module._lzero_pipeline

    def _run_mesh(self) -> Any:
        """The run's process groups, made once (see [Note: the mesh] in lzero/engine/mesh.py)."""
        self._mesh = run_mesh(self._mesh, self.config, self._deepspeed, self._device_mesh)
        return self._mesh

    def _apply_tp_plan(self) -> None:
        """``tp_plan`` applied over the tensor dimension, once per model: after ``configure_model`` (or to a model built
        in ``__init__``), before ZeRO wraps it. See [Note: the tensor-parallel plan] in
        lzero/engine/tensor_parallel_plan.py."""
        plan, module = self.config.tp_plan, self.lightning_module
        if plan is None or getattr(module, "_lzero_tp_plan_applied", False):
            return  # no plan, or applied by an earlier fit/validate of this module
        from lzero.engine.tensor_parallel import is_dtensor

        parallel = next((name for name, p in module.named_parameters() if is_dtensor(p)), None)
        if parallel is not None and self._deepspeed is not None and "tp_plan" in self._deepspeed.origins \
                and self._deepspeed.options.get("tp_plan") == "auto":
            return  # a DeepSpeed AutoTP block without partition_config: the user's own plan comes first
        if parallel is not None:
            raise ZeroConfigError(f"`tp_plan={plan!r}` on a model already parallelized (parameter `{parallel}` is a"
                                  " DTensor): the plan would split it twice. HINT: drop `tp_plan`, or drop the"
                                  " `parallelize_module` call from `configure_model`.")
        apply_tp_plan(module, self.config, self.device_mesh)
        module._lzero_tp_plan_applied = True

    def _refuse_beside_tensor_parallel(self, trainer: Trainer, fitting: bool) -> None:
        """What tensor parallel does not run with yet, refused at setup rather than after training (see [Note:
        tensor parallel under ZeRO] in lzero/engine/tensor_parallel.py)."""
        size = self.config.tensor_parallel_size
        precision = self.precision_plugin.precision
        check_tensor_parallel_precision(size, precision)
        config = self.config
        unbuilt = ("`checkpoint_format='full'`" if config.checkpoint_format != "sharded"
                   else "`async_save=True`" if config.async_save
                   else f"`shard_group_size={config.shard_group_size!r}`" if config.shard_group_size is not None
                   else None)
        if fitting and trainer.checkpoint_callbacks and unbuilt is not None:
            raise ZeroConfigError(
                f"`tensor_parallel_size={size}` with a checkpoint callback and {unbuilt}: checkpoints of tensor-parallel"
                f" runs are sharded directories written synchronously, without hybrid sharding, so far. HINT: drop"
                f" {unbuilt}, or `Trainer(enable_checkpointing=False)`.")

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """The LightningModule's optimizers, or those of a DeepSpeed configuration's ``optimizer``/``scheduler``
        blocks when ``configure_optimizers`` returns none, their ``"auto"`` values filled from the module's hparams,
        the Trainer and the optimizer (see [Note: DeepSpeed's optimizer and scheduler blocks])."""
        super().setup_optimizers(trainer)
        ds = self._deepspeed
        if ds is not None and (ds.optimizer is not None or ds.scheduler is not None):
            self.optimizers, self.lr_scheduler_configs = optimizers_from_deepspeed_blocks(
                ds.optimizer, ds.scheduler, self.lightning_module, self.optimizers, self.lr_scheduler_configs)

    def _choose_configuration(self) -> None:
        """``stage="auto"``: the configuration for this model and machine, logged in one line."""
        self.config, self._auto_record = choose_configuration(
            self.config, self.model, self.precision_plugin, self.world_size, self.num_processes, self.root_device,
            self.memory_budget_bytes, self.memory_margin)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator:
        """Stage 3 with ``empty_init=True``: build on the meta device; the engine materializes the model
        one unit at a time at setup, each rank keeping only its shard."""
        if self.config.stage >= 3 and empty_init:
            # the precision's dtype outside the meta context: [Note: the construction's default dtype] in recording.py
            with self.precision_plugin.tensor_init_context(), meta_device(self.root_device):
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator:
        """Stage 3: ``configure_model`` builds on the meta device (see ``tensor_init_context``)."""
        if self.config.stage >= 3:
            with meta_device(self.root_device):
                yield
            if self.model is not None:
                settle(self.model)  # the fake tensors become meta ones: [Note: a fake device]
            return
        yield

    @override
    def configure_ddp(self) -> None:
        """No module wrapper: the engine's gradient hooks replace DDP's reducer."""

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator:
        if self._engine is None:
            yield None
            return
        with self._engine.no_sync():
            yield None

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        """Under pipeline parallel the schedule ran every backward in ``training_step``: only the hooks around it
        run here ([Note: pipeline steps under the Trainer] in trainer_pipeline.py)."""
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._engine is not None:
            self._engine.hold_grads = False
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            before_forward(self._engine)
            with self.precision_plugin.train_step_context():
                module = self.lightning_module
                return self._pipeline.run_step(module, "training_step", args, kwargs, True, self._engine,
                                               module.trainer.accumulate_grad_batches, self.precision_plugin.loss_scale)
        if self._inputs_unchecked:  # tensor parallel: [Note: tensor parallel under ZeRO] in tensor_parallel.py
            self._inputs_unchecked = False
            check_same_inputs(args[0] if args else kwargs.get("batch"), self._run_mesh().tensor, self.root_device)
        before_forward(self._engine)
        if self._probe is not None and not self._probe.measured:  # see [Note: out-of-memory triage]
            with self._probe.measuring(self.lightning_module):
                return super().training_step(*args, **kwargs)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only(super().predict_step, *args, **kwargs)

    def _forward_only(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before_forward(self._engine)
        try:
            if self._pipeline is None:
                return step(*args, **kwargs)
            hook = step.__name__  # the forward-only schedule: [Note: pipeline steps under the Trainer]
            context = self.precision_plugin.val_step_context() if hook == "validation_step" else \
                self.precision_plugin.test_step_context()
            with context:
                return self._pipeline.run_step(self.lightning_module, hook, args, kwargs, False, self._engine, 1)
        finally:
            if self._engine is not None:
                self._engine.release_all()  # stage 3: no backward will release the root

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Stage 3: the module's own keys with global shapes. With ``state_dict_type="sharded"`` (the
        default) sharded parameters are :class:`lzero.checkpoint.state_dict.ShardedTensor` values (this rank's
        piece and ``full_tensor()``); with ``"full"`` rank 0 receives plain tensors gathered one unit at
        a time. A collective: call it on every rank.

        While a sharded checkpoint is being written (``checkpoint_format="sharded"``), every stage returns
        the sharded form: no rank gathers anything. After an exception that not every rank reached in time,
        an empty dict (see [Note: checkpoints after an exception])."""
        if not self._all_ranks_here():
            return {}
        self._refuse_tensor_parallel_checkpoint()
        engine = self._live_engine
        if engine is None:
            return super().lightning_module_state_dict()
        engine.flush_delayed_update()
        return module_state_dict(engine, self.lightning_module, self._sharded_checkpoint,
                                 full=self.config.state_dict_type == "full")

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the engine's shards, so after setup (as DeepSpeed and FSDP do)."""
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
                        ) -> None:
        """While fitting with ``checkpoint_format="sharded"``: a checkpoint directory, every rank writing
        its own pieces (see [Note: sharded checkpoint layout]). Otherwise one DDP-format file on rank 0,
        sharded values gathered one unit at a time."""
        if not self._all_ranks_here():
            return
        self._refuse_tensor_parallel_checkpoint()
        self._flush_delayed_update()
        if self._sharded_checkpoint:
            optimizers = [zero_optimizer(o, OPTIMIZER_HINT) for o in self.optimizers
                          ] if "optimizer_states" in checkpoint else []
            save_sharded(filepath, self._live_engine, optimizers, checkpoint, self._saver, stage=self.config.stage,
                         precision=self.precision_plugin.precision,
                         **({"auto": self._auto_record} if self._auto_record else {}))
            return
        for key in ("state_dict", "current_model_state"):  # the latter: weight averaging's current weights
            if has_sharded(checkpoint.get(key, {})):
                checkpoint = {**checkpoint, key: consolidate(self._live_engine, checkpoint[key])}
        if self._auto_record:
            checkpoint = {**checkpoint, AUTO_RECORD: self._auto_record}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _refuse_tensor_parallel_checkpoint(self) -> None:
        """A tensor-parallel run saves sharded directories only (see [Note: tensor-parallel checkpoints] in
        lzero/engine/tensor_layout.py): a one-file checkpoint is refused at the first call a save makes."""
        config = self.config
        cut = (f"tensor_parallel_size={config.tensor_parallel_size}" if config.tensor_parallel_size > 1
               else f"pipeline_parallel_size={config.pipeline_parallel_size}" if config.pipeline_parallel_size > 1
               else None)
        if cut is not None and not self._sharded_checkpoint:
            where = ("`checkpoint_format='full'`" if self._live_engine is not None
                     else "after a stage-1/2 fit (the engine is gone, each rank holds its part of the model)")
            raise ZeroConfigError(
                f"A one-file checkpoint with `{cut}`, {where}: a tensor- or pipeline-parallel run saves sharded"
                " checkpoint directories only. HINT: save while fitting (a ModelCheckpoint callback) with"
                " `checkpoint_format='sharded'` (the default), and turn a checkpoint into one file with `lzero"
                " consolidate`.")

    @property
    def _sharded_checkpoint(self) -> bool:
        """Checkpoints are sharded directories: while fitting with ``checkpoint_format="sharded"``, and after a stage-3
        fit or evaluation that left the model sharded."""
        return self._live_engine is not None and self.config.checkpoint_format == "sharded"

    @property
    def _live_engine(self) -> Optional[ZeroEngine]:
        """The engine of the current run, or the one that keeps the model sharded after it."""
        return self._engine if self._engine is not None else kept_engine(self.lightning_module)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """With ``async_save``, a removal asked for while a save is in flight waits for its commit."""
        if self._saver is not None and self.is_global_zero and self._saver.after_commit(
                lambda: self.checkpoint_io.remove_checkpoint(filepath)):
            return
        super().remove_checkpoint(filepath)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._all_ranks_here():
            super().barrier(*args, **kwargs)

    def _all_ranks_here(self) -> bool:
        """[Note: checkpoints after an exception]
        Lightning runs the ``on_exception`` callbacks (``OnExceptionCheckpoint`` saves a checkpoint) on the
        rank that raised, before ``strategy.on_exception``. A checkpoint needs every rank, but after an
        exception on one rank the others are blocked in a training collective, so the save, its
        collectives and Lightning's barrier after it would wait for the process group timeout (under DDP
        too). So the first checkpoint collective after an exception (the trainer is ``INTERRUPTED``) is
        preceded by a barrier on a gloo group with ``exception_checkpoint_timeout_s``: if every rank
        arrives (they all raised, or all got SIGTERM), the checkpoint is written as usual; otherwise this
        rank skips it (empty state, nothing written, no barrier) with a warning, and exits."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED or self._ranks_check is None:
            return True
        if self._ranks_together is None:  # see [Note: every rank at a collective call] in wiring.py
            try:
                self._ranks_check.wait("the checkpoint asked for after an exception")
                self._ranks_together = True
            except RanksApart as err:
                self._ranks_together = False
                warnings.warn(
                    f"lzero: rank {self.global_rank} skips the checkpoint asked for after an exception: {err}. A"
                    " checkpoint needs every rank; with an exception on one rank only, resume from the last regular"
                    " checkpoint.", stacklevel=2)
        return self._ranks_together

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this before ``teardown`` when ``fit``/``validate``/... raised: teardown must then run
        no collective. See [Note: teardown after a failure]."""
        super().on_exception(exception)
        self._failure = exception
        module = self.lightning_module
        if self._engine is not None and module is not None and module._trainer is not None \
                and module.trainer.state.fn == TrainerFn.FITTING:
            from lzero.memory import triage

            if triage.is_out_of_memory(exception):
                try:
                    triage.annotate(exception, *triage.explain(self._triage_situation(), self._probe))
                except Exception as err:  # the user's error comes first: a failed triage only says so
                    warnings.warn(f"lzero: out-of-memory triage failed ({type(err).__name__}: {err}).", stacklevel=2)

    def _triage_situation(self) -> Any:
        from lzero.memory import triage
        from lzero.memory.accounting import model_state_bytes
        from lzero.memory.estimate import count_parameters

        engine, probe = self._engine, self._probe
        measured = probe is not None and probe.measured
        trainer = self.lightning_module.trainer
        return triage.Situation(
            config=self.config, count=count_parameters(self.lightning_module, self.config.unit_modules),
            world_size=self.world_size, precision=self.precision_plugin.precision,
            budget=rank_budget_bytes(self.root_device, self.memory_budget_bytes, self.num_processes, total=True),
            measured_states=model_state_bytes(engine, [zero_optimizer(o, OPTIMIZER_HINT) for o in self.optimizers]),
            activations=probe.total if measured else None,
            checkpointed_activations=probe.checkpointed() if measured else None,
            activation_checkpointing=self._checkpointed is not None, micro_batch=self._micro_batch,
            accumulation=trainer.accumulate_grad_batches, on_cpu=self.root_device.type != "cuda",
            schedule=engine.auto_schedule.record if engine.auto_schedule is not None else None)

    @override
    def teardown(self) -> None:
        """[Note: teardown after a failure]
        After a clean fit, teardown is a collective: the last async save commits, and the parameters
        stay sharded (stage 3, see [Note: the model stays sharded after fit]) or are gathered back into
        whole tensors (``gather_after_fit``) or fp32 masters (stages 1-2 in 16-bit). After an exception on
        one rank the other ranks are somewhere else (in a step's collectives, or failing themselves), so
        a collective here would either wait for them (up to ``unit_order_timeout_s`` or the process
        group timeout) or pair with an unrelated collective of theirs and raise an error of its own
        that hides the user's. So after ``on_exception`` nothing here waits for another rank: the
        engine is detached without gathering, an in-flight async save is abandoned, and the parameters
        stay as they were (shards under stage 3, 16-bit copies under mixed precision). The failing
        process then exits with the user's exception, and its peers, blocked in a collective with
        it, see the closed connection and fail within seconds, as under DDP."""
        failed, self._failure, self._ranks_together = self._failure is not None, None, None
        self._exit_stack.close()
        if self._checkpointed is not None:  # the module leaves fit with its own forward
            self._checkpointed.remove()
            self._checkpointed = None
        if self._ranks_check is not None:
            self._ranks_check.close()
            self._ranks_check = None
        if self._saver is not None:
            saver, self._saver = self._saver, None
            if not failed:
                saver.close()
                self._mesh.destroy("saver")
        if self._engine is not None:
            engine, self._engine = self._engine, None
            if failed:
                engine.remove(after_failure=True)
            else:
                engine.flush_delayed_update()  # the model leaves fit with every step applied
                if engine.gatherer is not None and not self.config.gather_after_fit:
                    keep(self.lightning_module, engine)  # see [Note: the model stays sharded after fit]
                else:
                    gather_back(engine)
            self.precision_plugin.bind(None)
            if self.lightning_module is not None:
                self.lightning_module.__dict__.pop("lr_scheduler_step", None)
                self.lightning_module.__dict__.pop("on_before_optimizer_step", None)
        module = self.lightning_module
        if module is None or not (has_meta(module) or kept_engine(module) is not None):
            super().teardown()
            return
        # a model whose meta-device materialization failed cannot be moved to the CPU, nor can a sharded one (its
        # shards stay where the engine keeps them): skip that move
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    # --- user-facing extras ------------------------------------------------------------------

    def grad_norm(self, optimizer_index: int = 0) -> torch.Tensor:
        """Global L2 norm of the reduced gradients of one optimizer, as ``clip_grad_norm_`` would
        report it under DDP. A collective: call it on every rank, e.g. in ``on_before_optimizer_step``."""
        return zero_optimizer(self.optimizers[optimizer_index], OPTIMIZER_HINT).grad_norm()

    @contextmanager
    def generation(self, module: Optional[torch.nn.Module] = None,
                   mode: Literal["gathered", "streamed"] = "gathered") -> Generator:
        """Stage 3, for ``model.generate`` (RLHF rollouts, samples): the forwards inside run no collective, so
        ranks that stop at different lengths cannot hang. A collective on entry: every rank enters it. ``module``:
        the LightningModule (the default) or a module inside it, such as the policy of an RLHF module; the engine
        holds the whole LightningModule, so every block is held either way. The call is the same at Fabric's door.

        ``mode="gathered"``: every block gathered once for the whole block and kept on the device (see [Note:
        every block gathered for generation] in gather.py): the whole model per rank, no copy per token. Refused,
        priced, when it would not fit this rank's free device memory (``memory_budget_bytes`` when set, with
        ``memory_margin``).

        ``mode="streamed"``: the whole model copied once into host memory, each block copied to the device for
        its forward and released after (see [Note: blocks streamed from host memory] in gather.py): the device
        holds the root and the blocks live at once, each token costs one host-to-device copy per block. Refused,
        priced, when the host copy would not fit this rank's share of available host memory.

        Outside it, a Hugging Face ``generate`` under zero3 gathers each block per forward with the training
        prefetch (memory-bounded, one all-gather per block per token) and keeps the ranks stepping together
        (``synced_gpus``). Stages 1-2 hold whole parameters: nothing to do."""
        root = self.lightning_module
        if self._pipeline is not None:
            raise ZeroConfigError(
                f"`strategy.generation()` under `pipeline_parallel_size={self.config.pipeline_parallel_size}`: this rank"
                f" holds pipeline stages {list(self._pipeline.split.local)} only, and token-by-token generation through"
                " a pipeline is not built. HINT: save a checkpoint and generate from it without pipelines (`lzero"
                " export-hf`, or a strategy without `pipeline_parallel_size`).")
        takes, example = "the LightningModule or a module inside it", "with trainer.strategy.generation(self.policy):"
        check_generation_arguments(module, mode, takes, example)
        if module is not None and not (root is not None and any(m is module for m in root.modules())):
            raise ValueError(f"`strategy.generation(module=...)` takes {takes}, got {named(module)}. HINT: `{example}`"
                             " or another module inside the LightningModule.")
        with generation(self._live_engine, root, mode, self.root_device, self.memory_budget_bytes,
                        self.memory_margin, self.num_processes):
            yield

    @contextmanager
    def gathered_parameters(self, module: Optional[torch.nn.Module] = None) -> Generator:
        """Temporary full access to ``module``'s parameters (default: the whole LightningModule) under
        stage 3, like DeepSpeed's GatheredParameters; in-place writes are carried back to the shards.
        A collective: enter it on every rank. After a stage-3 fit the model stays sharded, and this works on it as
        during fit (see [Note: the model stays sharded after fit])."""
        engine = self._live_engine
        if engine is None:
            yield
            return
        with engine.gathered(module if module is not None else self.lightning_module):
            yield

    @property
    def global_batch_size(self) -> Optional[int]:
        """micro batch x accumulate_grad_batches x world size, once training has started."""
        return self._global_batch

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        micro = self._micro_batch = micro_batch_size(trainer.train_dataloader)
        accumulation, world = trainer.accumulate_grad_batches, self.data_parallel_size
        self._global_batch = None if micro is None else micro * accumulation * world
        if self._deepspeed is not None:
            if self._pipeline is not None and micro is not None:  # a batch of m micro-batches, each DeepSpeed's micro
                m = self.config.microbatches
                micro, accumulation = (micro // m if micro % m == 0 else micro / m), accumulation * m
            deepspeed_config.resolve_batch(self._deepspeed.batch, world, micro, accumulation)
        wanted = self.config.train_batch_size
        if wanted is not None and self._global_batch != wanted:
            raise ZeroConfigError(
                f"train_batch_size={wanted} but micro batch {micro} x accumulate_grad_batches {accumulation} x"
                f" world size {world} = {self._global_batch}. HINT: change the DataLoader's batch_size or"
                " `accumulate_grad_batches` so that the product matches, or drop `train_batch_size`."
            )

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._flush_delayed_update()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._flush_delayed_update()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._flush_delayed_update()

    def _flush_delayed_update(self) -> None:
        """``offload_optimizer.delayed_update``: the step in flight finished and published before anything reads
        the parameters, masters or optimizer state (see [Note: one-step delayed update]). A collective."""
        engine = self._live_engine
        if engine is not None:
            engine.flush_delayed_update()

    def partition_metadata(self) -> dict[str, Any]:
        """Where every parameter element lives: unit, offset, shape and each rank's range."""
        engine = self._live_engine
        if engine is None:
            raise RuntimeError("The partition exists only while fitting. HINT: call it from a training hook.")
        return engine.metadata()

    # --- checkpoints: sharded directories or full DDP-format files (lzero/checkpoint/) ----------------

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._all_ranks_here():
            return {}
        self._refuse_tensor_parallel_checkpoint()
        self._flush_delayed_update()
        if self._sharded_checkpoint:
            return {"lzero": "written by the sharded checkpoint"}  # the pieces come from the shards
        return gather_optimizer_state(zero_optimizer(optimizer, OPTIMIZER_HINT))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Into the shards while fitting: each rank reads only the pieces it owns, from a sharded
        checkpoint or a full (DDP/Lightning) one."""
        self._flush_delayed_update()
        load_module_state(self._engine, self.lightning_module, checkpoint, strict)
        if self._engine is not None and self._engine.average is not None:
            load_averages(self._engine.average, checkpoint.get(READER))  # [Note: averages in a sharded checkpoint]

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load_optimizer_states([zero_optimizer(o, OPTIMIZER_HINT) for o in self.optimizers], checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory, a DeepSpeed checkpoint folder, or a full file that is unpickled only with
        ``weights_only=False``."""
        module = self.lightning_module
        names = [n for n, _ in module.named_parameters(remove_duplicate=False)] if module is not None else None
        checkpoint = open_checkpoint(checkpoint_path, self.global_rank, self.world_size, weights_only,
                                     lambda safe: super(ZeroStrategy, self).load_checkpoint(checkpoint_path,
                                                                                           weights_only=safe), names)
        precision = take_precision_state(checkpoint)
        if precision is not None:  # the loss scale and skipped steps: Lightning restores them by the class name
            checkpoint.setdefault(type(self.precision_plugin).__qualname__, precision)
        return checkpoint



