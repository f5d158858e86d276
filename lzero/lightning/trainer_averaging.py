"""Lightning's weight-averaging callbacks (``WeightAveraging``, ``EMAWeightAveraging``, ``StochasticWeightAveraging``)
over the engine's averaged shards, at every stage. trainer_strategy.py calls :func:`defer_setup` and
:func:`shard_weight_averaging`.

[Note: weight averaging under ZeRO]
The callbacks keep their own control flow: when to update (``should_update``, SWA's epochs), when the average goes
into the model (validation, the end of fit, SWA's BatchNorm epoch), what the checkpoint holds. Only their storage and
arithmetic change. Before the callbacks' ``setup`` (which would copy the whole module, and call ``configure_model``
outside the sharded context) the strategy shadows it on the callback instance; once the engine exists, the callback's
``_average_model`` becomes a :class:`ShardedAveragedModel`, whose parameters are the engine's averaged shards (see
[Note: averaged shards] in lzero/engine/averaged.py) and whose buffers are a copy of the module's (whole on every
rank), and the methods that read or write whole parameters are shadowed for this fit:

- ``WeightAveraging``: ``update_parameters`` is torch's ``AveragedModel.update_parameters`` itself, run over the
  shards and the module's buffers (same ``avg_fn``/``multi_avg_fn``, ``use_buffers``, ``n_averaged``);
  ``_swap_models`` and ``_copy_average_to_current`` trade or copy masters and averages (then the parameters are
  refreshed) and the buffers; ``on_save_checkpoint``/``on_load_checkpoint`` keep Lightning's keys: ``state_dict``
  holds the average, ``current_model_state`` the current weights, ``averaging_state`` ``n_averaged``.
- ``StochasticWeightAveraging``: ``update_parameters`` applies SWA's rule (a copy at ``n_averaged == 0``, then
  ``avg_fn``) to the shards, ``transfer_weights`` copies the averages into the masters, and the average model's state
  in the callback's state is the averaged shards.

In a sharded checkpoint the averages are pieces of their own, ``average/<name>`` (see [Note: averages in a sharded
checkpoint] in lzero/checkpoint/averages.py), and ``current_model_state`` holds only the tensors outside every unit
(buffers, frozen parameters): the current parameters are ``param/<name>``, what training resumes from. A full
checkpoint gathers both on rank 0, as DDP's file holds them. After fit the shadows come off and ``_average_model`` is
None again: the model holds the average, as under DDP after ``on_train_end``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lzero.config import ZeroConfigError

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from lzero.engine.averaged import AveragedShards
    from lzero.engine.engine import ZeroEngine

SHARDED_MARKER = {"lzero": "the averaged parameters are the checkpoint's average/<name> pieces"}
"""What SWA's ``average_model_state`` holds in a sharded checkpoint (the pieces hold the values)."""


def averaging_callbacks(callbacks: list[Any]) -> list[Any]:
    """The callbacks of ``callbacks`` that average weights (Lightning's ``WeightAveraging`` family and
    ``StochasticWeightAveraging``)."""
    from lightning.pytorch import callbacks as known

    kinds = tuple(getattr(known, n) for n in ("StochasticWeightAveraging", "WeightAveraging") if hasattr(known, n))
    return [c for c in callbacks if isinstance(c, kinds)]


def _shadow(stack: contextlib.ExitStack, callback: Any, **methods: Callable) -> None:
    """``methods`` set on the callback instance until ``stack`` closes (the class's own come back then)."""
    for name, method in methods.items():
        callback.__dict__[name] = method
        stack.callback(callback.__dict__.pop, name, None)


def defer_setup(trainer: "Trainer", stack: contextlib.ExitStack, fitting: bool) -> None:
    """Before the callbacks' ``setup``: theirs would copy the whole module (SWA's at every stage, of a model that a
    zero3 fit left sharded); in a fit the sharded stand-in comes once the engine exists
    (:func:`shard_weight_averaging`). See [Note: weight averaging under ZeRO]."""
    found = averaging_callbacks(trainer.callbacks)
    if fitting and len(found) > 1:
        names = ", ".join(type(c).__name__ for c in found)
        raise ZeroConfigError(
            f"{len(found)} weight-averaging callbacks ({names}) were given; lzero keeps one average per run. HINT:"
            " keep one of them (a custom `should_update` or `avg_fn` on one callback covers most needs).")
    for callback in found:
        _shadow(stack, callback, setup=lambda trainer, pl_module, stage: None)


