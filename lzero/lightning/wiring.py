"""What both front doors do alike: the preset names, the meta device of ``configure_model`` / ``init_module``, the
engine's start and each forward's, the configuration ``stage="auto"`` chooses and the sizes ``"auto"`` fills, the
weights of a model whose strategy starts no engine, the check that every rank reached a collective call, the
optimizer behind Lightning's wrappers, the precision state in a checkpoint, and generation. The strategies
(trainer_strategy.py, fabric_strategy.py) call these; nothing here imports ``lightning.pytorch``
(tests/lightning/test_doors.py runs each through both doors)."""

from __future__ import annotations

import contextlib
import sys
from contextlib import contextmanager
from typing import Any, Generator, Optional, Sequence, TypeVar

import torch
from torch.optim import Optimizer

from lzero.checkpoint.deepspeed_checkpoint import PRECISION_STATE
from lzero.config import ZeroConfig
from lzero.errors import ZeroError
from lzero.lightning.precision import ZeroFabricPrecision
from lzero.optimizer import ZeroOptimizer, ZeroOptimizerError

Strategy = TypeVar("Strategy")


def build_preset(strategy: type[Strategy], name: str, **init_params: Any) -> Strategy:
    """The ``strategy`` (either door's class) a registered name (``lzero.presets.PRESET_CONFIGS``) stands for; the
    registry's factory (_lzero_startup.py) builds it with the arguments the user gave, over the preset's."""
    from lzero.presets import PRESET_CONFIGS

    return strategy(**{**PRESET_CONFIGS[name], **init_params})


def zero_optimizer(optimizer: Any, hint: str) -> ZeroOptimizer:
    """The :class:`ZeroOptimizer` behind an optimizer a door hands back: the Trainer's ``LightningOptimizer`` and
    Fabric's ``_FabricOptimizer`` both keep the wrapped one in ``_optimizer``. ``hint``: which optimizer to pass
    instead, at this door."""
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(inner, ZeroOptimizer):
        raise ZeroOptimizerError(f"`{type(inner).__name__}` is not an optimizer set up by lzero's strategy. HINT:"
                                 f" {hint}.")
    return inner


def before_forward(engine: Any) -> None:
    """Before a forward of the model: a step's pending work settled, the root's parameters gathered (stage 3)."""
    if engine is not None:
        engine.before_forward()
        engine.gather_root()


class EveryRankCheck:
    """[Note: every rank at a collective call]
    A rank that enters a collective its peers never enter waits for the process group's timeout (30 minutes by
    default), then fails with an error that names no cause. So where a collective may be entered by some ranks only,
    a door first meets its peers in a barrier on a gloo group of its own, whose timeout is
    ``exception_checkpoint_timeout_s``: every rank there in time, or a prompt error naming the call. The group is made
    at setup, while every rank is there (making a group is itself a collective).

    The doors differ in what a missing peer means, so in what they do with the error (:class:`RanksApart`): the
    Trainer asks before a checkpoint after an exception (Lightning's ``OnExceptionCheckpoint`` runs on the rank that
    raised only): it warns and skips the checkpoint, so that the rank exits with the user's exception, not one of
    its own. Fabric asks before a user's call that is a collective under lzero (``fabric.save``, ``state_dict``,
    the model's first use): a peer missing there is a script calling it on some ranks only, so it raises."""

    def __init__(self, mesh: Any, timeout_s: float) -> None:
        """``mesh``: the run's (``run_mesh``), which makes the group (its ``control``; None at world size 1)."""
        self.mesh, self.timeout_s = mesh, timeout_s
        self.group: Any = mesh.group("control", timeout_s)

    def wait(self, what: str) -> None:
        """Returns once every rank reached ``what``; raises :class:`RanksApart` when one did not in time."""
        if self.group is None:
            return
        import torch.distributed as dist

        try:
            dist.barrier(group=self.group)
        except RuntimeError as err:
            raise RanksApart(f"not every rank reached {what} within exception_checkpoint_timeout_s="
                             f"{self.timeout_s:g} s ({err})") from err

    def close(self) -> None:
        """Destroys the group: no barrier is pending on it (they are synchronous), so this waits for no rank."""
        if self.group is not None:
            self.mesh.destroy("control")
            self.group = None


class RanksApart(ZeroError, RuntimeError):
    """Not every rank reached a collective call within ``exception_checkpoint_timeout_s``: see [Note: every rank at
    a collective call]."""


AUTO_RECORD = "lzero/auto"
"""A full checkpoint's entry holding ``stage="auto"``'s record, at both doors (a sharded one keeps it in its
manifest's ``auto``)."""


