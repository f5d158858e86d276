"""The ZeRO engine: units of one model, their gradient hooks, the step and parameter gathers.

No Lightning here; the strategy is thin glue over this class. Reductions are reducer.py's.

[Note: stages]
Stage 1 reduces once per optimizer step: micro-batches accumulate into the full flat gradient
(autograd adds into ``p.grad`` views), and the reduction runs in the backward of the last
micro-batch (automatic optimization) or in ``optimizer.step()`` (manual optimization). Stage 2
reduces every micro-batch as soon as a unit's gradients are complete and frees them; the
reduced shards accumulate. Stage 3 reduces as stage 2 does and also shards the parameters: units
are module blocks (units.py) gathered on demand (gather.py); the optimizer steps the kept shards
and nothing is gathered after the step.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from lzero import auto_sizes
from lzero.engine import collectives, quantized_collectives
from lzero.config import ZeroConfig
from lzero.errors import ZeroEngineError
from lzero.engine.mixed_precision import PrecisionPolicy
from lzero.engine.flat_unit import FlatUnit, GradState, fill_from_gathered, shard_bytes
from lzero.engine import ownership, packed_weights, parameters, recording, replayed_weights, tensor_parallel
from lzero.engine.frozen_base import FrozenBase, WholeBase
from lzero.engine.blocks import Block, GatherSchedule
from lzero.engine.delayed_update import DelayedUpdate
from lzero.engine.gather import Gatherer, full_graphs_around
from lzero.engine.mesh import Mesh
from lzero.engine.materialize import (InitFn, Materializer, WeightSource, apply_order, buffers_to, common_seed, has_meta,
                               read_whole, shard_values)
from lzero.engine.partition import FROZEN, Partition, ParamSpec, UnitSpec, partition_by_label, partition_by_size
from lzero.engine.reducer import Reducer
from lzero.engine.schedule import AutoSchedule, MemoryBudget
from lzero.engine.hpz import SecondaryPartition
from lzero.offload.placement import stores_for
from lzero.offload.store import ShardStore
from lzero.engine.units import ROOT, find_blocks, label_parameters


class PendingGather(NamedTuple):
    """A launched all-gather of stepped shards (stages 1-2), to finish before the next forward."""

    handle: collectives.Handle
    bucket: list[FlatUnit]
    out: Optional[Tensor]  # 1D, every rank's shards of ``bucket`` concatenated; None: gathered in place (one unit)


class Round(NamedTuple):
    """[Note: backward rounds]
    A backward that accumulates into the units' parameters is a round: the first gradient (stage 3: the first block
    hook of such a backward) opens it, a callback queued on autograd's engine closes it at the end of that backward.
    What the round does is decided once, when it opens, from the config and the strategy's settings then; between
    rounds (``engine.round is None``) no backward runs, and clearing a gradient first waits for the reductions in
    flight."""

    reduce: bool  # reduce in this backward: stage >= 2 always, stage 1 only on the last micro-batch (automatic)
    launch_in_hooks: bool  # launch reductions as gradients arrive; else all wait for the end of backward

    @classmethod
    def of(cls, config: ZeroConfig, sync: bool, automatic: bool) -> "Round":
        reduce = config.stage >= 2 or (sync and automatic)
        # without overlap every reduction waits at the end of backward (see Reducer.launch_ready_in_order)
        return cls(reduce, reduce and config.overlap_comm)


class ZeroEngine:
    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], config: ZeroConfig,
                 policy: Optional[PrecisionPolicy] = None, group: Optional[dist.ProcessGroup] = None,
                 device: torch.device = torch.device("cpu"), init_fn: Optional[InitFn] = None,
                 weights: Optional[WeightSource] = None, evaluating: bool = False,
                 mesh: Optional[Mesh] = None, memory_budget: Optional[MemoryBudget] = None) -> None:
        """``evaluating``: validate/test/predict, no optimizer: every parameter that requires gradients goes into
        one group, sharded and gathered as while training (stage 3: the shards, their masters, and each block
        gathered for its forward only). ``mesh``: the run's process groups (hybrid sharding's shard and replica
        groups among them; see [Note: the mesh] in mesh.py); None: one made here from ``config`` over ``group`` (None:
        the default group). ``memory_budget``: what ``schedule="auto"`` fits the stage-3
        gather schedule into (default: what the machine has; see [Note: choosing the gather schedule] in
        schedule.py). An error part way leaves the module as [Note: a setup that stops part way] says."""
        try:
            if mesh is None:
                mesh = Mesh.of(config.shard_group_size, config.hpz_partition_size, base=group)
            self._build(module, optimizers, config, policy, device, init_fn, weights, evaluating, mesh)
            self.auto_schedule: Optional[AutoSchedule] = None
            if self.gatherer is not None and config.schedule == "auto" and not evaluating:
                self.auto_schedule = AutoSchedule(config, device, memory_budget or MemoryBudget(), self.everyone)
        except BaseException:
            self.abandon(module)
            raise

    def abandon(self, module: nn.Module) -> None:
        """[Note: a setup that stops part way]
        When the engine's setup (or the strategy's, right after it) raises, the error is the user's to read, so
        nothing after it may raise another: the hooks come off, the stores close, and the parameters already
        released to their shards become meta parameters of their shapes (``drop_released``): their values live
        in shards across the ranks, which no collective may gather now (another rank may be elsewhere), and
        Lightning's teardown moves nothing of a meta model, where a released parameter would refuse its ``.cpu()``
        and print that error last. Process groups are left alone, as after a failed step (see [Note: teardown after
        a failure] in lightning/trainer_strategy.py). Safe on a half-built engine and on a whole one."""
        parameters.drop_released(module)
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        if hasattr(self, "_where"):
            parameters.unwatch(self._where, self._on_module_zero_grad)
        if getattr(self, "gatherer", None) is not None:
            self.gatherer.remove()
        for store in getattr(self, "stores", []):
            try:
                store.close()
            except Exception:  # noqa: BLE001 - the error that stopped the setup is the one to raise
                pass

    def _build(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], config: ZeroConfig,
               policy: Optional[PrecisionPolicy], device: torch.device, init_fn: Optional[InitFn],
               weights: Optional[WeightSource], evaluating: bool, mesh: Mesh) -> None:
        settled = recording.settle(module)  # a model still holding fake tensors: [Note: a fake device] in recording.py
        for optimizer in optimizers if settled else ():
            for group_ in optimizer.param_groups:
                group_["params"] = [settled.get(id(p), p) for p in group_["params"]]
        config, _ = auto_sizes.fill(config, module)  # "auto" sizes (the strategy has filled them already)
        self.config = config
        self.policy = policy if policy is not None else PrecisionPolicy()
        self.mesh = mesh
        self.everyone = mesh.group("world")  # what spans every rank that must agree (every replica of every shard)
        self.group = mesh.group("shard")
        self.replicas: Optional[dist.ProcessGroup] = mesh.group("replicate")  # this rank's shard's holders, hybrid
        # tensor parallel: DTensor parameters, flattened by their local tensors ([Note: tensor parallel under ZeRO])
        self.tensor_group = mesh.tensor
        # pipeline parallel: the step's agreements span the stages ([Note: pipeline parallel under ZeRO] in pipeline.py)
        self.pipeline_group = mesh.pipeline
        self.pipeline_stages: tuple[int, ...] = ()  # the stages this rank runs (set by the door that cut the model)
        self.ties: list[nn.Parameter] = []  # parameters another stage holds too, their gradients summed at the step
        self.tie_group: Any = None  # the ranks of the stages holding them (``tie_across_stages``)
        self.ties_pending = False  # a schedule ran since the last sum of the ties' gradients
        # on the last stage, its tied parameters to their names on the first stage, whose copies the global norm counts
        # and checkpoints write
        self.tie_aliases: dict[str, str] = {}
        self.hold_grads = False  # a pipeline's step ran its backwards before Lightning clears gradients: keep them
        tensor_parallel.check_parameters(module, mesh.tensor)
        group = self.group
        self.world_size = collectives.world_size(group)
        self.rank = collectives.rank(group)
        kept = self.policy.kept_parameters(module)
        packed_weights.check_model(module)
        self._owners = packed_weights.owners(module)  # the modules of packed (quantized) parameters
        specs, by_name = _collect_params(module, optimizers, kept, frozen_too=config.stage >= 3, evaluating=evaluating)
        # tensor-sharded parameters: where the local tensors lie ([Note: tensor-parallel checkpoints])
        self.tensor_layouts = tensor_parallel.layouts(by_name)
        self.tensor_rank = collectives.rank(mesh.tensor) if mesh.tensor is not None else 0
        specs = [replace(s, whole=self.tensor_layouts[s.name], tensor_rank=self.tensor_rank)
                 if s.name in self.tensor_layouts else s for s in specs]
        # param groups laid out by owner: [Note: per-tensor ownership] in partition.py
        whole = ownership.per_tensor_groups(optimizers, config.optimizer_partition)
        _refuse_cut_whole_tensors(specs, whole)
        if config.stage >= 3:
            block_modules = find_blocks(module, config.unit_modules)
            _refuse_full_graphs(module, block_modules)
            labels = label_parameters(module, block_modules)
            self.partition: Partition = partition_by_label(specs, self.world_size, labels,
                                                           per_param=config.find_unused_parameters, per_tensor=whole)
        else:  # one parameter per unit when unused parameters must not be stepped (see ZeroConfig)
            unit_numel = 1 if config.find_unused_parameters else config.reduce_bucket_size
            self.partition = partition_by_size(specs, self.world_size, unit_numel, per_tensor=whole,
                                               per_tensor_numel=1 if config.find_unused_parameters else None)
        # where each unit's state lives: see [Note: shard stores] in store.py
        self._stores, self._param_store = stores_for(config, device,
                                                     [0 if u.frozen else u.padded_numel for u in self.partition.units],
                                                     self.rank, self.world_size, self._run_id(config))
        self.stores: list[ShardStore] = []  # the distinct stores the units keep state in
        for store in [*self._stores, self._param_store]:
            if not any(store is s for s in self.stores):
                self.stores.append(store)
        self.offloaded = any(store.name != "device" for store in self.stores)  # some unit keeps state in host memory
        self._cast_back: list[tuple[nn.Parameter, torch.dtype]] = []  # frozen parameters cast to param_dtype
        self.policy.check_module(module)
        if config.stage >= 3 and has_meta(module):
            with recording.as_built(module):  # [Note: the construction's default dtype] in recording.py
                self.units = self._materialize_by_unit(module, optimizers, block_modules, labels, device, init_fn,
                                                       weights)
        else:
            self._broadcast_initial_state(module)  # before the units take (fp32 master) copies
            self.units = [self._unit(spec, [by_name[p.name] for p in spec.params]) for spec in self.partition.units]
            self._cast_back = self.policy.cast_outside_units(module, {p for u in self.units for p in u.params}, kept)
        self._where: dict[nn.Parameter, tuple[FlatUnit, int]] = {
            p: (unit, i) for unit in self.units for i, p in enumerate(unit.params)
        }
        # the frozen parameters a checkpoint may read back from their pretrained files instead of holding them
        # ([Note: a checkpoint without its frozen base] in lzero/checkpoint/base_files.py)
        self.frozen_base: Optional[FrozenBase] = FrozenBase(self.units, weights, group) \
            if hasattr(weights, "base_tensor") and config.stage >= 3 and not config.save_frozen else None
        # the same for frozen parameters outside every unit, found by the doors: state key -> where the files hold
        # it ([Note: an eager model's frozen base] in lzero/hf/eager_base.py)
        self.outside_base: dict[str, WholeBase] = {}
        # whole on every rank, outside every unit: the frozen parameters at stages 1-2 (a frozen reference model, a
        # LoRA or QLoRA base), at stage 3 those of other dtypes; model states all the same (lzero/memory/accounting.py)
        self.outside: list[nn.Parameter] = [p for p in module.parameters() if p not in self._where]
        self._packed = [(n, p) for n, p in module.named_parameters() if packed_weights.is_packed(p)]  # quantized codes
        self._buffers = [b for b in module.buffers()]
        self._sync_buffers_next = True
        self.gatherer: Optional[Gatherer] = None
        if config.stage >= 3:
            self.gatherer = self._shard_parameters(block_modules, labels)
        self.reducer = Reducer(self.units, config, group, self.world_size, self.replicas, mesh.replicas,
                               mesh.group("flags"))
        # stage 3: a block's gradients are collected once its backward is done (one hook call per block, see
        # [Note: one backward hook per block] in gather.py); other parameters report their own
        in_blocks = set() if self.gatherer is None else {
            id(u) for name, block in self.gatherer.blocks.items() if name != ROOT for u in block.units}
        self._block_units = [u for u in self.units if id(u) in in_blocks]  # their gradients: _on_block_backward
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p, (unit, _) in self._where.items()
                       if not unit.spec.frozen and id(unit) not in in_blocks]
        parameters.watch(self._where, self._on_grad_cleared, self._on_module_zero_grad)  # [Note: clearing gradients]
        # offload_optimizer.delayed_update: the host step runs on a worker thread during the next step
        self.delayed: Optional[DelayedUpdate] = \
            DelayedUpdate(self.resident) if config.offload_optimizer.delayed_update else None
        # the strategy's settings of the step: set from outside, read when a backward opens its round
        self.sync = True  # False inside Lightning's block_backward_sync (accumulating micro-batches)
        self.automatic = True  # Lightning's automatic optimization
        self.round: Optional[Round] = None  # the backward running now, if it accumulates: see [Note: backward rounds]
        self._task: tuple[int, bool] = (-1, False)  # (graph task id, whether it accumulates): see accumulating()
        # a weight-averaging callback's average, as sharded as the masters (an ``AveragedShards``, which the Lightning
        # side makes over this engine and sets here): see [Note: averaged shards] in averaged.py
        self.average: Optional[Any] = None

    # --- setup -------------------------------------------------------------------------------

    def _run_id(self, config: ZeroConfig) -> Optional[str]:
        """NVMe offload: one id for this run's swap folder, the same on every rank (rank 0's). A collective."""
        if config.offload_optimizer.device != "nvme" and config.offload_param.device != "nvme":
            return None
        from lzero.offload.nvme import new_run_id  # time and a random uuid: unrelated to the (seeded) torch RNG

        token = torch.zeros(64, dtype=torch.uint8)
        if self.rank == 0:
            mine = new_run_id().encode()
            token[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
        collectives.broadcast_([token], src=0, group=self.group)
        return bytes(token[token != 0].tolist()).decode()

    def _unit(self, spec: UnitSpec, params: list[nn.Parameter], values: Optional[Tensor] = None,
              bind: bool = True) -> FlatUnit:
        """``bind=False``: a packed unit whose quantization state is whole only once every unit is read (quantized on
        read: ``_materialize_by_unit`` binds it then)."""
        store = self._stores[spec.index] if not spec.frozen else self._param_store
        # packed codes keep their storage dtype: no policy casts them (see [Note: packed parameters])
        dtypes = self.policy.unit_dtypes(spec.keep_fp32) if not spec.storage else {}
        bindings = self._bindings(params) if spec.storage and bind else None
        return FlatUnit(spec, params, self.rank, self.config.stage, store=store, param_store=self._param_store,
                        values=values, bindings=bindings, **dtypes)

    def _bindings(self, params: Sequence[nn.Parameter]) -> list[packed_weights.Binding]:
        return [packed_weights.Binding(p, self._owners.get(id(p))) for p in params]

    def _materialize_by_unit(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                             block_modules: dict[str, nn.Module], labels: dict[str, str], device: torch.device,
                             init_fn: Optional[InitFn], weights: Optional[WeightSource]) -> list[FlatUnit]:
        """Stage 3 from the meta device: one block of full parameters at a time, the same RNG on every
        rank, each rank keeping its shard. See [Note: meta-device initialization] in materialize.py.
        Tensors ``weights`` holds are not initialized: each rank reads its own pieces of them into its shards
        ([Note: reading a pretrained checkpoint into shards] in hf/weights.py), and tensors outside every
        unit whole."""
        if init_fn is None and (weights is None or getattr(weights, "over_replay", False)):
            weights = self._replayed(module, device, weights)  # eager's draws: [Note: replayed construction]
        loaded = frozenset(id(t) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                *module.named_buffers(remove_duplicate=False)]
                           if weights is not None and weights.holds(name))
        materializer = Materializer(module, device, init_fn, loaded)
        # block-wise initialization draws from one seed on every rank (a replay or a checkpoint draws nothing here)
        seed = common_seed(lambda t: collectives.broadcast_([t], src=0, group=self.everyone)) if weights is None else 0
        order = apply_order(module)
        in_block = {id(m): label for label, block in block_modules.items() for m in block.modules()}
        inside = {label: [(n, m) for n, m in order if in_block.get(id(m), ROOT) == label]
                  for label in [*block_modules, ROOT]}
        units, done = [], set()

        def run_up_to(label: str) -> None:
            # the root last of all: it holds the blocks' ancestors and the parameters tied across blocks,
            # which blocks without a unit of their own (frozen, or only tied parameters) initialize too
            for other in ([label] if label != ROOT else inside):
                if other not in done:
                    materializer.run(inside[other])
                    done.add(other)

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for spec in self.partition.units:  # block units, then the root's (see partition_by_label)
                run_up_to(labels[spec.params[0].name])
                params = [module.get_parameter(p.name) for p in spec.params]
                # the shard read is the unit's own memory: no name keeps it past the unit (the root's is the largest)
                unit = self._unit(spec, params, None if weights is None else
                                  shard_values(spec, self.rank, params, device, weights), bind=weights is None)
                unit.release()
                units.append(unit)
            run_up_to(ROOT)  # frozen parameters and buffers outside every unit
        if weights is not None:  # tensors outside the units (persistent buffers, other dtypes): read whole
            in_units = {id(p) for unit in units for p in unit.params}
            read_whole(module, weights, lambda t: id(t) not in in_units)
            weights.finish(module, lambda t: collectives.all_reduce(t, dist.ReduceOp.MAX, self.group), device)
            self._owners = packed_weights.owners(module)  # of the materialized parameters
            for unit in units:
                if unit.spec.storage:  # quantized on read: the state is whole now ([Note: quantize on read])
                    unit.bindings = self._bindings(unit.params)
        buffers_to(module, device)  # built on the CPU from a pretrained model (hf/pretrained.py)
        materializer.retarget(optimizers)
        return units

    def _replayed(self, module: nn.Module, device: torch.device, loaded: Optional[WeightSource] = None
                  ) -> Optional[WeightSource]:
        """The model's recorded construction replayed, this rank keeping its pieces (under what ``loaded`` holds);
        None, with a warning, when the record does not cover the model (then block-wise initialization draws other
        numbers than eager); ``loaded`` alone when no record covers it and it was given."""
        source, why = replayed_weights.from_replay(module, self.partition.units, self.rank, device,
                                                   lambda t: collectives.broadcast_([t], src=0, group=self.everyone),
                                                   loaded)
        if source is not None:
            return source
        what = "what the files do not hold" if loaded is not None else "this meta-device model"
        message = (f"lzero initializes {what} block by block: {why}, so its random draws differ from the same code"
                   " run eagerly (under DDP). HINT: build the whole model inside `configure_model` or"
                   " `trainer.init_module(empty_init=True)`, or pass `init_fn`.")
        if self.config.exact_init:
            raise ZeroEngineError(message + " (`exact_init: true` makes this an error; set it to false to go on with"
                                            " other draws.)")
        _warn_once(message)
        return loaded

    def _broadcast_initial_state(self, module: nn.Module) -> None:
        """Rank 0's parameters and buffers everywhere, as DDP does, so unseeded models agree."""
        tensors = [tensor_parallel.local(p).detach() for p in module.parameters()] + [b for b in module.buffers()]
        collectives.broadcast_coalesced_(tensors, src=0, group=self.everyone, max_numel=self.config.reduce_bucket_size)

    def _shard_parameters(self, block_modules: dict[str, nn.Module], labels: dict[str, str]) -> Gatherer:
        """Stage 3: keep only the owned shards and hook the blocks. See [Note: stage-3 parameter lifecycle]."""
        for unit in self.units:
            if unit.gathered:  # units materialized from the meta device keep only their shard already
                unit.release()
        members: dict[str, list[FlatUnit]] = {ROOT: []}
        for unit in self.units:
            members.setdefault(labels[unit.spec.params[0].name], []).append(unit)
        blocks = {name: Block(name, units) for name, units in members.items()}
        modules = {name: block_modules[name] for name in blocks if name != ROOT}
        # Parameter gathers follow forward/backward order, reductions follow unit order and are
        # launched when ready: on one process group their interleaving would differ between ranks.
        self._gather_group = self.mesh.group("gather")  # a group of one: the shard group (local copies)
        timeout_s = self.config.unit_order_timeout_s
        self._check_group = self.mesh.group("unit_order", timeout_s) if timeout_s > 0 else None
        return Gatherer(blocks, modules, self._gather_group, GatherSchedule.of(self.config), self._check_group,
                        self.config.unit_order_timeout_s, on_backward=self._on_block_backward,
                        accumulating=self.accumulating, all_gather=self._param_all_gather,
                        secondary=self._secondary_partition(blocks))

    def _secondary_partition(self, blocks: dict[str, Block]) -> Optional[SecondaryPartition]:
        """hpZ's node-local copies of every block but the root: [Note: hpZ] in hpz.py. A collective."""
        if self.mesh.hpz_size == 1:  # off, or one node: the primary gather is the node's already
            return None
        units = [u for name, block in blocks.items() if name != ROOT for u in block.units]
        return SecondaryPartition(units, self.mesh.group("hpz"), self.mesh.hpz_size, self.mesh.hpz_rank)

    def gather_root(self) -> None:
        """Stage 3: the root unit stays gathered from the start of a step to the end of its backward."""
        if self.gatherer is not None:
            if self.auto_schedule is not None:
                self.auto_schedule.start()
            self.gatherer.begin_step()
            self.gatherer.gather(ROOT)

    def release_all(self) -> None:
        if self.gatherer is not None:
            self.gatherer.release_all()

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale of the current backward; reductions divide it out."""
        return self.reducer.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.reducer.loss_scale = value

    @property
    def mixed(self) -> bool:
        """16-bit working parameters with fp32 masters."""
        return any(u.mixed for u in self.units)

    @contextmanager
    def resident(self, units: Sequence[FlatUnit], write: bool = False) -> Iterator[None]:
        """The masters and optimizer state of ``units`` in memory inside the block (see ``ShardStore.resident``)."""
        with contextlib.ExitStack() as stack:
            for unit in units:
                stack.enter_context(unit.resident(write))
            yield

    @contextmanager
    def gathered(self, module: nn.Module) -> Iterator[None]:
        """Full parameters of ``module`` inside the block; writes are carried back to the shards.
        Stage 3 only gathers (stages 1-2 hold full parameters already). A collective: every rank
        enters it for the same module, and should write the same values."""
        wanted = {id(p) for p in module.parameters()}
        with self.gathered_units([u for u in self.units if any(id(p) in wanted for p in u.params)], write_back=True):
            yield

    @contextmanager
    def gathered_units(self, units: Sequence[FlatUnit], write_back: bool = False) -> Iterator[None]:
        """Stage 3: the blocks holding ``units`` gathered inside the block and released after (unless
        they were gathered before). With ``write_back`` the full values are carried back into the
        shards (and masters); readers leave the masters untouched, which under bf16-mixed matters:
        copying the bf16 values back would round the fp32 masters."""
        if self.gatherer is None:
            yield
            return
        names = []
        for unit in units:
            block = self.gatherer.block_of(unit)
            if block is not None and block.name not in names:
                names.append(block.name)
        already = set(self.gatherer.gathered_names())
        for name in names:
            if write_back and self.config.quantized_weights:  # written back: the exact values, not qwZ's rounding
                self.gatherer.gather_exact(name)
            else:
                self.gatherer.gather(name)
        try:
            yield
        finally:
            with torch.no_grad():
                for name in names:
                    if write_back:
                        for unit in self.gatherer.blocks[name].units:
                            unit.keep_written_values()
                    if name not in already:
                        self.gatherer.release(name)

    def restore_frozen_dtypes(self) -> None:
        """Frozen parameters cast to the compute dtype at setup return to their own dtype (end of fit)."""
        for p, dtype in self._cast_back:
            p.data = p.data.to(dtype)

    def outside_units(self) -> list[tuple[nn.Parameter, packed_weights.Whole]]:
        """The parameters no unit holds (``outside``), each with what it keeps beside itself (a quantization state)."""
        return [(p, packed_weights.left_whole(p, self._owners.get(id(p)))) for p in self.outside]

    @torch.no_grad()
    def unshard(self) -> None:
        """Stage 3, at the end of fit: every parameter becomes a full standalone tensor again."""
        self.flush_delayed_update()
        if self.gatherer is None:
            return
        for name, block in self.gatherer.blocks.items():
            self.gatherer.gather(name)
            for unit in block.units:
                unit.hand_back()
            self.gatherer.release(name)

    def before_forward(self) -> None:
        """Rank 0's buffers (BatchNorm running stats...) everywhere, exactly when DDP would sync them:
        before a forward that follows a forward run with gradients enabled and gradient sync on."""
        if self._packed:  # a quantized base: its codes must stay frozen
            packed_weights.check_still_frozen(self._packed)
        if self.config.broadcast_buffers and self._sync_buffers_next:
            collectives.broadcast_coalesced_(self._buffers, src=0, group=self.everyone)
        self._sync_buffers_next = torch.is_grad_enabled() and self.sync

    def units_of(self, optimizer_index: int) -> list[FlatUnit]:
        return [u for u in self.units if u.spec.group[0] == optimizer_index]

    def remove(self, after_failure: bool = False) -> None:
        """Detach from the module: hooks removed, side process groups destroyed. ``after_failure``: wait for
        nothing and leave the process groups alone, since other ranks may never join a collective again
        (see [Note: teardown after a failure] in lightning/trainer_strategy.py)."""
        if not after_failure:
            self.wait()
        if self.delayed is not None:  # a step still in flight is waited for (the strategy flushed it at fit's end)
            self.delayed.close(after_failure)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        parameters.unwatch(self._where, self._on_module_zero_grad)
        if self.gatherer is not None:
            # after a failure, a prefetch still in flight on the gather group may wait for a rank that is gone:
            # that group is left alive then; the check group runs synchronous collectives only
            pending = after_failure and self.gatherer.gathers_in_flight()
            self.mesh.destroy(*(("unit_order",) if pending else ("gather", "unit_order")))
            self.gatherer.remove()
            self._gather_group = self._check_group = None
        self.reducer.remove(after_failure)
        self.mesh.destroy("flags")  # left alive, a failed fit's groups could abort the process at exit
        for store in self.stores:  # NVMe: the swap folder goes, after a failure too
            store.close()

    # --- backward ----------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate locally: stage 1 defers its reduction to the last micro-batch."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        unit, index = self._where[param]
        self._complete_grad(param)
        if self.round is None:
            self._open_round()
        if unit.grad_state is GradState.REDUCED and unit.accumulates_locally:
            raise ZeroEngineError(
                f"A gradient for `{unit.spec.params[index].name}` arrived after its unit was reduced for this"
                " step. HINT: call `optimizer.zero_grad()` after `optimizer.step()`, and under manual"
                " optimization call `optimizer.step()` only after the last backward of the step."
            )
        unit.grad_arrived(index)
        if self.round.launch_in_hooks:
            self.reducer.launch_ready_in_order()

    def _arrived(self, unit: FlatUnit) -> None:
        """Stage 3: count the gradients ``unit``'s parameters hold (partial ones summed over the tensor group first)."""
        for i in unit.arrivals():
            self._complete_grad(unit.params[i])
            unit.grad_arrived(i)

    def _complete_grad(self, param: nn.Parameter) -> None:
        """Under tensor parallel, a partial gradient summed over the tensor group, before any data-parallel use."""
        if self.tensor_group is not None:
            parameters.set_grad_quietly(param, tensor_parallel.complete_grad(parameters.raw_grad(param), param))

    def _on_block_backward(self, block: Block, done: bool) -> None:
        """Stage 3: a backward hook of ``block`` runs. The first one in a backward that accumulates into parameters
        (:meth:`accumulating`) opens the round. ``done``: the block's backward is over, so its parameters' gradients are final:
        each one present counts as arrived (one without stays waiting, as a skipped parameter would, until the end
        of backward). See [Note: one backward hook per block] in gather.py."""
        if self.round is None:
            if not self.accumulating():
                return
            self._open_round()
        if not done:
            return
        for unit in block.units:
            self._arrived(unit)
        if self.round.launch_in_hooks:
            self.reducer.launch_ready_in_order()

    def accumulating(self) -> bool:
        """Inside backward: whether the running backward accumulates into some trainable parameter (a
        ``backward()``, not a ``torch.autograd.grad`` call, which leaves ``.grad`` alone). Asked of autograd once per
        backward (``_will_engine_execute_node`` on an AccumulateGrad node of each unit until one says yes)."""
        task = torch._C._current_graph_task_id()
        if task != self._task[0]:
            found = False
            with parameters.quiet_params():  # a released parameter answers these without its guard
                for unit in self.units:
                    p = next((p for p in unit.params if p.requires_grad), None) if not unit.spec.frozen else None
                    if p is not None and torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                        found = True
                        break
            self._task = (task, found)
        return self._task[1]

    def close_pinned_backward(self) -> None:
        """Stage 3 with every block pinned (a pipeline's schedule: [Note: pipeline parallel under ZeRO] in
        pipeline.py): a backward that no parameter hook opened a round for (a stage of blocks only; the blocks' hooks
        are off while pinned) is closed here, after it, as autograd's callback closes the others: its blocks'
        gradients counted and reduced."""
        if self.round is not None or self.gatherer is None:
            return
        with parameters.quiet_params():
            pending = any(p.requires_grad and parameters.raw_grad(p) is not None
                          for unit in self._block_units for p in unit.params)
        if pending:
            self._open_round(by_autograd=False)
            self._close_round()

    def _open_round(self, by_autograd: bool = True) -> None:
        self.round = Round.of(self.config, self.sync, self.automatic)
        self.reducer.begin_backward()
        for u in self.units:
            u.begin_backward()
            if u.accumulates_locally:
                u.prelink()  # stage 1: autograd accumulates straight into the flat gradient
            if u.spec.frozen and u.trainable:
                name = u.spec.params[u.trainable[0]].name
                raise ZeroEngineError(
                    f"`{name}` did not require gradients when training started, so ZeRO-3 sharded it as a frozen"
                    " parameter (no gradient, no optimizer state); it requires them now. HINT: set `requires_grad`"
                    " before `fit` (and give the parameter to the optimizer), or use zero2 to unfreeze during training."
                )
        if by_autograd:
            torch.autograd.Variable._execution_engine.queue_callback(self._close_round)

    def _close_round(self) -> None:
        try:
            for unit in self.units:
                if unit.accumulates_locally:
                    unit.end_backward()
            if self.gatherer is not None:  # blocks no input hook reported (inputs without gradients)
                for unit in self._block_units:
                    self._arrived(unit)
            if self.round.reduce:
                self.reducer.reduce_remaining(self.units)
        finally:
            self.round = None
            if self.gatherer is not None:
                self.gatherer.end_backward()
            self.release_all()

    def wait(self) -> None:
        """Block until every launched reduction has landed in its shard (offloaded: in host memory)."""
        self.reducer.wait()
        for store in self.stores:
            store.finish()


    def prepare_step(self, units: Sequence[FlatUnit]) -> None:
        """Make the shard gradients of ``units`` final. A collective: every rank calls it."""
        if self.config.stage == 1 and not self.automatic:
            self.reducer.reduce_remaining(units)
        self.wait()
        if self.ties_pending:
            self.ties_pending = False
            self._sum_ties()

    def tie_across_stages(self, names: Sequence[str], group: Any, first_names: Optional[Sequence[str]]) -> None:
        """Pipeline parallel: the parameters ``names`` are held by another stage too (embeddings tied to the head):
        their gradients are summed over ``group`` (the ranks of both stages) before each step, so both copies take the
        same step. ``first_names``: on the last stage, each one's name on the first stage, whose copy counts in the
        global norm and is the one checkpoints write (None on the first stage)."""
        by_name = {spec.name: p for unit in self.units for spec, p in zip(unit.spec.params, unit.params)}
        self.ties, self.tie_group = [by_name[n] for n in names], group
        if first_names is not None:
            self.tie_aliases = dict(zip(names, first_names))

    @torch.no_grad()
    def _sum_ties(self) -> None:
        """Each tied parameter's reduced gradient summed across the stages holding it: its pieces in this rank's
        shard laid into a whole-size buffer, one all-reduce over both stages' data ranks (whose pieces are
        disjoint within a stage), the sum's pieces copied back. A collective of the tie group."""
        for param in self.ties:
            unit, index = self._where[param]
            spec = unit.spec.params[index]
            pieces = [(start, end, at) for p, start, end, at in unit.spec.owned_pieces(self.rank)
                      if p.name == spec.name]
            whole = torch.zeros(spec.numel, dtype=torch.float32, device=unit.flat_param.device)
            if unit.has_step_grad:
                for start, end, at in pieces:
                    whole[start:end] = unit.shard_grad[at : at + end - start].to(whole.device, whole.dtype)
            collectives.all_reduce(whole, group=self.tie_group)
            if unit.has_step_grad:
                for start, end, at in pieces:
                    unit.shard_grad[at : at + end - start].copy_(whole[start:end])

    def release_grads(self, units: Sequence[FlatUnit]) -> None:
        """After a skipped step: free the gradients, as a step would have. See [Note: gradient buffers]."""
        self.wait()
        for unit in units:
            unit.release_grads()

    def zero_grad(self, units: Sequence[FlatUnit], set_to_none: bool = True) -> None:
        if self.hold_grads:  # see [Note: pipeline steps under the Trainer] in lzero/lightning/trainer_pipeline.py
            return
        self.wait()
        for unit in units:
            unit.zero_grad(set_to_none)

    def _on_grad_cleared(self, param: nn.Parameter) -> None:
        """Someone set ``param.grad = None``: drop its part of the gradients. See [Note: clearing gradients]."""
        unit, index = self._where[param]
        if self.round is None:
            self.wait()
        unit.clear_grad(index)

    def _on_module_zero_grad(self, module: nn.Module, set_to_none: bool) -> None:
        """``module.zero_grad(set_to_none)`` ran on some module: clear the shard gradients of its parameters.
        See [Note: clearing gradients]."""
        if self.hold_grads:
            return
        touched: dict[FlatUnit, list[int]] = {}
        for p in module.parameters():
            if p in self._where:
                unit, index = self._where[p]
                touched.setdefault(unit, []).append(index)
        if touched and self.round is None:
            self.wait()
        for unit, indices in touched.items():
            if set(indices) >= set(unit.trainable):
                unit.zero_grad(set_to_none)
            else:
                for index in indices:
                    unit.clear_grad(index, set_to_none)

    @torch.no_grad()
    def found_nonfinite(self, units: Sequence[FlatUnit]) -> bool:
        """Whether any rank holds an inf/NaN in the reduced gradients of ``units``: one all-reduce of one
        flag, so every rank takes the same decision. A collective.

        Checked on the sum of the gradients, as DeepSpeed does: an inf or NaN anywhere makes the sum
        inf or NaN, and one summing pass costs a small fraction of an elementwise ``isfinite`` (see
        benchmarks/README.md, step time). Finite gradients large enough for their sum
        to overflow fp32 are reported too, which only skips a step that was about to explode."""
        self.prepare_step(units)
        total = self._sum_over(units, "sum")
        found = self.reducer.any_rank((~torch.isfinite(total)).float())
        if self.pipeline_group is None:
            return found
        flag = torch.tensor(float(found), device=total.device)  # every stage skips, or none
        collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pipeline_group)
        return bool(flag.item())

    # --- gradient norm and clipping ----------------------------------------------------------

    @torch.no_grad()
    def grad_norm(self, units: Sequence[FlatUnit]) -> Tensor:
        """Global L2 norm (fp32) of the reduced gradients of ``units``: one all-reduce. A collective.

        The squares are summed in fp64: shards split the gradients differently at each stage, world size and layout,
        and fp32 partial sums would round differently with each split (a 1-ulp different norm, and so different
        clipped weights, for a run resumed at another stage); in fp64 the splits' rounding stays far below fp32's."""
        self.prepare_step(units)
        if self.tensor_group is not None or self.pipeline_group is not None:
            return self._split_norm(units)
        total = self._sum_over(units, "sq_norm", dtype=torch.float64)
        return collectives.all_reduce(total, group=self.group).sqrt().float()

    def tensor_sharded(self, name: str) -> bool:
        """Whether the parameter ``name`` (its name in the partition) is a tensor-parallel shard: see
        [Note: tensor parallel under ZeRO] in tensor_parallel.py."""
        return name in self.tensor_layouts

    def _split_norm(self, units: Sequence[FlatUnit]) -> Tensor:
        """:meth:`grad_norm` under tensor or pipeline parallel: the squares of each piece summed over the data group,
        then over the pipeline group (each stage its own parameters; a tied one counted on one stage); those of the
        tensor-sharded parameters over the tensor group too, the replicated ones not, since every rank of a tensor
        group holds the same ([Note: tensor parallel under ZeRO] in tensor_parallel.py)."""
        device = units[0].flat_param.device if units else None
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # (tensor-sharded, tensor-replicated)
        for unit in units:
            if unit.has_step_grad:
                for param, start, end, at in unit.spec.owned_pieces(self.rank):
                    if param.name in self.tie_aliases:  # counted on the first stage
                        continue
                    piece = unit.shard_grad[at : at + end - start]
                    sharded = self.tensor_sharded(param.name)
                    sums[0 if sharded else 1] += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
        collectives.all_reduce(sums, group=self.group)
        if self.pipeline_group is not None:
            collectives.all_reduce(sums, group=self.pipeline_group)
        sharded = sums[:1] if self.tensor_group is None else \
            collectives.all_reduce(sums[:1].clone(), group=self.tensor_group)
        return (sharded[0] + sums[1]).sqrt().float()

    def _sum_over(self, units: Sequence[FlatUnit], which: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """The sum (in ``dtype``) of each shard gradient's ``GRAD_STATS[which]`` over ``units`` that have one, on the
        compute device. Terms are summed where they were computed (no device sync per unit): an offloaded gradient's
        on the device before it was copied off, so the host never rereads gradients for them; host partial sums join
        at the end."""
        device = units[0].flat_param.device if units else None
        totals: dict[torch.device, Tensor] = {}
        for unit in units:
            if unit.has_step_grad:
                term = unit.grad_stat(which)
                where = term.device
                if where not in totals:
                    totals[where] = torch.zeros((), dtype=dtype, device=where)
                totals[where] += term
        total = torch.zeros((), dtype=dtype, device=device)
        for part in totals.values():
            total += part.to(device)
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, units: Sequence[FlatUnit], max_norm: float) -> Tensor:
        """Scale gradients as ``torch.nn.utils.clip_grad_norm_`` would on the whole model."""
        norm = self.grad_norm(units)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coefs: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for unit in units:
            if unit.has_step_grad:
                grad = unit.shard_grad
                key = (grad.device, grad.dtype)
                if key not in coefs:  # one copy per store and dtype, not per unit
                    coefs[key] = coef.to(grad.device, grad.dtype)
                grad.mul_(coefs[key])
        return norm

    @torch.no_grad()
    def clip_grad_value_(self, units: Sequence[FlatUnit], clip_value: float) -> None:
        self.prepare_step(units)
        for unit in units:
            if unit.has_step_grad:
                unit.shard_grad.clamp_(min=-clip_value, max=clip_value)

    # --- parameters --------------------------------------------------------------------------

    def step_buckets(self, units: Sequence[FlatUnit]) -> list[list[FlatUnit]]:
        """``units`` in the buckets one optimizer call steps each: a param group's units in device memory in one
        bucket; offloaded units, which the host steps, in buckets of at most ``sub_group_size`` elements (see
        [Note: two faces of one optimizer] in optimizer.py)."""
        runs: list[list[FlatUnit]] = []
        for unit in units:
            if runs and runs[-1][0].spec.group == unit.spec.group and runs[-1][0].store is unit.store:
                runs[-1].append(unit)
            else:
                runs.append([unit])
        buckets = []
        for run in runs:
            if run[0].store.name == "device":
                buckets.append(run)
            elif run[0].store.in_memory:  # host memory: few, large calls (see [Note: two faces of one optimizer])
                per_call = -(-sum(u.spec.padded_numel for u in run) // HOST_STEP_CALLS)
                buckets.extend(_coalesce(run, min(self.config.sub_group_size,
                                                  max(self.config.allgather_bucket_size, per_call))))
            else:  # NVMe: a bucket is what is resident at once
                buckets.extend(_coalesce(run, min(self.config.allgather_bucket_size, self.config.sub_group_size)))
        return buckets

    @torch.no_grad()
    def step_and_gather(self, steps: Sequence[tuple[list[FlatUnit], Callable[[], None]]]) -> None:
        """Step every bucket's shards (``step()`` steps the bucket's units that have a gradient, in one optimizer
        call) and, at stages 1-2, all-gather the updated shards into the full flat parameters, coalesced into
        all-gathers of about ``allgather_bucket_size`` elements. A bucket's values are published and its gathers
        launched as soon as it is stepped, so they overlap the step of the next bucket. With the delayed update,
        the step launched by the previous call is finished and published instead, and ``steps`` start on the
        worker thread (see [Note: one-step delayed update] in delayed_update.py)."""
        if self.delayed is not None:
            self._publish_and_gather(*self.delayed.finish())
            self.delayed.launch(steps)
            self._choose_schedule()
            return
        pending = []
        for k, (bucket, step) in enumerate(steps):
            for unit in steps[k + 1][0] if k + 1 < len(steps) else []:  # NVMe: read ahead while this bucket steps
                if unit.has_step_grad:
                    unit.store.prefetch(unit)
            stepped = [unit for unit in bucket if unit.has_step_grad]
            if stepped:
                with self.resident(stepped, write=True):
                    step()  # units without a gradient are skipped by the optimizer, as torch skips grad=None
                    for unit in stepped:  # the bucket's values go back (offloaded: to the device) once it has stepped
                        unit.publish()
            for unit in bucket:
                unit.release_grads()  # consumed: see [Note: gradient buffers] in flat_unit.py
            if not collectives.local(self.group) and self.gatherer is None:  # stage 3 gathers on demand instead
                pending.extend(self._launch_gather(part)
                               for part in _coalesce(bucket, self.config.allgather_bucket_size))
        self._finish_gathers(pending)
        if self.gatherer is not None:
            self._choose_schedule()
            self._gather_persistent([u for bucket, _ in steps for u in bucket])

    def _choose_schedule(self) -> None:
        """``schedule="auto"``, after the second optimizer step: see [Note: choosing the gather schedule]. A
        collective (once)."""
        if self.auto_schedule is not None and self.auto_schedule.record is None:
            blocks = [n for n in self.gatherer.blocks if n != ROOT]
            gathered = max((u.flat_param.element_size() for u in self._block_units), default=4)
            self.auto_schedule.choose(self.gatherer, gathered, blocks)

    def flush_delayed_update(self) -> None:
        """Finish the delayed update's step in flight and publish it (nothing without one). A collective at stages
        1-2 (the all-gathers of the stepped values): every rank calls it at the same point."""
        if self.delayed is not None and self.delayed.in_flight:
            self._publish_and_gather(*self.delayed.finish())

    def _publish_and_gather(self, buckets: list[list[FlatUnit]], stepped: list[FlatUnit]) -> None:
        """The stepped masters of ``stepped`` into the compute shards, then (stages 1-2) every unit of ``buckets``
        all-gathered, or (stage 3) its persistent blocks, as ``step_and_gather`` does after each bucket's step."""
        for unit in stepped:
            unit.publish()
        if self.gatherer is not None:
            self._gather_persistent([u for bucket in buckets for u in bucket])
        elif not collectives.local(self.group):
            self._finish_gathers([self._launch_gather(part) for bucket in buckets
                                  for part in _coalesce(bucket, self.config.allgather_bucket_size)])

    def _gather_persistent(self, units: Sequence[FlatUnit]) -> None:
        """Stage 3: the persistent blocks holding ``units``, all-gathered after the step in coalesced buckets, so
        the next forward finds them gathered. See [Note: stage-3 gather schedule] in gather.py."""
        blocks = self.gatherer.persistent_blocks(units)
        if not blocks:
            return
        gathered = [u for block in blocks for u in block.units]
        for unit in gathered:
            unit.allocate()
        if collectives.local(self.group):
            for unit in gathered:
                unit.flat_param.copy_(unit.compute_shard())
        else:  # qwZ quantizes each unit's values: one collective per unit (a coalesced bucket is bytes)
            parts = [[u] for u in gathered] if self.config.quantized_weights else \
                _coalesce(gathered, self.config.allgather_bucket_size)
            self._finish_gathers([self._launch_gather(part) for part in parts])
        self.gatherer.mark_gathered(blocks)

    def _finish_gathers(self, pending: list[PendingGather]) -> None:
        for gather in pending:
            gather.handle.wait()
            if gather.out is not None:
                fill_from_gathered(gather.bucket, gather.out, self.world_size)

    @functools.cached_property
    def _param_all_gather(self) -> collectives.AllGather:
        """This run's parameter all-gather, chosen once: int8 under qwZ ([Note: quantized collectives] in
        quantized_collectives.py). Stage 3's gathers (the ``Gatherer``) call the same one."""
        return quantized_collectives.param_all_gather(self.config.quantized_weights)

    def _launch_gather(self, bucket: list[FlatUnit]) -> PendingGather:
        if len(bucket) == 1:
            unit = bucket[0]
            shard = unit.compute_shard().clone()  # the owned slice aliases the output
            return PendingGather(self._param_all_gather(unit.flat_param, shard, self.group, async_op=True), bucket, None)
        shard = shard_bytes([u.compute_shard() for u in bucket])
        out = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        return PendingGather(self._param_all_gather(out, shard, self.group, async_op=True), bucket, out)

    def metadata(self) -> dict[str, Any]:
        return self.partition.metadata()

    def param_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the partition."""
        return {id(p): unit.spec.params[i].name for p, (unit, i) in self._where.items()}

    @torch.no_grad()
    def republish(self, unit: FlatUnit) -> None:
        """``unit``'s master was written outside a step (a load, a weight-averaging swap; the unit resident): its
        compute shard takes the values, and so does its slice of a gathered stage-3 buffer. Then
        :meth:`refresh_params`."""
        unit.publish()
        if self.config.stage >= 3 and unit.gathered:
            lo, hi = unit.spec.shard_range(unit.rank)
            unit.flat_param[lo:hi].copy_(unit.gather_source())

    def refresh_params(self) -> None:
        """After :meth:`republish`: stage 3 releases every gathered block (other ranks' slices are stale; the next
        forward gathers the new values), stages 1-2 all-gather the full parameters. A collective."""
        if self.gatherer is not None:
            self.gatherer.release_all()
        self.all_gather_params()

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Stages 1-2: every unit's full flat parameter from every rank's compute shard, in the buckets a
        step gathers in; for shards written outside a step (a checkpoint load). A collective."""
        if not collectives.local(self.group) and self.gatherer is None:
            self._finish_gathers([self._launch_gather(bucket)
                                  for bucket in _coalesce(self.units, self.config.allgather_bucket_size)])


def _warn_once(message: str) -> None:
    """On rank 0; once per message, by Python's own default filter (its registry, not a set of ours)."""
    if collectives.rank(None) == 0:
        warnings.warn(message, stacklevel=3)


HOST_STEP_CALLS = 8
"""Optimizer calls per param group that the host steps in memory: each bucket's values go up (and, at stages 1-2, are
all-gathered) while the host steps the next, so more calls hide more of the copies and fewer cost less per call."""


def _coalesce(units: Sequence[FlatUnit], limit: int) -> Iterator[list[FlatUnit]]:
    bucket: list[FlatUnit] = []
    size = 0
    for unit in units:
        if bucket and size + unit.spec.padded_numel > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(unit)
        size += unit.spec.padded_numel
    if bucket:
        yield bucket


def _collect_params(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], kept: set[str] = frozenset(),
                    frozen_too: bool = False, evaluating: bool = False
                    ) -> tuple[list[ParamSpec], dict[str, nn.Parameter]]:
    """ParamSpecs, in registration order, of the trainable parameters that some optimizer holds (``evaluating``:
    all of them, in group (0, 0)) and, with ``frozen_too`` (stage 3), of the float32/bfloat16 parameters that do
    not require gradients and of the packed (quantized) ones (group FROZEN)."""
    names = {p: n for n, p in module.named_parameters()}
    group_of: dict[nn.Parameter, tuple[int, int]] = {p: (0, 0) for p in names if evaluating and p.requires_grad}
    for oi, optimizer in enumerate(optimizers):
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p not in names:
                    raise ZeroEngineError(
                        f"Optimizer {oi} ({type(optimizer).__name__}), param group {gi}, holds a tensor of shape"
                        f" {tuple(p.shape)} that is not a parameter of the LightningModule. HINT: build the"
                        " optimizer from `self.parameters()` in `configure_optimizers`."
                    )
                if p in group_of:
                    raise ZeroEngineError(
                        f"Parameter `{names[p]}` is in two optimizers or param groups ({group_of[p]} and"
                        f" {(oi, gi)}). HINT: give every parameter to exactly one optimizer param group."
                    )
                group_of[p] = (oi, gi)
    specs, by_name = [], {}
    for name, p in module.named_parameters():
        packed_weights.check_frozen(name, p)
        if frozen_too and not p.requires_grad and packed_weights.is_packed(p):  # see [Note: packed parameters]
            specs.append(ParamSpec(name, tuple(p.shape), FROZEN, storage=str(p.dtype).removeprefix("torch.")))
            by_name[name] = p
        elif p in group_of and p.requires_grad:
            if p.dtype not in (torch.float32, torch.bfloat16):
                raise ZeroEngineError(
                    f"Parameter `{name}` is {p.dtype}; lzero shards float32 (and, under bf16-true, bfloat16)"
                    " parameters. HINT: keep parameters in float32 and choose the compute dtype with"
                    " `Trainer(precision=...)`."
                )
            specs.append(ParamSpec(name, tensor_parallel.local_shape(p), group_of[p], keep_fp32=name in kept))
            by_name[name] = p
        elif frozen_too and not p.requires_grad and p.dtype in (torch.float32, torch.bfloat16):
            specs.append(ParamSpec(name, tensor_parallel.local_shape(p), FROZEN, keep_fp32=name in kept))
            by_name[name] = p
    return specs, by_name


