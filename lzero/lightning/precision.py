"""The precision plugin both front doors install: compute dtype, masters, autocast, loss scaling and non-finite
gradients. It is a ``lightning.fabric`` plugin, as Fabric's door needs; the Trainer's :class:`lzero.ZeroPrecision`
(trainer_precision.py) adds the Trainer's step hooks and clipping over it.

[Note: precision modes]
- ``32-true``: fp32 everywhere; the master is the parameter shard itself.
- ``bf16-mixed`` (ZeRO semantics, the default): bf16 working parameters and gradients, fp32 master
  shards and optimizer state, reduction in ``reduce_dtype`` (fp32 by default); the forward runs
  under bf16 autocast so fp32 inputs and buffers mix with bf16 weights. Memory follows the
  mixed-precision formula.
- ``16-mixed``: the same with fp16 working parameters, fp16 autocast and dynamic loss scaling
  (loss_scale.py); the division by the scale is folded into the reduction, so everything after
  the reduction (clipping, the norm, the optimizer) sees unscaled fp32 gradients.
- ``keep_fp32_modules=["Embedding", "LayerNorm"]`` under the mixed modes: those modules' own
  parameters stay fp32 (their units are fp32 throughout), so the residual stream that starts at an
  embedding and the normalizations compute in fp32 while matmuls take bf16 weights, which is what
  Lightning's autocast over fp32 weights computes.
- ``bf16-mixed``/``16-mixed`` with ``param_dtype=torch.float32`` (Lightning's own semantics): fp32
  parameters, 16-bit autocast in forward; the fp32 memory formula.
- ``bf16-true``: everything bf16, no masters.

[Note: skipped steps]
Before every optimizer step the engine all-reduces one flag saying whether any rank has an
inf/NaN gradient, so all ranks decide alike. Such a step is skipped: masters and optimizer state
stay bitwise unchanged, step-interval LR schedulers of that optimizer are not stepped (as in
DeepSpeed), and the step still counts toward ``trainer.global_step`` (as in Lightning's AMP and
DeepSpeed's ``global_steps``). Under ``16-mixed`` this is the loss scaler's overflow; under the other
precisions it is counted and, with ``nonfinite_grads="raise"``, ends training instead; a run of
``max_consecutive_skips`` skipped steps in a row ends training with an error naming the first of them
(a model whose every gradient is inf/NaN would otherwise "train" to the end and exit 0). Under
``16-mixed`` a run of overflows is how the loss scale finds its level, and the scaler's own limit
(``max_overflows_at_min_scale``) applies instead.
"""

from __future__ import annotations

import contextlib

import logging
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Sequence

import torch
from lightning.fabric.plugins.precision import Precision
from torch import nn
from typing_extensions import override

from lzero.engine.loss_scale import LossScaleConfig, LossScaler
from lzero.engine.mixed_precision import PrecisionPolicy
from lzero.errors import ZeroError

log = logging.getLogger("lzero")

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
REFUSED = {
    "16-true": "pure fp16 training has no loss scaling or fp32 masters",
    "64-true": "ZeRO's flat buffers and masters are at most fp32",
    "transformer-engine": "Transformer Engine layers are not supported",
    "transformer-engine-float16": "Transformer Engine layers are not supported",
}
_HALF = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
NONFINITE_POLICIES = ("skip", "raise")


class ZeroPrecisionError(ZeroError, ValueError):
    """A precision setting lzero cannot run; the message says what to use."""


