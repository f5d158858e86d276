"""The Trainer's precision plugin: :class:`ZeroFabricPrecision` (precision.py) with the Trainer's step hooks and
clipping. Lightning routes clipping through the precision plugin; its generic plugin would clip the module's ``p.grad``
(None under stage 2, partial under stage 1). This plugin asks the engine for the global norm over all shards instead.
It is a plugin of both doors (a Fabric plugin too), so a script can name one class for both."""

from __future__ import annotations

from typing import Any, Callable, Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lzero.lightning.precision import ZeroFabricPrecision
from lzero.lightning.wiring import zero_optimizer

OPTIMIZER_HINT = "pass the optimizer of `self.optimizers()` (or `trainer.strategy.optimizers`)"


class ZeroPrecision(ZeroFabricPrecision, Precision):
    """The plugin a ZeRO strategy installs under the Trainer (``plugins=[lzero.ZeroPrecision(...)]``); the arguments
    are :class:`ZeroFabricPrecision`'s. See [Note: precision modes] and [Note: skipped steps] in precision.py."""

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Closure (forward, backward), the non-finite check, hooks and clipping, then the step or a skip.
        See [Note: skipped steps]."""
        from lightning.pytorch.trainer import call

        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT)
        closure_result = closure()
        if getattr(model, "automatic_optimization", False) and closure_result is None:
            return closure_result  # training_step returned None: no backward, no step (as Lightning's AMP)
        trainer = model.trainer

        def before_step(skip: bool) -> None:  # Lightning's hooks see every step; clipping only a taken one
            call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
            if not skip:
                self._clip_gradients(model, optimizer, trainer.gradient_clip_val,
                                     gradient_clip_algorithm=trainer.gradient_clip_algorithm)

        before = self.loss_scale
        self.step_or_skip(zopt, trainer.global_step, trainer.global_rank == 0, before_step, **kwargs)
        if getattr(model, "_current_fx_name", None) is not None and (self.scaler is not None or self.skipped_steps):
            if self.scaler is not None:
                model.log("lzero/loss_scale", before, on_step=True, on_epoch=False, batch_size=1)
            model.log("lzero/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT)
        zopt.engine.clip_grad_norm_(zopt.units, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        zopt = zero_optimizer(optimizer, OPTIMIZER_HINT)
        zopt.engine.clip_grad_value_(zopt.units, float(clip_val))