def _refuse_cut_whole_tensors(specs: Sequence[ParamSpec], whole: frozenset) -> None:
    """An optimizer stepping whole tensors would see only a tensor-parallel rank's slice of a cut parameter."""
    cut = next((s for s in specs if s.group in whole and s.whole is not None), None)
    if cut is not None:
        raise ZeroEngineError(
            f"`{cut.name}` is cut by tensor parallel, and its optimizer (param group {cut.group}) steps whole tensors"
            " (Muon, Adafactor, or `optimizer_partition='per_tensor'`): each tensor-parallel rank would orthogonalize"
            " or factor only its slice, not the matrix DDP steps. Not built yet. HINT: use an elementwise optimizer"
            " (AdamW) with tensor parallel, or drop `tensor_parallel_size`.")


def _refuse_full_graphs(module: nn.Module, block_modules: dict[str, nn.Module]) -> None:
    """Stage 3 gathers each block in eager hooks, which one full graph around several blocks cannot hold."""
    found = full_graphs_around(module, block_modules)
    if found:
        path, blocks = next(iter(found.items()))
        raise ZeroEngineError(
            f"`{path}` is compiled with fullgraph=True around the zero3 units {blocks}; each unit is gathered and"
            " released by eager hooks (collectives) between the units' compute, which one graph cannot hold."
            " HINT: compile each unit instead (`torch.compile(block, fullgraph=True)` or"
            f" `block.compile(fullgraph=True)`), or compile `{path}` without fullgraph=True (dynamo then breaks"
            " the graph at each unit), or use strategy='zero2'."
        )
