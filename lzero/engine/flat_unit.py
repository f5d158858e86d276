"""The tensors of one unit on one rank: flat parameters, gradients, and the fp32 master shard.

See [Note: unit layout] in partition.py for the layout. Every module parameter's ``.data`` is a
view into the unit's full flat buffer. Stages 1 and 2 keep that buffer resident. Stage 3 keeps
only the owned shard: see [Note: released parameters].

[Note: released parameters]
Between uses a stage-3 unit's full buffer has its storage resized to zero and each parameter's
``.data`` is a NaN placeholder of the real shape (one element, expanded, stride 0), so
``ModelSummary`` still sees real sizes. The parameters stay the same objects, so autograd's saved
references see the re-gathered data.

FSDP2 instead keeps parameters as views of the freed buffer, with their real strides, so that
compiled graphs never see other strides. lzero keeps the placeholder: a view of a storage resized
to zero has no memory behind it, and a stray read of one (``p.sum()`` in a callback) is a
segfault on CPU, where the placeholder reads NaN and a write into it raises. Compiled blocks do
not need real strides here, because no compiled graph ever sees a released parameter: lzero's
gather hooks run outside dynamo (see [Note: hooks and torch.compile] in gather.py), so every graph
is traced and guarded on gathered parameters. ``attach`` and ``hand_back`` refuse a freed buffer
rather than create views of it. Lightning's weight-averaging callbacks, which read and write every
parameter between steps, are given the engine's averaged shards instead (see [Note: weight averaging
under ZeRO] in lzero/lightning/trainer_averaging.py); other code should enter
``strategy.gathered_parameters()`` first.

[Note: gradient buffers]
A unit holds gradient memory only between a backward and the step that consumes it, as DeepSpeed
does: stage 2-3 shard gradients are allocated by the first reduction of a step, and stage 1's full
flat gradient (``p.grad`` views into it, given as each backward starts, so autograd accumulates
micro-batches in place, as DDP's ``gradient_as_bucket_view`` does) by the first backward of a step; after the optimizer step (or a skipped step) every gradient buffer of
the unit is freed. Between steps a rank therefore holds the ZeRO formula without its gradient term.
The one difference from torch: a second ``step()`` with no backward and no ``zero_grad`` in between
does not apply the previous gradients again (they were consumed); ``zero_grad(set_to_none=False)``
after a step makes a zero gradient as torch would, so a following step still steps with zeros.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lzero.engine.packed_weights import Binding
from lzero.engine.tensor_parallel import as_grad, local, repoint
from lzero.engine.parameters import mark_gathered, mark_released, name_param, quiet_params, raw_grad, set_grad_quietly
from lzero.engine.partition import UnitSpec
from lzero.offload.store import GRAD_STATS, DeviceStore, ShardStore


class GradState(enum.Enum):
    """Where this unit's gradients are in the step cycle."""

    EMPTY = "no gradient since the last zero_grad"
    LOCAL = "this rank holds unreduced gradients (accumulating, or a reduce-scatter in flight)"
    REDUCED = "the shard gradient holds the global average; the optimizer may step"


