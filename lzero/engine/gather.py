"""Stage 3: gather each block's parameters just before use and release them right after.

[Note: stage-3 parameter lifecycle]
A block (one module instance, see units.py) owns one FlatUnit per param group. Its parameters
are all-gathered in the block's forward pre-hook and released in its forward hook. If the
forward ran with gradients, hooks on the block's outputs gather it again as soon as backward
reaches them (before the block's own backward nodes run); once backward has passed the block's
inputs, the block is released again and its gradients are reduce-scattered by the engine, as at
stage 2 (see [Note: one backward hook per block]). The root unit (parameters outside every block,
e.g. tied embeddings) is gathered for the whole step by the strategy and released at the end of
backward.

A block none of whose inputs or parameters require gradients has no backward and is released after
its forward (a frozen reference model under ``torch.no_grad()``).

[Note: one backward hook per block]
A per-parameter gradient hook costs a Python call per parameter per backward (292 on a 24-layer GPT-2),
so stage-3 blocks have none. The forward pre-hook instead hooks the block's tensor inputs that require
gradients (positional and keyword): once autograd has computed the gradient of all of them, no backward
node of the block is left, and every parameter of the block holds its final gradient for this backward.
Autograd's engine runs a parameter's AccumulateGrad before any other node that became ready with it (it
has the highest priority), and the node producing an input's gradient runs after all of the block's
nodes that feed it; so when the input hook fires, the engine reads which parameters hold a gradient
(``FlatUnit.arrivals``), counts them as arrived, releases the block and launches its reductions. A
parameter without a gradient then was not used by this backward: its unit waits, as under per-parameter
hooks, until the end of backward, where the flag exchange settles it (see [Note: reduction order] in
reducer.py). That is FSDP2's scheme (a post-backward hook on the module's inputs) with its fallback.
- Frozen parameters need no special case: the block waits for its inputs' gradients whatever its
  parameters are.
- A block run by several forwards in one step (shared weights) is done when the last of those
  backwards has passed its inputs (``Block.pending_backwards``).
- A block whose inputs need no gradient (the first block behind a frozen embedding) gets no hook: its
  gradients are collected, and it is released, at the end of backward, which for the first block in
  forward is where backward ends anyway.
- A block's output is usually the next block's input: both hooks sit on one tensor, and the next
  block's release runs before this block's gather (``_on_grad``), so a prefetch capped by
  ``max_live_parameters`` sees the room.
- The first block hook (before a gather, or when a block is done) to run in a backward that accumulates
  into some trainable parameter opens the engine's round, whose end-of-backward callback collects what no
  hook reported. A backward accumulating into nothing (``torch.autograd.grad``, e.g. a gradient penalty:
  autograd's ``_will_engine_execute_node`` on the AccumulateGrad nodes says so) opens none, and the blocks it
  passes stay gathered (``Block.sticky``) until the end of the next round: with ``create_graph`` its graph
  is differentiated again by the real backward, whose nodes read the blocks' parameters in no order the
  hooks could bracket. A leaf input's hook left by a forward of an earlier step does nothing.
The root's parameters (few: embeddings, final norm) keep per-parameter hooks, so any backward, even one
that reaches no block, opens the round.

The order in which blocks ran in the first forward is recorded; from then on, entering block k
also launches the all-gathers of the next blocks (reversed in backward), so their communication
overlaps the current block's compute: see [Note: stage-3 gather schedule].

[Note: stage-3 gather schedule]
Five knobs of :class:`GatherSchedule` (DeepSpeed's stage-3 knobs, in elements, and one of lzero's) decide
when a block is gathered, with which others, and how long it stays; none changes what is computed:
- how far to prefetch: ``prefetch`` blocks ahead, or, with ``prefetch_bucket_size``, blocks ahead until
  those gathered or launched ahead hold that many elements;
- ``max_live_parameters``: a prefetch that would take the gathered elements past it waits for the
  block's own gather; so does keeping a block across the turn;
- ``max_reuse_distance``: from the second step on (the first records the order), the last blocks of
  forward, which backward needs first, are not released at the end of their forward when their reuse
  distance (twice the elements of the blocks after them: their forward, then their backward) is below it;
- ``param_persistence_threshold``: a block of at most that many elements is not released at the end of
  its forward either; and after the optimizer step, every such block whose shards live in device memory is
  gathered again at once, in all-gathers coalesced to ``allgather_bucket_size`` as at stages 1-2, so the
  next forward finds it gathered: a model of many small blocks then pays one collective per bucket for them
  instead of one per block in forward and another in backward (DeepSpeed's persistent parameters). Such a
  block is released like the others at the end of backward, so it never holds stale values across the step;
- ``gather_bucket_size``: once the order is recorded, consecutive blocks of at most a quarter of it each
  (shards in device memory, not persistent) form runs of at most that many elements, and a hook that
  gathers or prefetches a block launches the released blocks of its run with it, in one all-gather into a
  staging buffer laid out rank by rank and one order check; the first wait copies every unit's values into
  its buffer. A run counts as one block for ``prefetch`` and ``prefetch_bucket_size``, and blocks are still
  released one by one. Each all-gather costs a fixed latency (about 0.2 ms to launch on gloo, plus a round
  trip), so a model of many small blocks pays it per run instead of per block, in forward and in backward,
  for at most about two runs of extra gathered parameters.
A block kept at the end of its forward is released like any other once its backward is done, and every
block at the end of backward; a forward that no backward follows leaves kept blocks gathered until the
next step begins, which releases them before the optimizer's update could make them stale.

Every rank must gather the same blocks in the same order: gloo pairs any two buffers of equal
size, so a block run on only some ranks would silently mix parameters (and two of different sizes
abort the process from gloo's thread). Before each gather is launched the ranks therefore check
that they agree on the block's index, exchanged on a small process group with a short timeout: a
disagreement, or a rank that never arrives, raises an error naming the block on every rank. Once
the first step has recorded the order, the exchange for the block after the one being launched (in
forward or backward order) starts asynchronously with that launch, so by the time the next block
is launched its check has long completed and costs no round trip; only the first step, and a
block out of the recorded order, wait for a synchronous exchange. (Waiting for one before every
gather was a quarter of the step on a model of many small blocks.)

[Note: hooks and torch.compile]
While a compiled block runs, dynamo's frame hook is active, so the block's forward hooks would be
compiled too (as frames of their own, called from the block's ``_call_impl``, or inlined where a
module compiled around several blocks calls them): dynamo breaks them at the unit-order check,
specialises graphs on the released parameters' placeholders and replays their bookkeeping out of
step with the real gathers (a block marked gathered whose storage is freed). The forward hooks
are therefore ``torch.compiler.disable``d: they always run eagerly, and dynamo traces a block's
forward only after its pre-forward hook has gathered it, so every compiled graph is traced and
guarded on gathered parameters with their real strides. A block compiled itself
(``torch.compile(block)``, ``block.compile()``, ``fullgraph=True`` too) compiles to the same graph
as without lzero. A module compiled around several blocks breaks its graph at each block's hooks,
so ``torch.compile(container, fullgraph=True)`` cannot work and is refused at setup. The backward
hooks are tensor hooks that autograd's engine runs, outside any compiled frame.
"""

