"""Tensor-parallel parameters under ZeRO: DTensor parameters flattened by their local tensors.

[Note: tensor parallel under ZeRO]
With ``tensor_parallel_size=T`` the N*T ranks form a 2-D mesh, data x tensor, the tensor dimension innermost (rank r
has tensor coordinate r % T and data coordinate r // T; see ``tensor_parallel_mesh`` in mesh.py). The user's
``configure_model`` parallelizes the model over the tensor dimension (``parallelize_module(model,
device_mesh["tensor_parallel"], plan)``, as under Lightning's ``ModelParallelStrategy``), or the strategy does from
``tp_plan`` (see [Note: the tensor-parallel plan] in tensor_parallel_plan.py): its parameters become
DTensors, each rank holding a local tensor (a shard for ``Shard`` placements, the whole value for ``Replicate``).
ZeRO then runs over the data-parallel group of the rank's tensor coordinate only (the engine's mesh is built over
that group), exactly as over a one-dimensional world, with these differences, which this module holds:

- a DTensor parameter is flattened by its local tensor: the unit's flat buffer holds the local values, and the
  parameter's local tensor becomes the view of the buffer (``_local_tensor``, a private attribute that FSDP2
  repoints too: ``p.data = ...`` on a DTensor changes the wrapper's metadata, not the local tensor its operations
  read; tests/engine/test_tensor_parallel_parameters.py pins both facts);
- its gradient is a DTensor whose local tensor is read. A gradient that comes back with other placements than the
  parameter's (``Partial(sum)`` for the weights of ``SequenceParallel`` norms) is completed over the tensor group
  first (``complete_grad``), before the data-parallel reduction. At stage 1 the gradient given to autograd is a
  DTensor over the view of the flat gradient with the parameter's placements, and autograd's in-place accumulation
  completes a partial gradient itself;
- the global gradient norm counts the squares of tensor-sharded parameters summed over the tensor group, and those
  of tensor-replicated parameters (all ``Replicate``, or plain tensors) once (``ZeroEngine.grad_norm``);
- at stage 3 a unit's full buffer is the concatenation of its parameters' local tensors, gathered over the data
  group: an all-gather moves 1/T of what it would without tensor parallel. Gathering repoints each local tensor into
  it, releasing repoints it to the placeholder of the local shape, and the released parameter's class is a guarded
  DTensor (see [Note: released parameters are guarded] in parameters.py). Gradients read at the end of a block's
  backward are completed as above. Offload (host or NVMe stores) and hybrid sharding hold shards of the flat buffer
  and so need nothing more.

In bf16-mixed a unit's flat buffer holds the bf16 compute copies: ``repoint`` makes the DTensor's wrapper and spec say
the local tensor's dtype too (a DTensor's dtype is its wrapper's, fixed when made), so autocast and the plan's
operations see a bf16 parameter, as without tensor parallel, and the fp32 masters handed back at the end of fit make
it fp32 again. Not built yet: fp16 (its overflow would have to be agreed over the tensor ranks) and bf16-true.
Checkpoints: [Note: tensor-parallel checkpoints] in tensor_layout.py.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lzero.engine.tensor_layout import TensorLayout
from lzero.errors import ZeroConfigError, ZeroEngineError


_DTENSOR: list[type] = []  # torch's DTensor class, once its module is loaded (asked at every gather and release)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (imported only once torch's distributed tensor is loaded: none before)."""
    if not _DTENSOR:
        if "torch.distributed.tensor" not in sys.modules:
            return False
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])


def local(t: Tensor) -> Tensor:
    """The tensor whose values this rank holds: a DTensor's local tensor, any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def local_shape(p: Tensor) -> tuple[int, ...]:
    """The shape a unit lays ``p`` out in: its local tensor's."""
    return tuple(local(p).shape)


def repoint(p: nn.Parameter, view: Tensor) -> None:
    """``p`` holds ``view`` (the shape of its local tensor) from now on: a DTensor's local tensor is ``view``, any other
    parameter's ``.data``. A DTensor whose dtype ``view`` changes (16-bit compute copies, fp32 handed back at the end)
    takes it in its wrapper and its spec too, so that autocast and the plan's operations see the local tensor's dtype.
    See [Note: tensor parallel under ZeRO]."""
    if not is_dtensor(p):
        p.data = view
        return
    if view.dtype != p._spec.tensor_meta.dtype:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = p._spec.tensor_meta
        spec = DTensorSpec(p._spec.mesh, p._spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, view.dtype))
        with torch._C.DisableTorchFunctionSubclass():  # a released parameter's guard would refuse the write
            p.data = DTensor(view, spec, requires_grad=False)  # the wrapper's dtype (its local tensor: below)
        p._spec = spec
    p._local_tensor = view


def as_grad(p: nn.Parameter, view: Tensor) -> Tensor:
    """``view`` (the shape of ``p``'s local tensor) as a gradient autograd accepts for ``p``: a DTensor with ``p``'s
    placements over it for a DTensor parameter."""
    if not is_dtensor(p):
        return view
    from torch.distributed.tensor import DTensor

    return DTensor(view, p._spec, requires_grad=False)


def complete_grad(grad: Optional[Tensor], p: nn.Parameter) -> Optional[Tensor]:
    """``grad`` with ``p``'s placements: a ``Partial`` gradient summed over the tensor group (a collective over that
    group), any other returned as it is. None stays None."""
    if grad is None or not is_dtensor(grad) or tuple(grad.placements) == tuple(p.placements):
        return grad
    return grad.redistribute(placements=p.placements)


