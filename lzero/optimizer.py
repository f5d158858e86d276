"""The user's optimizer, kept as written, re-targeted at the fp32 shards.

[Note: two faces of one optimizer]
``ZeroOptimizer`` shows Lightning and the user the optimizer they built: the same class name in
logs, and ``param_groups`` that are the very dicts of their optimizer, listing the module's
parameters (so ``toggle_optimizer`` works and LR schedulers bound to their optimizer keep
steering it). Behind it, instances of the same class with the same constructor flags step this
rank's shard tensors: one instance per param group, holding the fp32 master shards of all of the
group's units, so a step makes one optimizer call per param group whatever the number of units
(torch's foreach and fused kernels take the whole list in one call; the for-loop kernel does per
tensor exactly what it would do in a call of its own, so results are bitwise those of one call per
unit). Offloaded units are the exception: the host steps a group's units in memory in about
``HOST_STEP_CALLS`` (8) buckets (at least ``allgather_bucket_size``, at most ``sub_group_size`` elements each),
one call per bucket, so each bucket's values go back while the next one steps; NVMe units are stepped
``min(allgather_bucket_size, sub_group_size)`` elements at a time, what is resident at once. Before every step the hyperparameters of the user's
groups are copied into the inner groups, so LR schedulers and manual LR changes reach the
sharded step.

[Note: the host step]
A unit whose state is offloaded (``offload_optimizer``) is stepped on the host, over its flat fp32
shard, by the user's optimizer class with the user's hyperparameters. Where torch has a fused CPU
kernel (Adam, AdamW, SGD, Adagrad) and the user did not set ``fused=False``, that kernel is used:
one multithreaded pass over the shard, several times faster than the for-loop or foreach kernels on
the CPU (benchmarks/README.md, offload). It rounds differently from the other kernels at the last
bit (measured in tests/offload/test_offload.py); ``fused=True`` on the user's optimizer makes the offloaded
and the device step run the same kernel on a CPU model, and ``fused=False`` keeps the user's kernel on the host.
On a GPU the device step runs torch's fused CUDA kernel and the host step its fused CPU kernel, which are not the
same code: on an H200 (torch 2.11) 10 AdamW steps of identical values and gradients ended up to 1.1e-7 apart
(benchmarks/README.md, gpu), so there offload is not bitwise the device run under Adam-type optimizers.
Before the first step each offloaded optimizer is checked on a two-element host tensor, so an
optimizer without a CPU implementation is refused at setup, by name, rather than at the first step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

from lzero.checkpoint.full_state import gather_optimizer_state, load_optimizer_state
from lzero.engine.engine import ZeroEngine
from lzero.engine.flat_unit import FlatUnit
from lzero.engine.ownership import WHOLE_TENSOR_OPTIMIZERS, steps_whole_tensors
from lzero.engine.partition import ParamSpec
from lzero.errors import ZeroError

ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
)
"""Optimizers whose update of an element depends only on that element's history, so stepping a
shard gives exactly what stepping the whole model gives."""


FUSED_ON_HOST = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""Optimizers with a fused CPU kernel (torch >= 2.4): an offloaded step runs it unless the user chose
``fused=False``. See [Note: the host step]."""

KERNEL_FLAGS = ("fused", "foreach")
"""Group keys that choose the kernel rather than the update: not copied from the user's groups each step."""


class ZeroOptimizerError(ZeroError, TypeError):
    """An optimizer lzero cannot shard as written; the message says how to fix it."""