from __future__ import annotations

import functools
import enum
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lzero.engine import collectives
from lzero.engine.blocks import Block, BlockState, GatherSchedule, Gathering, HostCopy, RunGathering
from lzero.engine.flat_unit import FlatUnit, shard_bytes
from lzero.engine.hpz import SecondaryPartition
from lzero.engine.unit_order import OrderCheck
from lzero.engine.units import ROOT


class Pass(enum.Enum):
    """Which way the block hooks walk the blocks now, and whether the order is known (one per gatherer)."""

    FIRST_FORWARD = enum.auto()
    """The first training forward, until the first backward reaches a block: each block's forward appends it to
    ``order``; nothing is kept across the turn, runs are single blocks and the order check has no next block."""
    FORWARD = enum.auto()
    """A forward (or anything outside backward: a state dict, evaluation): the next block is later in ``order``."""
    BACKWARD = enum.auto()
    """A backward: the next block is earlier in ``order``, and hpZ's secondary slices serve the gathers."""

    @property
    def direction(self) -> int:
        """+1: the next block is after the current one in ``order``; -1: before it."""
        return -1 if self is Pass.BACKWARD else 1


class Mode(enum.Enum):
    """Where a gather gets its values (one per gatherer; generation's context managers set the other two)."""

    COLLECTIVE = enum.auto()
    """An all-gather of the shards (or hpZ's secondary slices), released after use: training and evaluation."""
    PINNED = enum.auto()
    """Inside ``all_gathered()``: every block stays gathered and the forward hooks do nothing."""
    STREAMED = enum.auto()
    """Inside ``streamed_from_host()``: a gather copies the block's full values from host memory."""