class FlatUnit:
    """One unit's storage on this rank.

    ``values`` (stage 3, 1D, shard_numel): the owned slice of the unit's values when the parameters hold none
    yet (read from a checkpoint); it becomes the master where the store keeps masters in device memory, and the
    full buffer is never written (the engine releases the unit at once).

    Stage 1 keeps a full flat gradient buffer and makes every ``p.grad`` a view into it, so
    micro-batches accumulate locally exactly as they would under DDP; the shard gradient is a
    view of the owned slice. Stage 2 keeps only the shard gradient: each micro-batch's full
    gradients are packed into a temporary bucket, reduce-scattered, and freed.

    The unit owns its backward bookkeeping: the engine, the reducer and the gatherer call
    :meth:`begin_backward`, :meth:`grad_arrived`, :meth:`mark_launched`, :meth:`land_reduced` and
    :meth:`end_round` rather than writing its fields.
    """

    def __init__(self, spec: UnitSpec, params: Sequence[nn.Parameter], rank: int, stage: int,
                 param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
                 store: Optional[ShardStore] = None, param_store: Optional[ShardStore] = None,
                 values: Optional[Tensor] = None, bindings: Optional[Sequence[Binding]] = None) -> None:
        self.spec = spec
        self.key = f"unit{spec.index}"  # how the stores name this unit's tensors
        self.params = list(params)
        # packed (quantized) codes: each parameter's state, bound at every gather (see [Note: packed parameters])
        self.bindings = list(bindings) if bindings is not None else None
        self.rank = rank
        self.store: ShardStore = store if store is not None else DeviceStore()  # master, gradient, optimizer state
        self.param_store: ShardStore = param_store if param_store is not None else self.store  # stage-3 shard
        self.ranges = [(start, end) for _, start, end in spec.param_ranges()]  # each param in the flat buffer
        lo, hi = spec.shard_range(rank)
        device, master_dtype = params[0].device, params[0].dtype
        compute_dtype = param_dtype or master_dtype
        self.mixed = compute_dtype != master_dtype  # 16-bit compute with higher-precision masters
        self.reduce_dtype = reduce_dtype or master_dtype
        with torch.no_grad():
            if values is None:
                full = torch.zeros(spec.padded_numel, device=device, dtype=master_dtype)  # 1D, the unit's values
                for p, (start, end) in zip(self.params, self.ranges):
                    full[start:end].copy_(local(p).detach().reshape(-1))
                self.flat_param = full.to(compute_dtype) if self.mixed else full  # 1D, padded_numel
                # full precision at stages 1-2: the master is the owned slice of the parameters itself
                owned, alias_ok, compute = full[lo:hi], not self.mixed and stage < 3, self.flat_param[lo:hi]
                del full  # under mixed precision ``owned`` alone keeps it, until the master is taken
            else:  # stage 3, read from a checkpoint: only the owned slice is known, and is the master's own memory
                assert stage >= 3, "a unit built from its shard's values is released at once: stage 3 only"
                self.flat_param = torch.empty(spec.padded_numel, device=device, dtype=compute_dtype)  # never written
                owned, alias_ok = values, True
                compute = values.to(compute_dtype) if self.mixed else values
            if spec.frozen and values is not None and self.param_store.name == "device":
                master = compute  # read for this unit alone: its memory is the shard's, no copy to take
            elif spec.frozen:  # nothing steps it: the compute-dtype shard is all a rank keeps
                master = self.param_store.hold(compute, key=f"unit{spec.index}.master")
            else:
                master = self.store.hold_master(owned, alias_ok=alias_ok, key=f"unit{spec.index}")
            del owned
            for p, (start, end) in zip(self.params, self.ranges):
                repoint(p, self.flat_param[start:end].view(local(p).shape))  # a DTensor: its local tensor
        self.master_dtype = master_dtype  # the parameters' dtype, which they get back at the end of fit
        # 1D, shard_numel: what the optimizer steps (a frozen unit: its compute shard, stepped by nothing)
        self.master_shard = nn.Parameter(master, requires_grad=not spec.frozen)
        # stage 3: the compute-dtype shard that all-gathers read (the master itself in full precision)
        self._compute_shard = None
        self._shares = False
        if stage >= 3:
            # one tensor for both when it is the same memory (a file-backed master changes its data when resident)
            shares = spec.frozen or (not self.mixed and self.store is self.param_store and self.store.in_memory)
            self._shares = shares  # the compute shard is the master tensor itself
            # the compute-dtype values of the shard (the master's rounding): flat_param is the unit in that dtype
            self._compute_shard = master if shares else self.param_store.hold(compute, key=f"unit{spec.index}.param")
        self.accumulates_locally = stage == 1  # see [Note: gradient buffers]
        self.flat_grad: Optional[Tensor] = None  # stage 1: 1D, padded_numel, while the unit has local gradients
        self._grad_views: Optional[list[Tensor]] = None  # stage 1: each parameter's view of flat_grad
        self._unclaimed: set[int] = set()  # stage 1: params given a zero view by prelink() and no gradient yet
        self.shard_grad: Optional[Tensor] = None  # 1D, shard_numel, from the first reduction until the step
        self.zero_after_step = False  # set_to_none=False after a step: torch would hold a zero gradient
        self.owns_params = True  # parameters are views of (or placeholders for) this unit's buffer
        self._views: Optional[list[Tensor]] = None  # each parameter's view of flat_param, made at the first attach
        self._placeholders: Optional[list[Tensor]] = None  # each parameter's placeholder, made at the first release
        self.grad_state = GradState.EMPTY
        self.expected = 0  # params needing a gradient in the current backward
        self.seen = 0  # params whose gradient arrived in the current backward
        self.launched = False  # reduction launched in the current backward
        self.cleared: set[int] = set()  # params whose gradient the user set to None since they last got one
        # the delayed update's worker thread steps the master with the gradient it was handed: until that step is
        # finished, the master's ``.grad`` is the worker's (see [Note: one-step delayed update])
        self.stepping = False

    # --- backward bookkeeping ----------------------------------------------------------------

    def begin_backward(self) -> None:
        """A backward starts: every trainable parameter is expected to report its gradient."""
        self.expected = len(self.trainable)
        self.seen = 0
        self.launched = False

    def grad_arrived(self, index: int) -> None:
        """``params[index]`` got its gradient for this backward (stage 1: linked into the flat gradient)."""
        if self.accumulates_locally:
            self.link_grad(index)
            self._unclaimed.discard(index)
        self.grad_state = GradState.LOCAL
        self.seen += 1
        self.cleared.discard(index)

    def arrivals(self) -> list[int]:
        """Indices of the trainable parameters holding a gradient not yet counted in this backward: stage 3
        collects them once a block's backward is done (no per-parameter hook)."""
        if not self.waiting_for_grads:
            return []
        with quiet_params():
            return [i for i, p in enumerate(self.params) if p.requires_grad and raw_grad(p) is not None]

    @property
    def waiting_for_grads(self) -> bool:
        """Some parameter expected in this backward has not reported its gradient yet."""
        return self.seen < self.expected

    @property
    def has_local_grads(self) -> bool:
        """This rank contributes a gradient to the unit's next reduction."""
        return self.launched or self.grad_state is GradState.LOCAL

    def mark_launched(self) -> None:
        self.launched = True

    def end_round(self) -> None:
        """The backward's reductions are all done."""
        self.launched = False

    @torch.no_grad()
    def land_reduced(self, out: Tensor) -> None:
        """A reduce-scatter into ``out`` (this rank's shard of the averaged gradients) completed."""
        if self.accumulates_locally and self.store.name == "device" and not self.mixed:
            # the whole accumulated gradient is reduced at once, into its own slice: the master's gradient
            lo, hi = self.spec.shard_range(self.rank)
            self.shard_grad = self.local_grads()[lo:hi]
            self.shard_grad.copy_(out)
        else:  # stage 1 with a separate master (the reduced slice replaces its gradient), or stages 2-3 (added)
            held = None if self.accumulates_locally else self.shard_grad
            busy = self.master_shard.grad if self.stepping else None  # the delayed update's step reads that one
            self.shard_grad = self.store.land_grad(held, out, self.master_shard.dtype, self.key, busy)
        self.mark_reduced()

    def grad_stat(self, which: str) -> Tensor:
        """``GRAD_STATS[which]`` of this step's shard gradient (see store.py), where the gradient was reduced when the
        store computed it there before copying it off the device."""
        stat = self.store.grad_stat(self.shard_grad, self.key, which)
        return stat if stat is not None else GRAD_STATS[which](self.shard_grad)

    # --- gradients ---------------------------------------------------------------------------

    def local_grads(self) -> Tensor:
        """Stage 1: the full flat gradient that micro-batches accumulate into (zeros when first needed)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros_like(self.flat_param, memory_format=torch.contiguous_format)
            self._grad_views = [as_grad(p, self.flat_grad[start:end].view(local(p).shape))
                                for p, (start, end) in zip(self.params, self.ranges)]
        return self.flat_grad

    def grad_view(self, index: int) -> Tensor:
        """Stage 1: ``params[index]``'s view of the flat gradient."""
        self.local_grads()
        return self._grad_views[index]

    def link_grad(self, index: int) -> None:
        """Stage 1: make ``p.grad`` a view of the flat gradient. Nothing to do when it is one already (``prelink``,
        or an earlier micro-batch): autograd accumulated into it in place; otherwise autograd allocated its own,
        which is copied in."""
        with quiet_params():
            grad = raw_grad(self.params[index])
            view = self.grad_view(index)
            if grad is not None and grad is not view and local(grad).data_ptr() != local(view).data_ptr():
                with torch.no_grad():
                    local(view).copy_(local(grad))
                set_grad_quietly(self.params[index], view)

    def prelink(self) -> None:
        """Stage 1, as a backward starts: every trainable parameter without a gradient gets its (zero) view of the
        flat gradient as ``p.grad``, so autograd accumulates straight into the flat buffer instead of allocating a
        gradient that ``link_grad`` copies (DDP's ``gradient_as_bucket_view``). A parameter that gets no gradient
        in this backward has it taken back by ``end_backward``, so it reads None as under torch."""
        with quiet_params():
            for i in self.trainable:
                if raw_grad(self.params[i]) is None:
                    set_grad_quietly(self.params[i], self.grad_view(i))
                    self._unclaimed.add(i)

    def end_backward(self) -> None:
        """Stage 1, at the end of a backward: take back the views ``prelink`` gave and no gradient reached."""
        if self._unclaimed:
            with quiet_params():
                for i in self._unclaimed:
                    set_grad_quietly(self.params[i], None)
            self._unclaimed.clear()

    @torch.no_grad()
    def pack_grads(self, scale: float, out: Optional[Tensor] = None) -> Tensor:
        """Stage 2: ``scale * p.grad`` for every param (zeros where a param has none, and in the padding), laid out
        as the flat buffer; the params' full gradients are released. ``out``: a (world, shard_numel) view to write
        into, row r taking rank r's shard (a coalesced bucket's columns for this unit: [Note: coalesced
        reductions]); by default a new 1D bucket. Every element is written once, so nothing is zeroed first."""
        shard = self.spec.shard_numel
        bucket = None
        if out is None:
            bucket = torch.empty(self.spec.padded_numel, device=self.flat_param.device, dtype=self.reduce_dtype)
            out = bucket.view(-1, shard)

        def write(start: int, end: int, values: Optional[Tensor]) -> None:
            while start < end:  # row by row: a range may cross from one rank's shard into the next
                row, col = divmod(start, shard)
                stop = min(end, (row + 1) * shard)
                piece = out[row, col : col + stop - start]
                if values is None:
                    piece.zero_()
                else:
                    torch.mul(values[: stop - start], scale, out=piece)
                    values = values[stop - start :]
                start = stop

        with quiet_params():
            for p, (start, end) in zip(self.params, self.ranges):
                grad = raw_grad(p)
                write(start, end, None if grad is None else local(grad).reshape(-1))
                if grad is not None:
                    set_grad_quietly(p, None)
        if self.spec.per_tensor:  # padding after each rank's tensors ([Note: per-tensor ownership] in partition.py)
            for r in range(self.spec.world_size):
                for a, b in self.spec.padding(r):
                    write(r * shard + a, r * shard + b, None)
        else:
            write(self.spec.numel, self.spec.padded_numel, None)
        return out if bucket is None else bucket

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient of the unit, freeing its buffers. ``set_to_none=False`` keeps a gradient that
        exists (or that the last step consumed), zeroed, so the next step still steps it with zeros, as torch
        steps a zeroed ``p.grad``."""
        had_grad = self.grad_state is not GradState.EMPTY or self.zero_after_step
        self.store.finish()  # no gradient copy may land after the clearing
        self.release_grads()
        self.zero_after_step = False
        if set_to_none or not had_grad:
            return
        if self.accumulates_locally:  # a zero local gradient, reduced and stepped at the boundary
            for i in self.trainable:
                set_grad_quietly(self.params[i], self.grad_view(i))
            self.grad_state = GradState.LOCAL
        else:
            self.shard_grad = torch.zeros_like(self.master_shard, memory_format=torch.contiguous_format)
            self.mark_reduced()

    @torch.no_grad()
    def release_grads(self) -> None:
        """Free every gradient buffer once the step consumed them (see [Note: gradient buffers]), remembering
        whether a gradient existed, for a later ``zero_grad(set_to_none=False)``."""
        self.zero_after_step = self.grad_state is not GradState.EMPTY
        with quiet_params():
            for p in self.params:
                if raw_grad(p) is not None:
                    set_grad_quietly(p, None)
        self.flat_grad = self.shard_grad = None
        self._grad_views = None
        self._unclaimed.clear()
        if not self.stepping:
            self.master_shard.grad = None
        self.grad_state = GradState.EMPTY
        self.cleared.clear()

    @torch.no_grad()
    def clear_grad(self, index: int, set_to_none: bool = True) -> None:
        """The user cleared ``params[index].grad``: its part of the gradients is zeroed. With ``set_to_none`` it is
        also dropped: once every trainable parameter of the unit is, the unit has no gradient and is not stepped."""
        start, end = self.ranges[index]
        self.store.finish()  # no gradient copy may land after the clearing
        if self.flat_grad is not None:
            self.flat_grad[start:end].zero_()
        lo, hi = self.spec.shard_range(self.rank)
        a, b = max(start, lo), min(end, hi)
        if a < b and self.shard_grad is not None:
            self.shard_grad[a - lo : b - lo].zero_()
        if set_to_none:
            self.cleared.add(index)
            if all(i in self.cleared for i in self.trainable):
                self.zero_grad()

    @property
    def trainable(self) -> list[int]:
        """Indices of the parameters that take gradients."""
        with quiet_params():
            return [i for i, p in enumerate(self.params) if p.requires_grad]

    def mark_reduced(self) -> None:
        self.grad_state = GradState.REDUCED
        if not self.stepping:
            self.master_shard.grad = self.shard_grad

    @property
    def has_step_grad(self) -> bool:
        """This step's reduced gradient is in ``shard_grad``: clipping and the norm read it, the step consumes it."""
        return self.grad_state is GradState.REDUCED and self.shard_grad is not None

    def hand_grad_to_step(self) -> None:
        """The delayed update: the master's ``.grad`` takes this step's gradient for the worker thread's step, and
        the unit's gradient buffers are free for the next backward (``release_grads`` leaves that ``.grad``)."""
        self.master_shard.grad = self.shard_grad
        self.stepping = True

    # --- parameters --------------------------------------------------------------------------

    def compute_shard(self) -> Tensor:
        """This rank's slice of the parameters, in the dtype the model computes in (what all-gathers read)."""
        if self._compute_shard is not None:
            return self._compute_shard
        lo, hi = self.spec.shard_range(self.rank)
        return self.flat_param[lo:hi]

    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer stepped the master: write it, in the compute dtype, where the next
        all-gather reads. A no-op when the master is that very tensor (full precision, not offloaded)."""
        if self.spec.frozen:
            return
        if self.param_store.holds_in_file(self):  # NVMe parameter offload: the shard's file takes the values
            self.param_store.write_param(self, self.master_shard.detach())
        else:
            # the compute shard is the store's own tensor (stage 3, offloaded together): its memory may be swapped
            own = self._compute_shard is not None and self.param_store is self.store
            self.store.publish(self.master_shard.detach(), self.compute_shard(), self.key, own)

    @torch.no_grad()
    def cast_for_publish(self) -> None:
        """The host side of :meth:`publish`, done ahead (the delayed update's worker, right after the unit's step):
        the stepped master cast to the compute dtype in the store's outgoing buffer. Stores that need no cast
        (device, NVMe parameter files, the master being the compute shard) leave it to :meth:`publish`."""
        if self.spec.frozen or self.param_store.holds_in_file(self):
            return
        compute = self.compute_shard()
        if compute.data_ptr() != self.master_shard.data_ptr():
            self.store.cast_for_publish(self.master_shard.detach(), compute, self.key)

    def resident(self, write: bool = False):  # -> ContextManager[None]
        """The master and its optimizer state in memory inside the block. See ``ShardStore.resident``."""
        return self.store.resident(self, write)

    def gather_source(self) -> Tensor:
        """The compute shard on the compute device, for an all-gather (a copy when it lives in host memory)."""
        return self.param_store.fetch(self, self.flat_param.device)

    @property
    def gathered(self) -> bool:
        return self.flat_param.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Give the full flat buffer its storage back (contents undefined until gathered)."""
        storage = self.flat_param.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.spec.padded_numel * self.flat_param.element_size())

    def attach(self) -> None:
        """Point every parameter at its slice of the (gathered) full flat buffer."""
        self._require_gathered("attach")
        if self._views is None:  # views of the buffer's storage stay valid while it is resized to 0 and back
            self._views = [self.flat_param[start:end].view(local(p).shape)
                           for p, (start, end) in zip(self.params, self.ranges)]
        for p, view in zip(self.params, self._views):
            mark_gathered(p)  # first: the guard's class would route the ``.data`` write through __torch_function__
            repoint(p, view)  # a DTensor: its local tensor
        if self.bindings is not None:
            for p, binding in zip(self.params, self.bindings):
                binding.attach(p)

    def release(self) -> None:
        """Free the full flat buffer; parameters keep their shapes on a NaN placeholder, guarded (see
        [Note: released parameters are guarded] in parameters.py)."""
        if self.bindings is not None:
            for p, binding in zip(self.params, self.bindings):
                binding.release(p)
        if self.owns_params:
            if self._placeholders is None:
                placeholder = _placeholder(self.flat_param.dtype, self.flat_param.device)
                self._placeholders = [placeholder.expand(local(p).shape) for p in self.params]
                for p, spec in zip(self.params, self.spec.params):
                    name_param(p, spec.name)
            for p, placeholder in zip(self.params, self._placeholders):
                repoint(p, placeholder)
                mark_released(p)
        self.flat_param.untyped_storage().resize_(0)

    def hand_back(self, values: Optional[Tensor] = None) -> None:
        """End of fit: every parameter becomes a standalone full tensor, holding ``values`` (1-D, the unit's
        full fp32 masters) or, by default, the gathered parameters (stage 3, while gathered)."""
        if values is None:
            self._require_gathered("hand back")
        for p, (start, end) in zip(self.params, self.ranges):
            # the masters in their dtype (a frozen unit's are in the compute dtype), or the gathered parameters
            repoint(p, values[start:end].view(local(p).shape).to(self.flat_param.device, self.master_dtype, copy=True)
                    if values is not None
                    else local(p).detach().clone())
            mark_gathered(p)
        if self.bindings is not None:
            for p, binding in zip(self.params, self.bindings):
                binding.attach(p)
        self.owns_params = False

    @torch.no_grad()
    def keep_written_values(self) -> None:
        """Stage 3, while gathered: carry values written into the full parameters back into this rank's
        shard (and master)."""
        lo, hi = self.spec.shard_range(self.rank)
        if self.param_store.holds_in_file(self):
            self.param_store.write_param(self, self.flat_param[lo:hi])
        else:
            self.compute_shard().copy_(self.flat_param[lo:hi])
        if not self.spec.frozen and not self._shares:
            with self.resident(write=True):
                self.master_shard.data.copy_(self.flat_param[lo:hi])

    def _require_gathered(self, what: str) -> None:
        """Views of a freed buffer would read freed memory (a segfault on CPU): refuse instead."""
        if not self.gathered and self.spec.padded_numel > 0:
            names = ", ".join(p.name for p in self.spec.params[:3])
            raise RuntimeError(
                f"Cannot {what} the parameters of the unit holding {names}: its full buffer is released."
                " The unit's gather bookkeeping is out of step with its storage. HINT: do not call lzero's"
                " gather hooks from traced code (see [Note: hooks and torch.compile] in gather.py)."
            )


