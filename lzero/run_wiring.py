"""What an lzero run sets on, and checks of, the user's Trainer or Fabric loop and model: the meta device of
``configure_model`` / ``init_module``, the engine's start (one place for both front doors), callbacks it adds or
refuses, hooks it wraps on the module for one run, and what it reads of the DataLoader. The strategies
(strategy.py, fabric.py) call these."""

from __future__ import annotations

import contextlib
import sys
from contextlib import contextmanager
from typing import Any, Generator, Optional, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.optim import Optimizer

from lzero.config import ZeroConfig, ZeroConfigError
from lzero.precision import ZeroPrecision

@contextmanager
def meta_device(device: Optional[torch.device] = None, recording: Optional[contextlib.ExitStack] = None) -> Generator:
    """Modules built inside hold fake tensors that report ``device`` (default: the CPU) and hold no memory, their
    construction recorded (see [Note: a fake device] in engine/replay.py); call :func:`lzero.engine.replay.settle` on
    the module after the block. A Hugging Face ``from_pretrained`` inside builds into shards
    (see [Note: from_pretrained under zero3] in hf/pretrained.py). ``recording``: the construction's record stays open
    in it after the block (until the caller closes it), so initialization run on the model before setup is recorded
    too (Fabric: see [Note: the engine starts at first use] in fabric.py)."""
    from lzero.engine.replay import record
    from lzero.hf.pretrained import intercept

    with contextlib.ExitStack() as stack:
        recorder = (recording if recording is not None else stack).enter_context(record())
        with recorder.building_on(device or torch.device("cpu")), intercept():  # [Note: replayed construction]
            yield


def start_engine(module: torch.nn.Module, optimizers: list[Optimizer], config: ZeroConfig, precision: ZeroPrecision,
                 device: torch.device, num_processes: int, init_fn: Any = None, weights: Any = None,
                 evaluating: bool = False, attach_to: Sequence[Any] = ()) -> tuple[Any, list[Any]]:
    """The engine over ``module`` and ``optimizers`` (already checked), and the optimizers re-targeted at its shards
    (``attach_to``: ZeroOptimizers made before the engine, one per optimizer), the precision bound to it. Both front
    doors start a run here. A collective."""
    from lzero.engine.engine import ZeroEngine
    from lzero.offload.placement import announce_offload
    from lzero.offload.store import divide_host_threads
    from lzero.optimizer import ZeroOptimizer

    from lzero.engine.layout import Layout

    layout = Layout.of(config.shard_group_size) if config.shard_group_size is not None else None
    engine = ZeroEngine(module, optimizers, config, precision.policy, device=device, init_fn=init_fn,
                        weights=weights if weights is not None else pretrained_weights(module), evaluating=evaluating,
                        layout=layout)
    zero = list(attach_to) or [ZeroOptimizer(opt, engine, i) for i, opt in enumerate(optimizers)]
    for i, zopt in enumerate(attach_to):
        zopt.attach(engine, i)
    if engine.offloaded and zero:
        announce_offload(engine, zero, divide_host_threads(num_processes, config.offload_optimizer.host_threads))
    precision.bind(engine)
    return engine, zero


def pretrained_weights(model: torch.nn.Module) -> Optional[Any]:
    """The checkpoints of the pretrained models built by ``meta_device`` inside ``model``, if any."""
    if "lzero.hf.pretrained" not in sys.modules:
        return None
    from lzero.hf.pretrained import PretrainedWeights

    weights = PretrainedWeights(model)
    return weights if weights else None


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


def guard_lr_schedulers(module: LightningModule, precision: ZeroPrecision) -> None:
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


@contextmanager
def synced_generation(module: Optional[torch.nn.Module], synced: bool) -> Generator:
    """Inside the block, Hugging Face ``generate`` on the models inside ``module`` defaults to ``synced_gpus=synced``:
    transformers reads it from ``_is_fsdp_managed_module``, its mark of a model whose forward runs collectives (and
    whose layers every rank must run, so a rank that finished keeps stepping until all have)."""
    marked = [m for m in module.modules() if callable(getattr(m, "generate", None))] if module is not None else []
    before = [m.__dict__.get("_is_fsdp_managed_module") for m in marked]
    for m in marked:
        m._is_fsdp_managed_module = synced
    try:
        yield
    finally:
        for m, value in zip(marked, before):
            if value is None:
                m.__dict__.pop("_is_fsdp_managed_module", None)
            else:
                m._is_fsdp_managed_module = value


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


def refuse_weight_averaging(callbacks: list[Any]) -> None:
    """Callbacks that read and write every parameter between steps meet released parameters at
    stage 3 (see [Note: released parameters] in flat_unit.py); Lightning refuses them under FSDP and
    DeepSpeed for the same reason."""
    from lightning.pytorch import callbacks as known

    averaging = tuple(getattr(known, n) for n in ("StochasticWeightAveraging", "WeightAveraging") if hasattr(known, n))
    for callback in callbacks:
        if isinstance(callback, averaging):
            raise ZeroConfigError(
                f"`{type(callback).__name__}` reads and writes every parameter between training steps, but under"
                " zero3 a parameter is whole only while its block runs; weight averaging does not currently"
                " support sharded models. HINT: use strategy='zero2' (every rank keeps whole parameters), or"
                " average the weights in your own callback inside `trainer.strategy.gathered_parameters()`."
            )


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
