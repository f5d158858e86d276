"""What an lzero run sets on, and checks of, the user's Trainer loop and LightningModule: callbacks it adds or
refuses, hooks it wraps on the module for one run, and what it reads of the DataLoader. trainer_strategy.py calls
these; what both doors share is in wiring.py."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.optim import Optimizer

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.lightning.precision import ZeroFabricPrecision


def add_memory_monitor(trainer: Trainer, config: ZeroConfig) -> None:
    """``log_memory`` with a logger: a :class:`lzero.MemoryMonitor`, unless the Trainer has one already."""
    from lzero.memory.monitor import MemoryMonitor

    if config.log_memory and trainer.loggers and not any(isinstance(c, MemoryMonitor) for c in trainer.callbacks):
        trainer.callbacks.append(MemoryMonitor())


def activation_probe(module: LightningModule, config: ZeroConfig) -> Optional[Any]:
    """The first step's activation measurement (see [Note: out-of-memory triage]); None for a compiled model, whose
    graphs should not be traced with autograd's saved-tensor hooks, and under manual optimization."""
    from lzero.engine.units import find_blocks
    from lzero.memory.triage import ActivationProbe

    if not module.automatic_optimization or any(
            getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
            for m in module.modules()):
        return None  # manual optimization: a step's forwards and backwards interleave; measured, they would add up
    return ActivationProbe(find_blocks(module, config.unit_modules))


def guard_lr_schedulers(module: LightningModule, precision: ZeroFabricPrecision) -> None:
    """Step-interval LR schedulers do not step after a skipped optimizer step (see [Note: skipped
    steps] in precision.py). Lightning steps them through ``module.lr_scheduler_step``, so for this
    fit that hook is shadowed on the instance by one that consults the precision plugin first."""
    module.__dict__.pop("lr_scheduler_step", None)
    original = module.lr_scheduler_step

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        configs = module.trainer.lr_scheduler_configs if module._trainer is not None else []
        interval = next((c.interval for c in configs if c.scheduler is scheduler), "epoch")
        if interval == "step" and precision.skipped_last_step(getattr(scheduler, "optimizer", None)):
            return
        original(scheduler, metric)

    module.__dict__["lr_scheduler_step"] = lr_scheduler_step


def watch_gradient_reads(module: LightningModule) -> None:
    """A LightningModule whose ``on_before_optimizer_step`` reads ``p.grad`` finds None there (the gradients live in
    the shards): warned once, naming ``lzero.grad_norm`` (see [Note: per-parameter gradient norms])."""
    if type(module).on_before_optimizer_step is LightningModule.on_before_optimizer_step:
        return
    from lzero.engine.parameters import reporting_empty_grad_reads

    hook, warned = module.on_before_optimizer_step, []

    def on_empty_read(param: torch.nn.Parameter) -> None:
        if not warned and param.requires_grad:
            warned.append(True)
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                "`on_before_optimizer_step` read `p.grad` of a parameter lzero manages, and it is None: ZeRO keeps the"
                " averaged gradients in the shards, so Lightning's `grad_norm(self, ...)` returns {} and `p.grad`"
                " holds nothing to log. HINT: `lzero.grad_norm(self, norm_type=2)` returns Lightning's keys and"
                " DDP's values from the shards (call it on every rank); `self.trainer.strategy.grad_norm()` gives"
                " the global norm.")

    def on_before_optimizer_step(optimizer: Optimizer) -> None:
        with reporting_empty_grad_reads(on_empty_read):
            hook(optimizer)

    module.on_before_optimizer_step = on_before_optimizer_step


def micro_batch_size(loader: Any) -> Optional[int]:
    """The per-rank batch size of a DataLoader (or of the first of several), if it states one."""
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size


def optimizers_from_deepspeed_blocks(optimizer: Optional[dict], scheduler: Optional[dict], module: Any,
                                     optimizers: list, scheduler_configs: list) -> tuple[list, list]:
    """A DeepSpeed configuration's ``optimizer``/``scheduler`` blocks (checked by lzero/deepspeed/optim.py), built:
    the fit's optimizers and LR scheduler configs once the blocks are built: ``optimizers`` and
    ``scheduler_configs`` are what ``configure_optimizers`` gave (Lightning's placeholder optimizer for none). Each
    ``"auto"`` is filled from ``module``'s hparams, its Trainer and the optimizer."""
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from lzero.deepspeed.optim import build_optimizer, fill_auto
    from lzero.deepspeed.schedules import build_scheduler

    real = [o for o in optimizers if not isinstance(o, _MockOptimizer)]
    hparams, steps = module.hparams, lambda: module.trainer.estimated_stepping_batches
    if optimizer is not None:
        if real:
            raise ZeroConfigError(
                "Both the DeepSpeed configuration (its `optimizer` block) and `configure_optimizers` define an"
                " optimizer. HINT: drop one: remove the block, or return nothing from `configure_optimizers`.")
        trainable = [p for p in module.parameters() if p.requires_grad]
        real = optimizers = [build_optimizer(fill_auto(optimizer, hparams, steps, []), trainable)]
    if scheduler is not None:
        if len(real) != 1 or scheduler_configs:
            raise ZeroConfigError(
                "The DeepSpeed configuration's `scheduler` block needs exactly one optimizer and no scheduler from"
                f" `configure_optimizers` (found {len(real)} optimizer(s), {len(scheduler_configs)} scheduler(s))."
                " HINT: drop the block, or return one optimizer and no scheduler.")
        spec = fill_auto(scheduler, hparams, steps, [g["lr"] for g in real[0].param_groups])
        scheduler_configs = [LRSchedulerConfig(build_scheduler(spec, real[0]), interval="step")]
    return optimizers, scheduler_configs