def take_precision_state(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The precision plugin's state (skipped steps, the fp16 loss scaler's) that ``checkpoint`` holds, removed from
    it: under :data:`PRECISION_STATE` (a Fabric save, a DeepSpeed folder) or under the Trainer plugin's class name (as
    Lightning saves it: ``ZeroPrecision``). Each door restores it into its plugin, so a run resumed through either
    continues the loss scale where it was saved."""
    states = [checkpoint.pop(key) for key in (PRECISION_STATE, "ZeroPrecision") if key in checkpoint]
    return states[0] if states else None


def fill_auto_sizes(config: ZeroConfig, module: torch.nn.Module) -> ZeroConfig:
    """``"auto"`` sizes filled from the model's hidden size ([Note: sizes from the hidden size] in auto_sizes.py),
    logged in one line on rank 0."""
    from lightning.fabric.utilities import rank_zero_info

    from lzero import auto_sizes

    config, filled = auto_sizes.fill(config, module)
    if filled:
        rank_zero_info("lzero: \"auto\" sizes from the model's hidden size: "
                       + ", ".join(f"{k}={v}" for k, v in filled.items()))
    return config


def keep_generation_synced(stack: contextlib.ExitStack, module: torch.nn.Module, config: ZeroConfig,
                           world_size: int) -> None:
    """Stage 3 over several ranks: until ``stack`` closes (the engine's end), a Hugging Face ``generate`` inside
    ``module`` keeps the ranks stepping together (a forward gathers blocks: every rank must run as many), unless
    inside ``generation()``."""
    if config.stage >= 3 and world_size > 1:
        stack.enter_context(synced_generation(module, True))

@contextmanager
def meta_device(device: Optional[torch.device] = None, recording: Optional[contextlib.ExitStack] = None) -> Generator:
    """Modules built inside hold fake tensors that report ``device`` (default: the CPU) and hold no memory, their
    construction recorded (see [Note: a fake device] in engine/recording.py); call
    :func:`lzero.engine.recording.settle` on the module after the block. A Hugging Face ``from_pretrained`` inside
    builds into shards (see [Note: from_pretrained under zero3] in hf/pretrained.py). ``recording``: the
    construction's record stays open in it after the block (until the caller closes it), so initialization run on
    the model before setup is recorded too (Fabric: see [Note: the engine starts at first use] in
    fabric_strategy.py)."""
    from lzero.engine.recording import record
    from lzero.hf.pretrained import intercept

    with contextlib.ExitStack() as stack:
        recorder = (recording if recording is not None else stack).enter_context(record())
        with recorder.building_on(device or torch.device("cpu")), intercept():  # [Note: replayed construction]
            yield


def data_parallel_sampler_kwargs(world_size: int, global_rank: int, tensor_parallel_size: int,
                                 pipeline_parallel_size: int = 1) -> dict[str, int]:
    """Both doors' ``distributed_sampler_kwargs``: the data-parallel rank and size, so that the ranks of one
    tensor-parallel group, and the stages of one pipeline, read the same batches ([Note: the tensor dimension] and
    [Note: the pipeline dimension] in lzero/engine/mesh.py)."""
    data = world_size // (tensor_parallel_size * pipeline_parallel_size)
    return {"num_replicas": data, "rank": (global_rank // tensor_parallel_size) % data}


def apply_tp_plan(module: torch.nn.Module, config: ZeroConfig, device_mesh: Any) -> None:
    """``config.tp_plan`` resolved on ``module`` and applied over the tensor dimension of ``device_mesh`` (both doors;
    see [Note: the tensor-parallel plan] in lzero/engine/tensor_parallel_plan.py)."""
    from lzero.engine.tensor_parallel_plan import apply_plan
    from lzero.hf.tensor_parallel_plan import plan_for

    apply_plan(module, plan_for(module, config.tp_plan, config.tensor_parallel_size), device_mesh["tensor_parallel"])


def run_mesh(mesh: Any, config: ZeroConfig, deepspeed: Any = None, device_mesh: Any = None) -> Any:
    """The run's process groups, one owner for the strategy and its engines ([Note: the mesh] in mesh.py): ``mesh``,
    the strategy's so far, while the process group it was made in lives, else a new one. A bad ``shard_group_size``
    or ``hpz_partition_size`` is named by its DeepSpeed key when it came from one. ``device_mesh``: tensor parallel's
    2-D mesh; lzero's is then over its data-parallel group ([Note: the tensor dimension] in mesh.py)."""
    from lzero.deepspeed.config import as_written
    from lzero.engine.mesh import Mesh

    if mesh is not None and mesh.current():
        return mesh
    with as_written(deepspeed):
        return Mesh.of(config.shard_group_size, config.hpz_partition_size, device_mesh=device_mesh)


def start_engine(module: torch.nn.Module, optimizers: list[Optimizer], config: ZeroConfig,
                 precision: ZeroFabricPrecision, device: torch.device, num_processes: int, init_fn: Any = None,
                 weights: Any = None, evaluating: bool = False, attach_to: Sequence[Any] = (),
                 deepspeed: Any = None, memory_budget_bytes: Optional[int] = None, mesh: Any = None
                 ) -> tuple[Any, list[Any]]:
    """The engine over ``module`` and ``optimizers`` (already checked), and the optimizers re-targeted at its shards
    (``attach_to``: ZeroOptimizers made before the engine, one per optimizer), the precision bound to it. Both front
    doors start a run here. A collective. ``deepspeed``: the strategy's DeepSpeed JSON, translated: a value of it the
    engine refuses against the world size is named by its key (see [Note: errors name the key as written]).
    ``memory_budget_bytes``: the strategy's, the budget of stage 3's ``schedule="auto"`` too. ``mesh``: the
    strategy's process groups (``run_mesh``); None: a mesh of the engine's own."""
    from lzero.deepspeed.config import as_written
    from lzero.engine.engine import ZeroEngine
    from lzero.engine.rank_memory import MemoryBudget
    from lzero.offload.placement import announce_offload
    from lzero.offload.store import divide_host_threads
    from lzero.optimizer import ZeroOptimizer

    budget = MemoryBudget(memory_budget_bytes, num_processes)
    expected = expected_schedule(module, config, precision, device, budget) \
        if config.stage == 3 and config.schedule == "auto" and not evaluating else None
    with as_written(deepspeed):
        engine = ZeroEngine(module, optimizers, config, precision.policy, device=device, init_fn=init_fn,
                            weights=_with_pretrained(weights, pretrained_weights(module)),
                            evaluating=evaluating, mesh=mesh, memory_budget=budget)
    try:
        if not config.save_frozen and engine.outside and "transformers" in sys.modules:  # a Hugging Face model
            from lzero.engine import collectives
            from lzero.hf.eager_base import find_base

            group = engine.everyone
            engine.outside_base = find_base(module, engine.outside, group, collectives.rank(group),
                                            collectives.world_size(group))
        zero = list(attach_to) or [ZeroOptimizer(opt, engine, i) for i, opt in enumerate(optimizers)]
        for i, zopt in enumerate(attach_to):
            zopt.attach(engine, i)
        if engine.offloaded and zero:
            announce_offload(engine, zero, divide_host_threads(num_processes, config.offload_optimizer.host_threads))
        precision.bind(engine)
    except BaseException:  # see [Note: a setup that stops part way] in engine.py
        engine.abandon(module)
        raise
    if expected is not None:
        from lightning.fabric.utilities import rank_zero_info

        rank_zero_info(expected)
    return engine, zero


def expected_schedule(module: torch.nn.Module, config: ZeroConfig, precision: ZeroFabricPrecision,
                      device: torch.device, budget: Any) -> Optional[str]:
    """Stage 3's ``schedule="auto"`` at setup: what it would keep from the model states alone (the choice itself
    follows the second step, from the measured peak: [Note: choosing the gather schedule] in engine/schedule.py)."""
    import torch.distributed as dist

    from lzero.memory.estimate import EstimateError, auto_schedule, count_parameters

    free = budget.read(device)
    if free is None or "auto" in (config.param_persistence_threshold, config.prefetch_bucket_size):
        return None  # unknown memory, or sizes the engine fills from the hidden size
    group = config.shard_group_size
    world = dist.get_world_size() if dist.is_initialized() else 1
    sharded = world if group is None else (budget.processes if group == "node" else group)
    try:
        r = auto_schedule(count_parameters(module, config.unit_modules), sharded, free,
                          "bf16-mixed" if precision.policy.param_dtype is not None else "32-true", config=config)
    except EstimateError:
        return None
    return (f"lzero zero3 schedule auto: the first two steps run memory-minimal and measure the peak; then blocks stay"
            f" gathered as far as {free / 2**30:.2f} GiB less {config.schedule_margin:.0%} allows (from the model"
            f" states alone, without activations: {r['persistent_blocks']} of {r['blocks']} blocks persistent,"
            f" {r['kept_blocks']} kept across the turn, {r['gathers_per_step']} all-gathers per step instead of"
            f" {r['min_memory_gathers_per_step']}).")


def _with_pretrained(weights: Optional[Any], pretrained: Optional[Any]) -> Optional[Any]:
    """What a meta model's values are read from: ``weights`` (a checkpoint being loaded), its pretrained models' files
    otherwise; a checkpoint's replay of the construction reads the pretrained storages it needs from those files."""
    if weights is None:
        return pretrained
    if pretrained is not None and hasattr(weights, "take_storage_loads"):
        weights.take_storage_loads(pretrained)
    return weights


def pretrained_weights(model: torch.nn.Module) -> Optional[Any]:
    """The checkpoints of the pretrained models built by ``meta_device`` inside ``model``, if any."""
    if "lzero.hf.pretrained" not in sys.modules:
        return None
    from lzero.hf.pretrained import PretrainedWeights

    weights = PretrainedWeights(model)
    return weights if weights else None


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




def sync_module_states(module: torch.nn.Module, group: Any = None) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP's wrapper starts: for a run that starts no engine (stages
    1-2 evaluating). A collective. ``group``: over these ranks only (tensor parallel: the data-parallel group, each
    DTensor by its local tensor); None: every rank."""
    from lzero.engine.collectives import broadcast_coalesced_
    from lzero.engine.tensor_parallel import local

    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    states = {id(t): local(t).data for name, t in [*module.named_parameters(), *module.named_buffers()]
              if name not in ignored}
    with torch.no_grad():
        broadcast_coalesced_(list(states.values()), src=0, group=group, max_numel=2**26)  # packed 256 MB of fp32 at most


def choose_configuration(config: ZeroConfig, module: torch.nn.Module, precision: ZeroFabricPrecision,
                         world_size: int, num_processes: int, device: torch.device, budget_bytes: Optional[int],
                         margin: float) -> tuple[ZeroConfig, dict]:
    """``stage="auto"``: the configuration for this model and machine and the record of the choice, logged in one
    line on rank 0 (see [Note: choosing a stage] in auto.py)."""
    from lightning.fabric.utilities import rank_zero_info

    from lzero.memory import auto
    from lzero.memory.estimate import count_parameters

    mixed = precision.policy.param_dtype is not None
    config, record = auto.choose(config, count_parameters(module, config.unit_modules), world_size, num_processes,
                                 "bf16-mixed" if mixed else "32-true", device, budget_bytes, margin)
    rank_zero_info(auto.summary(record))
    return config, record


GENERATION_MODES = ("gathered", "streamed")


def named(value: Any) -> str:
    """A short name of a value for an error message: a module's class, not its printed tree."""
    return f"a {type(value).__name__}" if isinstance(value, torch.nn.Module) else repr(value)