def check_optimizer(optimizer: Optimizer, allow_untested: bool, partition: str = "auto") -> None:
    """Refuse an optimizer lzero would step otherwise than DDP: see [Note: per-tensor ownership] in partition.py for
    those stepped whole tensor by whole tensor (``partition``: the config's ``optimizer_partition``)."""
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ZeroOptimizerError(
            f"lzero cannot shard `{name}`: L-BFGS keeps one history of flattened updates over all of its parameters"
            " together and re-evaluates the loss through its closure several times per step, so neither a shard of"
            " elements nor a split of whole tensors among ranks steps what it steps under DDP. HINT: train with DDP"
            " (`strategy='ddp'`), or use AdamW, Muon or Adafactor under lzero.")
    if steps_whole_tensors(optimizer, partition):
        return  # each owned tensor stepped whole: exact for any optimizer that steps each parameter on its own
    _refuse_blockwise_state(optimizer)
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS or allow_untested:
        return
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    whole = ", ".join(c.__name__ for c in WHOLE_TENSOR_OPTIMIZERS)
    raise ZeroOptimizerError(
        f"lzero cannot shard `{name}` element by element: it is not on the allow-list of elementwise optimizers"
        f" ({allowed}), and an optimizer that reads across elements (Shampoo, SOAP, ...) would see only this rank's"
        f" slice. lzero steps the optimizers known to read whole matrices ({whole}) whole tensor by whole tensor, each"
        " parameter on the rank that owns it. HINT: pass `optimizer_partition='per_tensor'` (ZeroStrategy option or"
        " YAML key) to step this one that way too, or `allow_untested_optimizer=True` if you know its update is"
        " elementwise."
    )


def _refuse_blockwise_state(optimizer: Optimizer) -> None:
    """bitsandbytes' 8-bit optimizers quantize their state in blocks across elements: refused even when untested
    optimizers are allowed, since the refusal's reason is known."""
    cls = type(optimizer)
    bits = getattr(getattr(optimizer, "args", None), "optim_bits", 32)
    if not cls.__module__.startswith("bitsandbytes") or ("8bit" not in cls.__name__ and bits != 8):
        return
    raise ZeroOptimizerError(
        f"lzero does not shard `{cls.__module__}.{cls.__qualname__}`: its state is quantized to 8 bits in blocks of"
        " 256 elements of each tensor it steps, with one scale per block, and tensors under 4096 elements keep"
        " 32-bit state. lzero steps flat shards that join and cut tensors, so the blocks, their scales and that"
        " threshold would fall on other elements than under DDP, and the update would differ from DDP's by more"
        " than rounding. HINT: use `torch.optim.AdamW(..., fused=True)` (for QLoRA adapters its fp32 state is"
        " small and sharded: 8 bytes per trainable parameter / N), or the 32-bit bitsandbytes variant with"
        " `ZeroStrategy(allow_untested_optimizer=True)`.")


class _Shared:
    """Mutable state kept out of ``__dict__``: LightningOptimizer copies that dict once at wrap time."""

    def __init__(self) -> None:
        self.inner: dict[int, Optimizer] = {}  # unit index -> the optimizer stepping its shard
        # per-tensor units: unit index -> each owned parameter as a Parameter viewing its place in the master shard
        self.tensors: dict[int, list[OwnedTensor]] = {}


class OwnedTensor:
    """A parameter this rank owns whole in a per-tensor unit ([Note: per-tensor ownership] in partition.py): what the
    inner optimizer steps is ``param``, a Parameter of the parameter's shape viewing elements ``[at, at + numel)`` of
    the unit's master shard, given that range of the master's gradient for the step. Its optimizer state is the
    inner optimizer's ``state[param]``, in the optimizer's own per-tensor format."""

    def __init__(self, unit: FlatUnit, spec: ParamSpec, at: int) -> None:
        self.unit, self.spec, self.at = unit, spec, at
        self.param = torch.nn.Parameter(self._view(unit.master_shard.detach()))

    def _view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.at : self.at + self.spec.numel].view(self.spec.shape)

    def link(self) -> None:
        """Point at the master's current memory (a store may swap it) and take its gradient (None: not stepped)."""
        master = self.unit.master_shard
        self.param.data = self._view(master.data)
        self.param.grad = None if master.grad is None else self._view(master.grad)