class ZeroFabricPrecision(Precision):
    """See [Note: precision modes] and [Note: skipped steps]. Fabric's door uses it as it is; the Trainer's
    :class:`lzero.ZeroPrecision` is this plugin with the Trainer's hooks, and serves both doors.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.
        param_dtype: dtype of the working parameters under ``bf16-mixed``/``16-mixed`` (the 16-bit
            type by default; fp32 for Lightning's autocast-only semantics).
        reduce_dtype: dtype of gradient reductions (default: fp32 under the mixed modes, the
            parameter dtype otherwise). ``16-mixed`` reduces in fp32 only.
        loss_scaling: ``16-mixed`` only: DeepSpeed's loss-scaling knobs (:class:`lzero.LossScaleConfig`).
        nonfinite_grads: what an inf/NaN gradient does outside ``16-mixed``: ``"skip"`` the step
            (counted, reported) or ``"raise"``.
        keep_fp32_modules: mixed modes with 16-bit parameters: class names of modules whose own
            parameters stay fp32 (e.g. ``["Embedding", "LayerNorm"]``): the residual stream and the
            normalizations then run in fp32 as under Lightning's autocast, for 2 more bytes per kept
            parameter. See [Note: precision modes].
        max_consecutive_skips: outside ``16-mixed``: this many optimizer steps skipped in a row for
            inf/NaN gradients end training with an error naming the first (0: never). See [Note: skipped steps].
    """

    def __init__(self, precision: str = "32-true", param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None, loss_scaling: Optional[LossScaleConfig] = None,
                 nonfinite_grads: str = "skip", keep_fp32_modules: Sequence[str] = (),
                 max_consecutive_skips: int = 10) -> None:
        precision = str(precision)
        if precision in REFUSED:
            raise ZeroPrecisionError(
                f"precision={precision!r} is not supported by lzero: {REFUSED[precision]}."
                f" HINT: use one of {', '.join(SUPPORTED_PRECISION)}."
            )
        if precision not in SUPPORTED_PRECISION:
            raise ZeroPrecisionError(
                f"Unknown precision {precision!r}. HINT: use one of {', '.join(SUPPORTED_PRECISION)}."
            )
        half = _HALF.get(precision)
        if param_dtype is not None and half is None:
            raise ZeroPrecisionError(
                f"`param_dtype` applies to precision='bf16-mixed' or '16-mixed' only, got precision={precision!r}."
                " HINT: drop `param_dtype`."
            )
        if param_dtype is not None and param_dtype not in (half, torch.float32):
            raise ZeroPrecisionError(f"`param_dtype={param_dtype}` under precision={precision!r} must be {half} or"
                                     " torch.float32.")
        allowed_reduce = (torch.float32,) if precision == "16-mixed" else (torch.float32, torch.bfloat16)
        if reduce_dtype is not None and reduce_dtype not in allowed_reduce:
            raise ZeroPrecisionError(
                f"`reduce_dtype={reduce_dtype}` is not supported under precision={precision!r}; use one of"
                f" {', '.join(map(str, allowed_reduce))}."
                + (" fp16 sums of loss-scaled gradients overflow." if precision == "16-mixed" else "")
            )
        if loss_scaling is not None and precision != "16-mixed":
            raise ZeroPrecisionError(f"`loss_scaling` applies to precision='16-mixed' only, got {precision!r}."
                                     " HINT: drop `loss_scaling`.")
        if nonfinite_grads not in NONFINITE_POLICIES:
            raise ZeroPrecisionError(f"`nonfinite_grads={nonfinite_grads!r}`; use one of {NONFINITE_POLICIES}.")
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) \
                or max_consecutive_skips < 0:
            raise ZeroPrecisionError(f"`max_consecutive_skips={max_consecutive_skips!r}` must be a whole number >= 0."
                                     " HINT: e.g. 10, or 0 to never stop.")
        self.precision = precision
        self.param_dtype = param_dtype if param_dtype is not None else half
        if self.param_dtype == torch.float32:
            self.param_dtype = None  # autocast mode: the parameters stay as they are
        if isinstance(keep_fp32_modules, str) or not all(isinstance(n, str) for n in keep_fp32_modules):
            raise ZeroPrecisionError(f"`keep_fp32_modules={keep_fp32_modules!r}` must be a list of class names."
                                     " HINT: e.g. ['Embedding', 'LayerNorm'].")
        if keep_fp32_modules and self.param_dtype is None:
            raise ZeroPrecisionError(
                f"`keep_fp32_modules` applies to 16-bit working parameters, but precision={precision!r}"
                f"{' with param_dtype=torch.float32' if half else ''} keeps every parameter in its dtype already."
                " HINT: drop `keep_fp32_modules`.")
        self.keep_fp32_modules = tuple(keep_fp32_modules)
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else (torch.float32 if half else None)
        self.autocast_dtype = half
        self.scaler = LossScaler(loss_scaling or LossScaleConfig()) if precision == "16-mixed" else None
        self.nonfinite_grads = nonfinite_grads
        self.skipped_steps = 0  # optimizer steps skipped for inf/NaN gradients, all optimizers
        self.max_consecutive_skips = max_consecutive_skips
        self._run_of_skips: list[int] = []  # global steps of the current run of consecutive skips
        self._skipped_last: dict[int, bool] = {}  # id(optimizer) -> its last step was skipped
        self._engine: Any = None

    @property
    def policy(self) -> PrecisionPolicy:
        """What the engine computes and reduces in (see lzero/engine/mixed_precision.py)."""
        return PrecisionPolicy(self.param_dtype, self.reduce_dtype, self.keep_fp32_modules)

    def bind(self, engine: Any) -> None:
        """Called by the strategy at setup: the engine divides the loss scale out in its reductions."""
        self._engine = engine
        self._sync_scale()

    def _sync_scale(self) -> None:
        if self._engine is not None:
            self._engine.loss_scale = self.scaler.scale if self.scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def skipped_last_step(self, optimizer: Any) -> bool:
        """Whether the last step of ``optimizer`` (the user's or the ZeRO one) was skipped."""
        return self._skipped_last.get(id(optimizer), False)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """bf16-true: tensors created inside are bf16 (the default dtype), as Lightning's bf16-true builds them, so a
        model built in ``configure_model`` draws what it draws under DDP."""
        if self.precision == "bf16-true":
            from lightning.fabric.plugins.precision.utils import _DtypeContextManager

            return _DtypeContextManager(torch.bfloat16)
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            from lzero.engine.recording import recording_more

            with recording_more(module):  # a meta model: the cast is part of its construction
                return module.to(torch.bfloat16)
        return module  # mixed: the engine casts the working parameters and keeps fp32 masters

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    @override
    def convert_output(self, data: Any) -> Any:
        """Fabric: floating outputs in the default dtype (fp32), as Fabric's own mixed and half precisions return
        them (the Trainer does not call this)."""
        if self.autocast_dtype is None and self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        dtype = torch.get_default_dtype()
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is not None:
            with torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=self.autocast_dtype):
                yield
        else:
            yield

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    def step_or_skip(self, zopt: Any, step: int, is_global_zero: bool,
                     before_step: Optional[Callable[[bool], None]] = None, **kwargs: Any) -> bool:
        """One optimizer step of either front door: the non-finite check, ``before_step(skip)`` (the Trainer's hooks
        and clipping), then the step or a skip, accounted (see [Note: skipped steps]). Returns whether it skipped."""
        skip = zopt.engine.found_nonfinite(zopt.units)
        if before_step is not None:
            before_step(skip)
        if not skip:
            zopt.step(**kwargs)
        else:
            zopt.engine.release_grads(zopt.units)  # as a step would (see [Note: gradient buffers])
        self.account(skip, zopt, step, is_global_zero)
        return skip

    def account(self, skip: bool, zopt: Any, step: int, is_global_zero: bool) -> None:
        """A step taken or skipped (``step``: the global step it counts as): the policy for non-finite gradients, the
        loss scale's update, and the report of skips. See [Note: skipped steps]."""
        before = self.loss_scale
        if skip and self.scaler is None and self.nonfinite_grads == "raise":
            raise FloatingPointError(
                f"A gradient is inf/NaN at global step {step} (precision={self.precision!r})."
                " HINT: lower the learning rate or clip gradients; `ZeroPrecision(nonfinite_grads='skip')` skips"
                " such steps instead."
            )
        for opt in (zopt, zopt.optimizer):
            self._skipped_last[id(opt)] = skip
        if skip:
            self.skipped_steps += 1
        self._check_run_of_skips(skip, step)
        if self.scaler is not None:
            self.scaler.update(skip)
            self._sync_scale()
        if skip and is_global_zero:
            every = (self.scaler.config if self.scaler is not None else LossScaleConfig).report_every_n_skips
            if self.skipped_steps == 1 or self.skipped_steps % every == 0:
                cause = "fp16 gradient overflow" if self.scaler is not None else "inf/NaN gradient"
                scale = ""
                if self.scaler is not None:
                    scale = (f"; loss scale {before:g} -> {self.loss_scale:g}" if self.loss_scale != before else
                             f"; loss scale stays {before:g} (hysteresis: it halves after"
                             f" {self.scaler.hysteresis_left} more overflow(s))")
                log.warning("lzero: skipped the optimizer step at global step %d (%s)%s; %d steps skipped so far"
                            " (reported at the first skip and every %d)", step, cause, scale, self.skipped_steps, every)

    def _check_run_of_skips(self, skip: bool, step: int) -> None:
        self._run_of_skips = self._run_of_skips + [step] if skip else []
        limit = self.max_consecutive_skips
        if self.scaler is None and limit and len(self._run_of_skips) >= limit:
            raise FloatingPointError(
                f"{len(self._run_of_skips)} optimizer steps in a row were skipped for inf/NaN gradients (precision="
                f"{self.precision!r}), from global step {self._run_of_skips[0]} to {step}: the model is not training."
                " HINT: find what makes the first of them non-finite (a NaN in the data or the loss, a too high"
                " learning rate, missing clipping); `ZeroPrecision(max_consecutive_skips=0)` never stops."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
            self._sync_scale()


def to_zero_precision(plugin: Any, kind: type[ZeroFabricPrecision] = ZeroFabricPrecision) -> ZeroFabricPrecision:
    """The ZeRO plugin (a ``kind``: each door passes its own) for what Lightning assigned, or an error naming what is
    not supported. An explicit one (``plugins=[...]`` or the strategy's ``precision=...``) is kept as is."""
    if plugin is None:
        return kind()
    if isinstance(plugin, kind):
        return plugin
    name = str(getattr(plugin, "precision", type(plugin).__name__))
    if name in SUPPORTED_PRECISION or name in REFUSED:
        return kind(name)
    raise ZeroPrecisionError(
        f"precision plugin {type(plugin).__name__} ({name!r}) is not supported by lzero."
        f" HINT: use `precision=...` with one of {', '.join(SUPPORTED_PRECISION)}."
    )