_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _placeholder(dtype: torch.dtype, device: torch.device) -> Tensor:
    """One NaN element per dtype and device (zero for packed integer codes), shared by every released parameter."""
    key = (dtype, device)
    if key not in _PLACEHOLDERS:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        _PLACEHOLDERS[key] = torch.full((1,), fill, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def shard_bytes(shards: Sequence[Tensor]) -> Tensor:
    """The send buffer of a coalesced all-gather: the shards' bytes back to back (1D, uint8). Units of several
    dtypes (packed codes among numbers) then share one collective without a cast: [Note: packed parameters]."""
    return torch.cat([shard.reshape(-1).view(torch.uint8) for shard in shards])


@torch.no_grad()
def fill_from_gathered(units: Sequence[FlatUnit], out: Tensor, world_size: int) -> None:
    """Copy a coalesced all-gather into the units' full buffers: ``out`` (1D, uint8, see :func:`shard_bytes`) holds,
    for each rank in order, that rank's shards of ``units`` concatenated."""
    per_rank = out.numel() // world_size
    for r in range(world_size):
        offset = r * per_rank
        for unit in units:
            lo, hi = unit.spec.shard_range(r)
            nbytes = unit.spec.shard_numel * unit.flat_param.element_size()
            unit.flat_param[lo:hi].view(torch.uint8).copy_(out[offset : offset + nbytes])
            offset += nbytes