class ZeroOptimizer(Optimizer):
    """See [Note: two faces of one optimizer]."""

    def __init__(self, optimizer: Optimizer, engine: Optional[ZeroEngine], index: int = 0,
                 start: Optional[Callable[[], None]] = None) -> None:
        """``engine`` None: the engine does not exist yet (Fabric's ``setup_optimizers`` comes before the model's first
        use, see [Note: the engine starts at first use] in lightning/fabric_strategy.py); ``start()`` builds it and
        calls :meth:`attach`."""
        self._building = True
        super().__init__([p for g in optimizer.param_groups for p in g["params"]] or [torch.zeros(0)],
                         dict(optimizer.defaults))
        self._building = False
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups  # the same dicts: see the Note
        self.defaults = optimizer.defaults
        self._shared = _Shared()
        self._start = start
        self.engine: Optional[ZeroEngine] = None
        if engine is not None:
            self.attach(engine, index)

    def attach(self, engine: ZeroEngine, index: int) -> None:
        """Step ``engine``'s units of optimizer ``index`` from now on."""
        self.engine = engine
        self.index = index
        self.units: list[FlatUnit] = engine.units_of(index)
        self.host_kernel: Optional[str] = None  # the kernel offloaded units step with; None: none offloaded
        optimizer = self.optimizer
        _refuse_swapped_whole_tensors(optimizer, self.units)
        if any(u.store.name != "device" for u in self.units):
            self.host_kernel = _check_host_step(optimizer)
        # the units each inner optimizer steps in one call, in step order: see the Note
        self.buckets: list[tuple[list[FlatUnit], Optimizer]] = []
        for bucket in engine.step_buckets(self.units):
            for unit in bucket:
                if unit.spec.per_tensor:
                    self._shared.tensors[unit.spec.index] = [OwnedTensor(unit, spec, at)
                                                             for spec, at in unit.spec.owned_params(unit.rank)]
            inner = _build_inner(optimizer, bucket, self._shared.tensors)
            self.buckets.append((bucket, inner))
            for unit in bucket:
                self._shared.inner[unit.spec.index] = inner
                # a store that swaps the state in and out finds it here
                unit.store.bind_state(unit, lambda inner=inner, master=unit.master_shard: inner.state[master])

    def started(self) -> "ZeroOptimizer":
        """This optimizer with its engine built (a collective the first time, under Fabric)."""
        if self.engine is None:
            if self._start is None:
                raise RuntimeError("This ZeroOptimizer has no engine. HINT: set it up through the strategy.")
            self._start()
        return self

    def shard_optimizer(self, unit: FlatUnit) -> Optimizer:
        """The optimizer (the user's class and flags) that steps ``unit``'s shard on this rank."""
        return self._shared.inner[unit.spec.index]

    def owned_tensors(self, unit: FlatUnit) -> list[OwnedTensor]:
        """A per-tensor unit's parameters this rank owns and steps whole (none for an elementwise unit)."""
        return self._shared.tensors.get(unit.spec.index, [])

    def __repr__(self) -> str:
        stage = self.engine.config.stage if self.engine is not None else "not started"
        return f"ZeroOptimizer({type(self.optimizer).__name__}, stage={stage})"

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.started()
        self.engine.prepare_step(self.units)
        for _, inner in self.buckets:  # read now: with the delayed update a worker thread steps after this returns
            self._copy_hyperparameters(inner)
        self.engine.step_and_gather([(bucket, self._stepper(bucket, inner)) for bucket, inner in self.buckets])
        self.optimizer._opt_called = True  # LR schedulers check that the optimizer they wrap has stepped
        return loss

    def _stepper(self, bucket: list[FlatUnit], inner: Optimizer) -> Callable[[], Any]:
        """The call that steps ``bucket``: the inner optimizer's step, over the owned tensors' views of the masters and
        their gradients for per-tensor units."""
        if not bucket[0].spec.per_tensor:
            return inner.step
        owned = [t for unit in bucket for t in self.owned_tensors(unit)]

        def step() -> None:
            for tensor in owned:
                tensor.link()
            try:
                inner.step()
            finally:
                for tensor in owned:
                    tensor.param.grad = None  # the unit's gradient buffers are freed after the step

        return step

    def _copy_hyperparameters(self, inner: Optimizer) -> None:
        """The user's group's current hyperparameters (an LR scheduler's, a manual change) into ``inner``."""
        outer = self.param_groups[inner.lzero_group]
        inner.param_groups[0].update({k: v for k, v in outer.items() if k != "params" and k not in KERNEL_FLAGS})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.started()
        self.engine.zero_grad(self.units, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_building", False):
            return super().add_param_group(param_group)
        raise ZeroOptimizerError(
            "`add_param_group` after setup is not supported under lzero: the parameters are already packed into"
            " sharded units. HINT: create every param group in `configure_optimizers` (a group may start with"
            " lr=0 and be enabled later by a scheduler or by setting its 'lr')."
        )

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of this optimizer's reduced gradients (a collective: call it on every rank)."""
        return self.started().engine.grad_norm(self.units)

    def state_dict(self) -> dict[str, Any]:
        """The full per-parameter state in torch's format (a collective: call it on every rank)."""
        self.started()
        self.engine.flush_delayed_update()
        return gather_optimizer_state(self, to_all=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full per-parameter state (from DDP or from :meth:`state_dict`) into this rank's shards."""
        self.started()
        self.engine.flush_delayed_update()
        load_optimizer_state(self, state_dict)


def _build_inner(optimizer: Optimizer, units: list[FlatUnit], tensors: dict[int, list[OwnedTensor]]) -> Optimizer:
    """Same class, same constructor flags, the units' group hyperparameters, the units' shards (offloaded: the
    host kernel of [Note: the host step]); per-tensor units: the owned tensors, whole. The units share one param
    group and one store."""
    index = units[0].spec.group[1]
    group = {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}
    flags = _flags(optimizer)
    if units[0].store.name != "device":
        kernel = _host_kernel(optimizer)
        group.update(kernel)
        flags.update(kernel)
    if units[0].spec.per_tensor:
        group["params"] = [t.param for unit in units for t in tensors[unit.spec.index]]
    else:
        group["params"] = [unit.master_shard for unit in units]
    inner = type(optimizer)([group], **flags)
    inner.lzero_group = index  # the user's group whose hyperparameters it follows
    return inner


def _flags(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's constructor flags, as its class accepts them."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _host_kernel(optimizer: Optimizer) -> dict[str, Any]:
    """The kernel flags an offloaded step runs with: fused where torch has a CPU kernel and the user allowed it."""
    defaults = optimizer.defaults
    if type(optimizer) in FUSED_ON_HOST and defaults.get("fused") is None and not defaults.get("differentiable"):
        return {"fused": True, "foreach": None}
    return {}


def _refuse_swapped_whole_tensors(optimizer: Optimizer, units: list[FlatUnit]) -> None:
    """NVMe swaps a unit's optimizer state as flat tensors of its shard; a per-tensor unit's state is per tensor."""
    unit = next((u for u in units if u.spec.per_tensor and not u.store.in_memory), None)
    if unit is not None:
        raise ZeroOptimizerError(
            f"`{type(optimizer).__name__}` steps whole tensors ([Note: per-tensor ownership]), and its state is kept per"
            " tensor in the optimizer's own format, which the NVMe swap files (one flat file per shard state) do not"
            " hold yet. HINT: offload its state to host memory (`offload_optimizer: cpu`, the 'zero2_offload' and"
            " 'zero3_offload' strategies), or use an elementwise optimizer with NVMe.")


def _check_host_step(optimizer: Optimizer) -> str:
    """Step the user's optimizer class, with its flags and the host kernel, on a 2 x 2 host tensor: an
    optimizer without a CPU implementation is refused now, by name. Returns the kernel's description."""
    flags = {**_flags(optimizer), **_host_kernel(optimizer)}
    # a 2 x 2 matrix: optimizers of matrices (Muon) refuse vectors
    probe = torch.nn.Parameter(torch.zeros(2, 2, dtype=optimizer.param_groups[0]["params"][0].dtype))
    probe.grad = torch.full_like(probe, 1e-3)
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    try:
        type(optimizer)([probe], **flags).step()
    except Exception as err:  # noqa: BLE001 - any failure means the class cannot step host tensors
        raise ZeroOptimizerError(
            f"`offload_optimizer` steps the optimizer on the host (CPU), but `{name}` cannot step a CPU tensor"
            f" with flags {flags}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. HINT: use a"
            " torch.optim optimizer (e.g. torch.optim.AdamW), or keep the optimizer on the device with"
            " `offload_optimizer: none`."
        ) from err
    kernel = "fused" if flags.get("fused") else "foreach" if flags.get("foreach") else "default"
    return f"{type(optimizer).__name__} ({kernel} kernel)"