def check_generation_arguments(module: Any, mode: Any, takes: str, example: str) -> None:
    """Both doors' ``strategy.generation(module, mode)`` refuses the same misuse alike, before anything runs:
    ``module`` that is not a module (a mode given as the first argument, most often), and an unknown ``mode``.
    ``takes``: the modules this door takes; ``example``: its call."""
    if module is not None and not isinstance(module, torch.nn.Module):
        raise ValueError(f"`strategy.generation(module=...)` takes {takes}, got {named(module)}. HINT: `{example}`;"
                         " the mode is a keyword argument: `generation(mode='streamed')`.")
    if mode not in GENERATION_MODES:
        raise ValueError(f"`generation(mode={mode!r})`: the modes are 'gathered' (every block on the device) and"
                         " 'streamed' (blocks copied from host memory per forward).")


@contextmanager
def generation(engine: Any, module: torch.nn.Module, mode: str, device: torch.device, budget_bytes: Optional[int],
               margin: float, num_processes: int) -> Generator:
    """Both doors' ``strategy.generation(module, mode)`` over ``engine`` (None, or no gatherer: nothing to do), its
    arguments checked by :func:`check_generation_arguments`. A collective on entry. See ``ZeroStrategy.generation``
    for the modes."""
    from lzero.engine.rank_memory import rank_budget_bytes

    if engine is None or engine.gatherer is None:
        yield
        return
    gatherer = engine.gatherer
    if mode == "gathered":
        need = sum(u.spec.padded_numel * u.flat_param.element_size() for name in gatherer.blocks
                   if name not in gatherer.gathered_names() for u in gatherer.blocks[name].units)
        where, free = device, rank_budget_bytes(device, budget_bytes, num_processes)
        hint = ("mode='streamed' (blocks copied from host memory per forward), or generate without the context"
                " (each block gathered per forward: one all-gather per block per token)")
    else:
        need = sum(u.spec.padded_numel * u.flat_param.element_size() for u in engine.units)
        where, free = "host memory", rank_budget_bytes(torch.device("cpu"), None, num_processes)
        hint = "generate without the context (each block gathered per forward: one all-gather per block per token)"
    if free is not None and need > (1 - margin) * free:
        raise RuntimeError(
            f"`strategy.generation(mode={mode!r})` holds the whole model on every rank: {need / 2**30:.2f} GiB more"
            f" in {where}, where {free / 2**30:.2f} GiB are free (x {1 - margin:g} margin). HINT:"
            f" {hint}; or raise memory_budget_bytes / lower memory_margin if the figure is too cautious.")
    held = gatherer.all_gathered() if mode == "gathered" else gatherer.streamed_from_host(pin=device.type == "cuda")
    with held, synced_generation(module, False):
        yield