def layouts(params: dict[str, nn.Parameter]) -> dict[str, TensorLayout]:
    """The tensor-sharded parameters among ``params`` (by name), each with where its local tensors lie in it (see
    [Note: tensor-parallel checkpoints] in tensor_layout.py): their values differ between the ranks of a tensor group,
    so their squares sum over the group in a norm, where a replicated parameter counts once. A placement other than
    ``Shard``/``Replicate``, or a local tensor cut otherwise than torch's even chunks, is refused by name."""
    out = {}
    for name, p in params.items():
        if not is_dtensor(p) or all(placement.is_replicate() for placement in p.placements):
            continue
        (placement,) = p.placements  # one dimension: check_parameters
        if not placement.is_shard() or type(placement).__name__ != "Shard":
            raise ZeroEngineError(
                f"Parameter `{name}` is a DTensor placed {placement} over the tensor dimension: lzero shards"
                " parameters placed `Shard(dim)` or `Replicate()`. HINT: use torch's ColwiseParallel/RowwiseParallel/"
                "SequenceParallel styles (or `tp_plan`), which place parameters so.")
        layout = TensorLayout(tuple(p.shape), placement.dim, p.device_mesh.size())
        rank = p.device_mesh.get_local_rank()
        if tuple(local(p).shape) != layout.local_shape(rank):
            raise ZeroEngineError(
                f"Parameter `{name}`: tensor rank {rank} holds a local tensor of shape {tuple(local(p).shape)}, where"
                f" torch's chunks of {tuple(p.shape)} over dim {placement.dim} give {layout.local_shape(rank)}."
                " HINT: distribute it with `distribute_tensor`/`parallelize_module`, not a hand-made DTensor.")
        out[name] = layout
    return out


def check_tensor_parallel_precision(size: int, precision: str) -> None:
    """Tensor parallel runs in ``32-true`` and ``bf16-mixed``; another precision is refused by name (16-mixed's loss
    scaling would need an overflow agreed over the tensor ranks too; bf16-true is not tested under it)."""
    if precision not in ("32-true", "bf16-mixed"):
        raise ZeroConfigError(f"`tensor_parallel_size={size}` with precision={precision!r}: tensor parallel runs in"
                              " '32-true' and 'bf16-mixed' so far. HINT: `precision='bf16-mixed'` (or '32-true'), or"
                              " `tensor_parallel_size=1`.")


def check_same_inputs(batch: Any, tensor_group: Any, device: Any) -> None:
    """Refuse by name a batch that differs between the ranks of ``tensor_group`` (a collective over it): the ranks of
    a tensor group compute one model on one batch, and with different inputs their partial sums mix samples without an
    error (DeepSpeed AutoTP checks its inputs so too). Its tensors' dtypes, shapes and bytes are hashed on the host;
    run once, at the first training step."""
    import hashlib

    import torch.distributed as dist
    from torch.utils._pytree import tree_flatten

    from lzero.engine import collectives

    digest = hashlib.sha256()
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, Tensor):
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    mine = torch.tensor([int.from_bytes(digest.digest()[:7], "little")], dtype=torch.int64, device=device)
    size = collectives.world_size(tensor_group)
    every = torch.empty(size, dtype=torch.int64, device=device)
    collectives.all_gather(every, mine, tensor_group)
    if len(set(every.tolist())) > 1:
        ranks = dist.get_process_group_ranks(tensor_group)
        raise ZeroEngineError(
            f"The tensor-parallel ranks {ranks} got different batches at the first training step: the ranks of a"
            " tensor group compute one model on one batch, so each must see the batch of its data-parallel rank."
            " HINT: keep Lightning's distributed sampler (`Trainer(use_distributed_sampler=True)`, the default: it"
            " uses `strategy.distributed_sampler_kwargs`, the data-parallel rank and size), or give your sampler"
            " `num_replicas=trainer.strategy.distributed_sampler_kwargs['num_replicas']` and `rank=...['rank']`, and"
            " draw random inputs from a generator seeded alike on every tensor rank.")


def check_parameters(module: nn.Module, tensor_group: Any) -> bool:
    """Whether ``module`` holds DTensor parameters, each on the run's tensor-parallel mesh (one dimension over
    ``tensor_group``); refused by name otherwise, and where the run has no tensor dimension (``tensor_group`` None)."""
    found = False
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            continue
        found = True
        mesh = p.device_mesh
        if tensor_group is None:
            raise ZeroEngineError(
                f"Parameter `{name}` is a DTensor (placements {tuple(p.placements)}), and the strategy has no tensor"
                " dimension: ZeRO would shard it over ranks that hold different pieces of it. HINT: pass"
                " `tensor_parallel_size=T` to the strategy and parallelize with"
                " `parallelize_module(..., self.device_mesh['tensor_parallel'], plan)` in `configure_model`.")
        if mesh.ndim != 1 or _ranks(mesh.get_group()) != _ranks(tensor_group):
            raise ZeroEngineError(
                f"Parameter `{name}` is a DTensor over the mesh {mesh}, not the strategy's tensor-parallel mesh of"
                f" {len(_ranks(tensor_group))} ranks. HINT: parallelize with `parallelize_module(..., self.device_mesh"
                "['tensor_parallel'], plan)` (one dimension; ZeRO shards over 'data_parallel' itself).")
    return found



def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)