class Gatherer:
    """See [Note: stage-3 parameter lifecycle]."""

    def __init__(self, blocks: dict[str, Block], modules: dict[str, nn.Module], group: Any,
                 schedule: GatherSchedule = GatherSchedule(), check_group: Any = None,
                 check_timeout_s: float = 0.0,
                 on_backward: Optional[Callable[[Block, bool], None]] = None,
                 accumulating: Optional[Callable[[], bool]] = None,
                 all_gather: collectives.AllGather = collectives.all_gather,
                 secondary: Optional[SecondaryPartition] = None) -> None:
        """``all_gather``: the parameter all-gather over ``group``, the engine's choice (int8 under qwZ, see [Note:
        quantized collectives] in quantized_collectives.py); ``secondary``: hpZ's node-local copies for backward's
        gathers (see [Note: hpZ] in hpz.py). ``on_backward(block, done)``: a backward hook of ``block`` runs, before
        it is gathered for its backward (``done`` False) or once the backward of every forward of the block since the
        last has passed its inputs (``done`` True: no backward node of the block is left, the engine collects its
        gradients, and the block is released after that). See [Note: one backward hook per block]."""
        self.blocks = blocks
        self._on_backward = on_backward
        self._accumulating = accumulating  # inside backward: whether it accumulates into parameters
        self.group = group
        self._all_gather = all_gather  # over ``group``: plain or qwZ's (gather_exact's is always plain)
        self.secondary = secondary
        # every rank agrees on each block before its all-gather (None: a single process, nothing to agree on)
        self.order_check = OrderCheck(list(blocks), check_group, check_timeout_s) if check_group is not None else None
        self.numel = {name: sum(u.spec.numel for u in b.units) for name, b in blocks.items()}  # elements, unpadded
        self.order: list[str] = []  # block names in first-forward order
        self.passing = Pass.FIRST_FORWARD
        self.mode = Mode.COLLECTIVE
        self.reschedule(schedule)  # sets the schedule and what follows from it
        self._block_of_unit = {id(u): b for b in blocks.values() for u in b.units}
        self._host: dict[int, torch.Tensor] = {}  # Mode.STREAMED: unit id -> its full values in host memory
        self._copy_stream: Any = None  # CUDA: the side stream of host copies
        self._fresh: set[str] = set()  # persistent blocks the optimizer step gathered (kept by begin_step)
        self._step = 0  # training steps begun (begin_step): a hook of an earlier step's forward does nothing
        self._hooks = []
        for name, module in modules.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward_hook(name), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._post_forward_hook(name)))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # --- gather / release --------------------------------------------------------------------

    def launch(self, name: str, with_run: bool = False) -> None:
        """Start gathering ``name``; ``with_run`` (forward and backward hooks): with the released blocks of its run
        (``gather_bucket_size``), in one collective."""
        block = self.blocks[name]
        if block.state is not BlockState.RELEASED:
            return
        if self.mode is Mode.STREAMED:
            self._copy_from_host(block)
            return
        if with_run:
            members = [n for n in self._run_of(name) if self.blocks[n].state is BlockState.RELEASED]
            if len(members) > 1:
                self._launch_run(name, members)
                return
        self._agree_on(name)
        self._check_ahead(name)
        for unit in block.units:
            unit.allocate()
            # an offloaded shard is copied to the device here, so a prefetch starts that copy early too; the
            # handle keeps the copy alive until the all-gather has read it
            if self._from_secondary(block.units):
                block.handles.append(Gathering(self.secondary.gather(unit), self.secondary.source(unit), None))
                continue
            source = unit.gather_source()
            handle, copied = unit.param_store.gather_from_side_stream(
                lambda: self._all_gather(unit.flat_param, source, self.group, async_op=True))
            block.handles.append(Gathering(handle, source, copied))
        block.state = BlockState.GATHERING

    def _launch_run(self, name: str, members: list[str]) -> None:
        """One all-gather for the blocks ``members`` (in forward order), launched for ``name`` among them."""
        self._agree_on(name)
        self._check_ahead(members[-1] if self.passing.direction > 0 else members[0])  # the next launch is past the run
        units = [u for n in members for u in self.blocks[n].units]
        for unit in units:
            unit.allocate()
        if self._from_secondary(units):  # hpZ: within the node
            group, gather = self.secondary.group, self.secondary.all_gather
            shard = shard_bytes([self.secondary.source(unit) for unit in units])
        else:
            group, gather = self.group, self._all_gather
            shard = shard_bytes([unit.gather_source() for unit in units])
        world_size = collectives.world_size(group)
        out = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
        gathering = RunGathering(gather(out, shard, group, async_op=True), units, out, world_size)
        for n in members:
            self.blocks[n].handles.append(gathering)
            self.blocks[n].state = BlockState.GATHERING

    def _from_secondary(self, units: Sequence[FlatUnit]) -> bool:
        """hpZ: whether a gather of ``units`` now reads the node's secondary slices ([Note: hpZ] in hpz.py)."""
        return self.secondary is not None and self.passing is Pass.BACKWARD and self.secondary.holds(units)

    def _run_of(self, name: str) -> tuple[str, ...]:
        """The blocks gathered with ``name`` in forward and backward: [Note: stage-3 gather schedule]."""
        if self.schedule.gather_bucket_size <= 0 or self.passing is Pass.FIRST_FORWARD:
            return (name,)
        if self._runs is None:
            self._runs = self._make_runs()
        return self._runs.get(name, (name,))

    def _make_runs(self) -> dict[str, tuple[str, ...]]:
        """Consecutive blocks of the recorded order, each of at most a quarter of ``gather_bucket_size`` elements
        and with its shards in device memory, in runs of at most ``gather_bucket_size`` elements (persistent
        blocks and the root stay alone). Only sizes and the order decide: every rank forms the same runs."""
        limit = self.schedule.gather_bucket_size
        runs: dict[str, tuple[str, ...]] = {}
        run: list[str] = []
        size = 0
        for name in [*self.order, None]:  # None closes the last run
            joins = name is not None and name != ROOT and name not in self._persistent \
                and 4 * self.numel[name] <= limit \
                and all(u.param_store.name == "device" for u in self.blocks[name].units)
            if not joins or size + self.numel[name] > limit:
                if len(run) > 1:
                    runs.update(dict.fromkeys(run, tuple(run)))
                run, size = [], 0
            if joins:
                run.append(name)
                size += self.numel[name]
        return runs

    def _check_ahead(self, name: str) -> None:
        """Start the order check of the block after ``name`` in the current direction (recorded order only)."""
        if self.order_check is None or self.passing is Pass.FIRST_FORWARD or name not in self.order:
            return
        j = self.order.index(name) + self.passing.direction
        if 0 <= j < len(self.order) and self.blocks[self.order[j]].state is BlockState.RELEASED:
            self.order_check.start(self.order[j])

    def _agree_on(self, name: str) -> None:
        if self.order_check is not None:
            self.order_check.agree_on(name)

    def gather_exact(self, name: str) -> None:
        """Full parameters of ``name`` resident on return, gathered unquantized even under qwZ (values to write back
        into the shards), whether it was gathered before or not."""
        block = self.blocks[name]
        for handle in block.handles:
            handle.wait()
        block.handles = []
        for unit in block.units:
            unit.allocate()
            collectives.all_gather(unit.flat_param, unit.gather_source(), self.group)
            unit.attach()
        block.state = BlockState.GATHERED

    def gather(self, name: str) -> None:
        """Full parameters of ``name`` resident on return."""
        self.launch(name)
        block = self.blocks[name]
        if block.state is BlockState.GATHERING:
            for handle in block.handles:
                handle.wait()
            block.handles = []
            for unit in block.units:
                unit.attach()
            block.state = BlockState.GATHERED

    def release(self, name: str) -> None:
        block = self.blocks[name]
        if block.state is BlockState.RELEASED or self.mode is Mode.PINNED:
            return
        self._fresh.discard(name)
        for handle in block.handles:  # a prefetch never used: still has to land before freeing
            handle.wait()
        block.handles = []
        for unit in block.units:
            unit.release()
        block.state = BlockState.RELEASED
        block.sticky = False

    def release_all(self) -> None:
        for name in self.blocks:
            self.release(name)

    @contextmanager
    def all_gathered(self) -> Iterator[None]:
        """[Note: every block gathered for generation]
        Inside the block every unit is gathered once (a collective per block, in the same order on every rank)
        and stays gathered until exit: the forward hooks return at once, so the many short forwards of
        autoregressive generation run no collective at all, and ranks may run different numbers of them. Blocks
        gathered before entering stay gathered after exit; the others are released."""
        before = set(self.gathered_names())
        for name in self.blocks:
            self.gather(name)
        self.mode = Mode.PINNED
        try:
            yield
        finally:
            self.mode = Mode.COLLECTIVE
            for name in self.blocks:
                if name not in before:
                    self.release(name)

    @contextmanager
    def streamed_from_host(self, pin: bool) -> Iterator[None]:
        """[Note: blocks streamed from host memory]
        For generation with a model that does not fit gathered on the device (ZeRO-Inference's layout): on entry
        every block is all-gathered once, in the same order on every rank, and its full values copied into host
        memory (pinned with ``pin``), then released; the root stays gathered. Inside, a block's gather is a copy
        from that host copy (on a side stream under CUDA, so a prefetch overlaps the current block's compute) and
        its release frees the device buffer as usual: the device holds the root and the blocks the schedule keeps
        live, the host the whole model in the compute dtype, and each forward costs one host-to-device copy per
        block and no collective, so ranks may run different numbers of forwards. On exit the blocks gathered
        before entering are gathered again (from the host copies) and the others released."""
        before = set(self.gathered_names())
        host: dict[int, torch.Tensor] = {}
        for name, block in self.blocks.items():
            self.gather(name)
            for unit in block.units:
                flat = unit.flat_param
                host[id(unit)] = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=pin).copy_(flat)
            if name not in before and name != ROOT:
                self.release(name)
        self._host, self.mode = host, Mode.STREAMED
        try:
            yield
        finally:
            try:
                for name in before:
                    self.gather(name)
                for name in self.blocks:
                    if name not in before:
                        self.release(name)
            finally:
                self._host, self.mode = {}, Mode.COLLECTIVE
                if self._copy_stream is not None:
                    self._copy_stream.synchronize()  # no copy may still read the host buffers

    def _copy_from_host(self, block: Block) -> None:
        for unit in block.units:
            unit.allocate()
            flat, source = unit.flat_param, self._host[id(unit)]
            if flat.device.type != "cuda":
                flat.copy_(source)
                block.handles.append(HostCopy(None, flat.device))
                continue
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(flat.device)
            self._copy_stream.wait_stream(torch.cuda.current_stream(flat.device))  # after the buffer's allocation
            with torch.cuda.stream(self._copy_stream):
                flat.copy_(source, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._copy_stream)
            block.handles.append(HostCopy(copied, flat.device))
        block.state = BlockState.GATHERING

    def gathers_in_flight(self) -> bool:
        """Some all-gather was launched and not waited for."""
        return any(block.handles for block in self.blocks.values())

    def gathered_names(self) -> list[str]:
        return [n for n, b in self.blocks.items() if b.state is not BlockState.RELEASED]

    def live_numel(self) -> int:
        """Elements of the blocks gathered or being gathered."""
        return sum(self.numel[n] for n in self.gathered_names())

    # --- schedule: see [Note: stage-3 gather schedule] -----------------------------------------

    def _fits(self, live: int, numel: int) -> bool:
        cap = self.schedule.max_live_parameters
        return cap is None or live + numel <= cap

    def _keeps(self, name: str) -> bool:
        """Whether ``name`` stays gathered at the end of a forward that backward will follow."""
        if name in self._persistent:
            return True
        if self.passing is Pass.FIRST_FORWARD:  # the order, hence the reuse distances, are not known yet
            return False
        if self._reused is None:
            self._reused = set()
            after, live = 0, self.numel.get(ROOT, 0)  # the root stays gathered all step
            for block in reversed(self.order):
                if 2 * after >= self.schedule.max_reuse_distance or not self._fits(live, self.numel[block]):
                    break
                self._reused.add(block)
                live += self.numel[block]
                after += self.numel[block]
        return name in self._reused

    def _prefetch_after(self, name: str, step: int) -> None:
        """Launch the blocks after ``name`` in direction ``step`` that the schedule prefetches; a run of blocks
        (``gather_bucket_size``) counts as one, and ``name``'s own run not at all."""
        if name not in self.order:
            return
        schedule, k = self.schedule, self.order.index(name)
        by_size = schedule.prefetch_bucket_size
        live, ahead, count = self.live_numel(), 0, 0
        counted = set(self._run_of(name))
        for j in range(k + step, len(self.order) if step > 0 else -1, step):
            nxt = self.order[j]
            if nxt in counted:
                continue
            if (count >= schedule.prefetch) if by_size is None else (ahead >= by_size):
                return
            run = self._run_of(nxt)
            released = sum(self.numel[n] for n in run if self.blocks[n].state is BlockState.RELEASED)
            if released:
                if not self._fits(live, released):
                    return
                self.launch(nxt, with_run=True)
                live += released
            counted.update(run)
            ahead, count = ahead + sum(self.numel[n] for n in run), count + 1

    # --- hooks -------------------------------------------------------------------------------

    def _pre_forward_hook(self, name: str):
        @_eager
        def hook(module: nn.Module, args: Any, kwargs: dict) -> None:
            if self.mode is Mode.PINNED:
                return
            if self.passing is Pass.FIRST_FORWARD:
                if name not in self.order:
                    self.order.append(name)
            else:
                self.passing = Pass.FORWARD
            self.launch(name, with_run=True)
            self.gather(name)
            self._prefetch_after(name, +1)
            if torch.is_grad_enabled():
                self._watch_inputs(self.blocks[name], args, kwargs)
        return hook

    def _watch_inputs(self, block: Block, args: tuple, kwargs: dict) -> None:
        """Hook the block's tensor inputs that require gradients: [Note: one backward hook per block]."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            block.pending_backwards += 1
            waiting = [len(inputs), self._step]
            for t in inputs:
                _on_grad(t, functools.partial(self._input_grad, block, waiting), first=True)

    def _input_grad(self, block: Block, waiting: list[int]) -> None:
        if waiting[1] != self._step:  # a leaf input's hook left by a forward of an earlier step that no backward used
            return
        if self._accumulating is not None and not self._accumulating():
            block.sticky = True  # torch.autograd.grad: its graph may be differentiated again, reading the block
            return
        waiting[0] -= 1
        if waiting[0] == 0:
            self._backward_done(block)

    def _backward_done(self, block: Block) -> None:
        block.pending_backwards -= 1
        if block.pending_backwards > 0:  # a parameter used by several forwards is final after the last backward
            return
        if self._on_backward is not None:
            self._on_backward(block, True)
        if block.name and not block.sticky:
            self.release(block.name)

    def _post_forward_hook(self, name: str):
        @_eager
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.mode is Mode.PINNED:
                return output
            backward = False
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        _on_grad(t, self._pre_backward_hook(name), first=False)
                        backward = True
            if not (backward and self._keeps(name)):
                if backward and self.secondary is not None and self.mode is not Mode.STREAMED:
                    self.secondary.keep(self.blocks[name].units)  # for backward's gather: [Note: hpZ]
                self.release(name)
            return output
        return hook

    def _pre_backward_hook(self, name: str):
        def hook() -> None:
            self.passing = Pass.BACKWARD
            if self._on_backward is not None:
                self._on_backward(self.blocks[name], False)
            self.launch(name, with_run=True)
            self.gather(name)
            self._prefetch_after(name, -1)
        return hook

    # --- backward bookkeeping (called by the engine) -----------------------------------------

    def end_backward(self) -> None:
        """The backward is over: gathers from now on (a state_dict, the next forward) read the primary shards,
        which the optimizer step is about to change ([Note: hpZ] in hpz.py)."""
        if self.passing is Pass.BACKWARD:
            self.passing = Pass.FORWARD
        if self.secondary is not None:
            self.secondary.invalidate()

    def begin_step(self) -> None:
        """A training step starts: forget the backwards that forwards without a backward left pending, and release the
        blocks it left gathered (kept for a backward that never came), except persistent blocks gathered after
        the last optimizer step (see [Note: stage-3 gather schedule])."""
        self._step += 1
        if self.secondary is not None:  # the optimizer step may have changed the primary shards: [Note: hpZ]
            self.secondary.invalidate()
        for block in self.blocks.values():
            block.pending_backwards = 0
        for name in self.blocks:
            if name not in self._fresh:
                self.release(name)

    @property
    def steps(self) -> int:
        """Training steps begun (``begin_step``: every forward that gathers the root)."""
        return self._step

    @property
    def order_known(self) -> bool:
        """The first forward, which learns the blocks' order, has met a backward."""
        return self.passing is not Pass.FIRST_FORWARD

    def reschedule(self, schedule: GatherSchedule) -> None:
        """Gather by ``schedule`` from now on: between steps, after the optimizer step (see [Note: choosing the
        gather schedule] in schedule.py)."""
        self.schedule = schedule
        self._persistent = {n for n, k in self.numel.items() if k <= schedule.param_persistence_threshold}
        self._reused: Optional[set[str]] = None  # blocks kept across the turn, once the order is known
        self._runs: Optional[dict[str, tuple[str, ...]]] = None  # block -> its run (gather_bucket_size), once known

    def persistent_blocks(self, units: Sequence[FlatUnit]) -> list[Block]:
        """The persistent blocks holding any of ``units`` whose shards all live in device memory: what the
        optimizer step gathers again, whether released or already gathered by an earlier optimizer's step (see
        [Note: stage-3 gather schedule])."""
        wanted = {id(u) for u in units}
        return [b for n, b in self.blocks.items()
                if n in self._persistent and n and any(id(u) in wanted for u in b.units)
                and all(u.param_store.name == "device" and u.spec.padded_numel > 0 for u in b.units)]

    def mark_gathered(self, blocks: Sequence[Block]) -> None:
        """``blocks`` were all-gathered by the step (their units' buffers hold the full values): attach them."""
        for block in blocks:
            for unit in block.units:
                unit.attach()
            block.state = BlockState.GATHERED
            self._fresh.add(block.name)

    def block_of(self, unit: FlatUnit) -> Optional[Block]:
        return self._block_of_unit.get(id(unit))