def shard_weight_averaging(trainer: "Trainer", engine: "ZeroEngine", sharded_checkpoint: Callable[[], bool],
                           stack: contextlib.ExitStack) -> None:
    """Give the weight-averaging callback of this fit (one at most: :func:`defer_setup`) its sharded average (see
    [Note: weight averaging under ZeRO]), until ``stack`` closes. ``sharded_checkpoint()``: whether the checkpoint
    being written is a sharded one."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lzero.engine.averaged import AveragedShards

    for callback in averaging_callbacks(trainer.callbacks):
        device = callback._device
        device = torch.device(device) if isinstance(device, (str, int)) else device
        engine.average = AveragedShards(engine, device)
        shard = _shard_swa if isinstance(callback, StochasticWeightAveraging) else _shard_weight_averaging
        callback._average_model = shard(callback, trainer, engine.average, sharded_checkpoint, device, stack)
        stack.callback(_forget, callback, engine)


def _forget(callback: Any, engine: "ZeroEngine") -> None:
    """After fit: the model holds the average (as after DDP's ``on_train_end``); the shards go."""
    callback._average_model = None
    engine.average = None


def _shard_weight_averaging(callback: Any, trainer: "Trainer", average: "AveragedShards",
                            sharded_checkpoint: Callable[[], bool], device: Optional[torch.device],
                            stack: contextlib.ExitStack) -> "ShardedAveragedModel":
    """``WeightAveraging``'s stand-in (its ``AveragedModel`` arguments) and the hooks that move whole parameters."""
    module, kwargs = trainer.lightning_module, callback._kwargs
    stand_in = ShardedAveragedModel(average, module, sharded_checkpoint, kwargs.get("avg_fn"),
                                    kwargs.get("multi_avg_fn"), callback._use_buffers,
                                    device if device is not None else module.device)
    _shadow(stack, callback, _swap_models=stand_in.swap, _copy_average_to_current=stand_in.copy_to_current,
            on_save_checkpoint=lambda trainer, pl_module, checkpoint: stand_in.save_into(checkpoint),
            on_load_checkpoint=lambda trainer, pl_module, checkpoint: stand_in.load_from(checkpoint))
    return stand_in


def _shard_swa(callback: Any, trainer: "Trainer", average: "AveragedShards", sharded_checkpoint: Callable[[], bool],
               device: Optional[torch.device], stack: contextlib.ExitStack) -> "ShardedAveragedModel":
    """``StochasticWeightAveraging``'s stand-in (its average model) and its static methods on whole parameters."""
    stand_in = ShardedAveragedModel(average, trainer.lightning_module, sharded_checkpoint)
    _shadow(stack, callback,
            update_parameters=lambda average_model, model, n_averaged, avg_fn: stand_in.update_swa(n_averaged, avg_fn),
            transfer_weights=lambda source, destination: average.copy_to_masters(),
            load_state_dict=_swa_load_state_dict(callback, trainer))
    return stand_in


def _swa_load_state_dict(callback: Any, trainer: "Trainer") -> Callable[[dict[str, Any]], None]:
    """SWA's ``load_state_dict``, then what its ``on_fit_start`` does with a restored scheduler state: lzero restores
    checkpoints after setup (``restore_checkpoint_after_setup``), so after ``on_fit_start`` has run, and SWA's own
    clearing of the schedulers would not happen before they are restored, as it does under DDP."""
    own = type(callback).load_state_dict

    def load_state_dict(state: dict[str, Any]) -> None:
        own(callback, state)
        if callback._scheduler_state is not None:
            callback._clear_schedulers(trainer)

    return load_state_dict


class _Tensors(nn.Module):
    """Tensors as a module's parameters (``p0``, ``p1``...; sharing their memory) and buffers (``b0``...), in order:
    what ``AveragedModel.update_parameters`` walks."""

    def __init__(self, params: list[Tensor], buffers: list[Tensor]) -> None:
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", nn.Parameter(p, requires_grad=False))
        for i, b in enumerate(buffers):
            self.register_buffer(f"b{i}", b)


class ShardedAveragedModel(AveragedModel):
    """The stand-in for a weight-averaging callback's ``AveragedModel`` (see [Note: weight averaging under ZeRO]):
    its parameters are ``average``'s shards, its buffers a copy of ``module``'s. It stays where it is (``to`` moves
    nothing: the shards live where the masters do)."""

    def __init__(self, average: "AveragedShards", module: "LightningModule", sharded_checkpoint: Callable[[], bool],
                 avg_fn: Optional[Callable] = None, multi_avg_fn: Optional[Callable] = None,
                 use_buffers: bool = False, device: Optional[torch.device] = None) -> None:
        nn.Module.__init__(self)  # not AveragedModel's: no deep copy of the module
        self.module = _Tensors([average.shard(u) for u in average.units],
                               [b.detach().clone() for b in module.buffers()])
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=device))  # where DDP's is
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers
        # not submodules: the average's owner and the LightningModule stay out of this module's state
        self.__dict__.update(average=average, lightning_module=module, sharded_checkpoint=sharded_checkpoint)

    def to(self, *args: Any, **kwargs: Any) -> "ShardedAveragedModel":
        return self

    def _buffers_of_average(self) -> list[Tensor]:
        return list(self.module.buffers())

    # --- updates ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """``AveragedModel.update_parameters`` over the shards: the masters stand for ``model``'s parameters."""
        with self.average.masters() as pairs:
            AveragedModel.update_parameters(self, _Tensors([master for _, master in pairs], list(model.buffers())))

    @torch.no_grad()
    def update_swa(self, n_averaged: Tensor, avg_fn: Callable) -> None:
        """``StochasticWeightAveraging.update_parameters`` on the shards: the masters copied while nothing is
        averaged yet, then ``avg_fn(average, current, n_averaged)``; ``n_averaged`` counts one more."""
        for average, master in self.average.one_by_one(write=False):
            current = master.to(average.device)
            average.copy_(current if n_averaged == 0 else avg_fn(average, current, n_averaged.to(average.device)))
        n_averaged += 1

    @torch.no_grad()
    def swap(self, pl_module: nn.Module) -> None:
        """``WeightAveraging._swap_models``: the parameters and buffers trade values with the average. A collective."""
        self.average.swap()
        for average, current in zip(self._buffers_of_average(), pl_module.buffers()):
            held = average.clone()
            average.copy_(current)
            current.copy_(held)

    @torch.no_grad()
    def copy_to_current(self, pl_module: nn.Module) -> None:
        """``WeightAveraging._copy_average_to_current``: the parameters and buffers take the average. A collective."""
        self.average.copy_to_masters()
        for average, current in zip(self._buffers_of_average(), pl_module.buffers()):
            current.copy_(average)

    # --- checkpoints -----------------------------------------------------------------------------------------------

    def _kinds(self) -> tuple[dict[int, tuple[Any, int]], dict[int, int]]:
        """id(parameter) -> (unit, index) for the averaged parameters; id(buffer) -> its index among the module's
        buffers."""
        params = {id(p): (u, i) for u in self.average.units for i, p in enumerate(u.params)}
        return params, {id(b): i for i, b in enumerate(self.lightning_module.buffers())}

    @torch.no_grad()
    def _averaged_full(self) -> dict[int, Tensor]:
        """id(parameter) -> its whole averaged value, on rank 0 (empty elsewhere). A collective."""
        keep = self.average.engine.rank == 0
        full: dict[int, Tensor] = {}
        for unit, flat in self.average.gathered():
            if keep:
                for p, (start, end) in zip(unit.params, unit.ranges):
                    full[id(p)] = flat[start:end].view(p.shape).to(dtype=unit.master_dtype, copy=True)
        return full

    def averaged_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the strategy's state dict: the sharded form, or plain tensors) with the average in place of the
        current values: the averaged buffers and, unless a sharded checkpoint is being written, the averaged
        parameters, gathered on rank 0 (a collective; None elsewhere). In a sharded checkpoint a parameter stays a
        ``ShardedTensor``: its average is written as pieces."""
        params, buffers = self._kinds()
        averaged_buffers = self._buffers_of_average()
        sharded = self.sharded_checkpoint()
        full = {} if sharded else self._averaged_full()
        own = self.lightning_module.state_dict(keep_vars=True)
        out = {}
        for key, value in state.items():
            tensor = own.get(key)
            if tensor is not None and id(tensor) in buffers:
                out[key] = averaged_buffers[buffers[id(tensor)]].detach().clone()
            elif tensor is not None and id(tensor) in params and not sharded:
                out[key] = full.get(id(tensor))
            else:
                out[key] = value  # a sharded parameter (its average: pieces), or outside the average (frozen)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """SWA's ``average_model_state``: in a sharded checkpoint a marker (the values are ``average/<name>``
        pieces); otherwise the LightningModule's state dict with the averaged parameters (gathered on rank 0: a
        collective) and the average model's buffers."""
        if self.sharded_checkpoint():
            return dict(SHARDED_MARKER)
        from lzero.checkpoint.state_dict import consolidate, sharded_state_dict

        engine = self.average.engine
        return consolidate(engine, self.averaged_state(sharded_state_dict(engine, self.lightning_module)))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """SWA's ``average_model_state`` back: a sharded checkpoint's averages were read with the parameters (the
        strategy's ``load_model_state_dict``); a full one's are sliced here, each rank taking its pieces."""
        if state_dict is None or state_dict == SHARDED_MARKER:
            return None
        from lzero.checkpoint.state_dict import fetch_full

        fetch = fetch_full(state_dict)
        self.average.fill(lambda spec, a, b: fetch(spec.name, a, b))
        self._load_buffers(self._buffers_of_average(), state_dict)
        return None

    def _load_buffers(self, into: list[Tensor], state: Any) -> None:
        for i, (name, _) in enumerate(self.lightning_module.named_buffers()):
            if name in state:
                into[i].copy_(state[name])

    @torch.no_grad()
    def save_into(self, checkpoint: dict[str, Any]) -> None:
        """``WeightAveraging.on_save_checkpoint`` with Lightning's keys: ``state_dict`` the average,
        ``current_model_state`` the current values (in a sharded checkpoint, only the tensors outside every unit:
        the current parameters are the ``param/<name>`` pieces), ``averaging_state`` ``n_averaged``."""
        from lzero.checkpoint.state_dict import ShardedTensor

        state = checkpoint["state_dict"]
        sharded = self.sharded_checkpoint()
        checkpoint["current_model_state"] = {k: v for k, v in state.items() if not isinstance(v, ShardedTensor)} \
            if sharded else state
        checkpoint["state_dict"] = self.averaged_state(state)
        checkpoint["averaging_state"] = {"n_averaged": self.n_averaged.detach().clone()}

    @torch.no_grad()
    def load_from(self, checkpoint: dict[str, Any]) -> None:
        """``WeightAveraging.on_load_checkpoint``: after the strategy loaded ``state_dict`` (a sharded checkpoint:
        the current ``param/<name>`` pieces and the ``average/<name>`` ones; a full one: the average, into the
        masters), the average and the current values end where Lightning's hook puts them."""
        from lzero.checkpoint.resume import READER
        from lzero.checkpoint.state_dict import fetch_full, load_params

        module = self.lightning_module
        state = checkpoint["state_dict"]
        if "current_model_state" not in checkpoint or "averaging_state" not in checkpoint:
            self.average.copy_from_masters()  # not saved with weight averaging: the average starts from the model
            self._load_buffers(self._buffers_of_average(), state)
            return
        self.n_averaged.copy_(checkpoint["averaging_state"]["n_averaged"])
        self._load_buffers(self._buffers_of_average(), state)
        current = checkpoint["current_model_state"]
        if checkpoint.get(READER) is None:  # full: the masters hold the average; the current values come from the file
            self.average.copy_from_masters()
            load_params(self.average.engine, fetch_full(current))
        module.load_state_dict({k: v for k, v in current.items() if k in dict(module.named_buffers())}, strict=False)