_ACTIONS = "_lzero_on_grad"  # attribute of a tensor lzero hooks: what runs, in order, once its gradient is computed


def _on_grad(t: torch.Tensor, action: Callable[[], None], first: bool) -> None:
    """Run ``action()`` once the gradient of ``t`` is computed: one tensor hook per tensor, running its actions in
    order; ``first`` puts ``action`` before those already there. A block's output is often the next block's input:
    that block's backward is done (its release, first) before this block is gathered for its own."""
    if t.is_leaf:  # a hook on a leaf outlives this step's graph: one hook per action, removed once it has run
        handle = t.register_hook(lambda grad: (handle.remove(), action()) and None)
        return
    actions = getattr(t, _ACTIONS, None)
    if actions is None:
        actions = []
        setattr(t, _ACTIONS, actions)
        t.register_hook(functools.partial(_run_actions, actions))
    if first:
        actions.insert(0, action)
    else:
        actions.append(action)


def _run_actions(actions: list[Callable[[], None]], grad: torch.Tensor) -> None:
    for action in actions:
        action()


def full_graphs_around(module: nn.Module, block_paths: Iterable[str]) -> dict[str, list[str]]:
    """Path of each module compiled with ``torch.compile(..., fullgraph=True)`` around blocks -> those
    blocks. See [Note: hooks and torch.compile]."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = {}
    for path, m in module.named_modules():
        if isinstance(m, OptimizedModule) and getattr(m.dynamo_ctx, "fullgraph", False):
            inside = f"{path}._orig_mod." if path else "_orig_mod."
            blocks = [b for b in block_paths if b.startswith(inside)]
            if blocks:
                found[path] = blocks
    return found


def _eager(hook: Callable) -> Callable:
    """A module hook that dynamo runs eagerly. See [Note: hooks and torch.compile]."""
    return torch.compiler.disable(hook, recursive=True)

