"""The pieces of [Note: tensor parallel under ZeRO] (lzero/engine/tensor_parallel.py) that one process can check: the
private attribute it relies on (a DTensor's ``_local_tensor``, which ``p.data = ...`` does not repoint), a unit's
flat buffer under a DTensor parameter, the data groups of every tensor coordinate, and DTensor parameters refused
where the strategy has no tensor dimension. tests/lightning/test_tensor_parallel.py runs the whole thing at world
sizes 2 and 4."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lzero import ZeroConfig
from lzero.engine import tensor_parallel
from lzero.engine.engine import ZeroEngine
from lzero.engine.mesh import Mesh, tensor_parallel_mesh
from lzero.errors import ZeroEngineError


@pytest.fixture
def tp_mesh(tmp_path: Path, in_process_fit):  # noqa: ANN201 - a DeviceMesh of one rank, ("data", "tensor")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    return tensor_parallel_mesh(1, "cpu")


def _parallel_linear(mesh) -> nn.Linear:  # noqa: ANN001
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    return parallelize_module(nn.Linear(4, 6), mesh["tensor_parallel"], ColwiseParallel())


def test_a_dtensor_reads_its_local_tensor_which_p_data_does_not_repoint(tp_mesh) -> None:  # noqa: ANN001
    """Pins the private attribute: if torch renames ``_local_tensor`` or makes ``p.data = ...`` repoint it, this fails
    first (FSDP2 repoints ``sharded_param._local_tensor`` the same way)."""
    from torch.distributed.tensor import DTensor

    layer = _parallel_linear(tp_mesh)
    weight, x = layer.weight, torch.randn(3, 4)
    assert isinstance(weight, DTensor) and isinstance(weight._local_tensor, torch.Tensor)
    before = weight._local_tensor
    weight.data = DTensor(torch.zeros_like(before), weight._spec, requires_grad=False)
    assert weight._local_tensor is before and before.abs().sum() > 0  # the wrapper changed, not the local tensor
    flat = torch.zeros(2 * weight._local_tensor.numel())
    tensor_parallel.repoint(weight, flat[: before.numel()].view(before.shape))
    flat[: before.numel()].copy_(before.reshape(-1))
    assert torch.allclose(layer(x), x @ before.T + layer.bias.full_tensor())  # the output: the local columns
    flat.zero_()  # the forward reads the flat buffer now
    assert torch.equal(layer(x), layer.bias.full_tensor().expand(3, 6))


def test_a_unit_holds_a_dtensor_by_its_local_tensor(tp_mesh) -> None:  # noqa: ANN001
    layer = _parallel_linear(tp_mesh)
    values = {n: p.full_tensor().clone() for n, p in layer.named_parameters()}
    engine = ZeroEngine(layer, [torch.optim.SGD(layer.parameters(), lr=0.1)], ZeroConfig(stage=2),
                        mesh=Mesh.of(device_mesh=tp_mesh))
    try:
        (unit,) = engine.units
        base = unit.flat_param.data_ptr()
        for name, p in layer.named_parameters():
            assert isinstance(p, torch.distributed.tensor.DTensor) and torch.equal(p.full_tensor(), values[name])
            offset = p._local_tensor.data_ptr() - base
            assert 0 <= offset < unit.flat_param.numel() * 4  # a view of the unit's buffer
        layer(torch.randn(3, 4)).sum().backward()
        engine.prepare_step(engine.units)
        assert unit.has_step_grad and engine.grad_norm(engine.units) > 0
    finally:
        engine.remove()


def test_a_released_dtensor_parameter_refuses_its_values_and_gets_its_class_back(tp_mesh) -> None:  # noqa: ANN001
    """Stage 3: between uses a DTensor parameter's local tensor is the placeholder, and its class guards it as
    ``ReleasedParameter`` guards a plain one, DTensor's own methods (``full_tensor``, ``to_local``, ``redistribute``)
    included; gathered, it is torch's DTensor again ([Note: released parameters are guarded])."""
    from torch.distributed.tensor import DTensor

    from lzero.engine.parameters import ReleasedParameterError

    layer = _parallel_linear(tp_mesh)
    want = layer(torch.ones(2, 4)).detach()
    model = nn.Sequential(layer)
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)],
                        ZeroConfig(stage=3, unit_modules=("Linear",)), mesh=Mesh.of(device_mesh=tp_mesh))
    try:
        weight = layer.weight
        assert isinstance(weight, DTensor) and type(weight) is not DTensor and weight.shape == (6, 4)
        for touch in (lambda: weight.full_tensor(), lambda: weight.to_local(), lambda: weight + 1,
                      lambda: weight.redistribute(placements=weight.placements), lambda: weight.detach().clone()):
            with pytest.raises(ReleasedParameterError, match=r"ZeRO-3 parameter `0.weight`.*HINT"):
                touch()
        assert torch.equal(model(torch.ones(2, 4)), want)  # the forward gathers it
        with engine.gathered(layer):
            assert type(layer.weight) is DTensor and torch.isfinite(layer.weight.full_tensor()).all()
        assert type(layer.weight) is not DTensor
    finally:
        engine.remove()


def test_dtensor_parameters_need_the_strategy_s_tensor_dimension(tp_mesh) -> None:  # noqa: ANN001
    layer = _parallel_linear(tp_mesh)
    with pytest.raises(ZeroEngineError, match=r"Parameter `weight` is a DTensor .* HINT: pass `tensor_parallel_size"):
        ZeroEngine(layer, [torch.optim.SGD(layer.parameters(), lr=0.1)], ZeroConfig(stage=2), mesh=Mesh.of())


def test_every_tensor_coordinate_has_its_data_group() -> None:
    """Rank r: tensor coordinate r % T, data coordinate r // T; every rank makes the groups of every data group."""
    mesh = Mesh(world=2, rank=0, local_world=4, shard_size=2, ranks=(1, 3), tensor_size=2)
    assert mesh.layers() == [(0, 2), (1, 3)]
    assert Mesh(world=2, rank=0, local_world=2, shard_size=2, ranks=(0, 1)).layers() == [(0, 1)]


@pytest.mark.parametrize("shape, dim, size", [((7, 5), 0, 2), ((6, 9), 1, 4), ((3, 4, 5), 1, 3), ((2, 3), 1, 4)])
def test_a_layout_s_runs_are_torch_s_chunks(shape: tuple, dim: int, size: int) -> None:
    """``TensorLayout`` cuts as ``torch.chunk`` does (empty trailing ranks included), and its runs map every element of
    a local tensor's flattened range to that element of the whole tensor ([Note: tensor-parallel checkpoints])."""
    from lzero.engine.tensor_layout import TensorLayout

    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    chunks = list(torch.chunk(whole, size, dim))
    chunks += [whole.narrow(dim, 0, 0)] * (size - len(chunks))
    layout = TensorLayout(shape, dim, size)
    flat = whole.reshape(-1)
    for rank, chunk in enumerate(chunks):
        assert layout.local_shape(rank) == tuple(chunk.shape)
        local = chunk.reshape(-1)
        for start, end in ((0, local.numel()), (1, max(local.numel() - 2, 1))):
            got = [flat[w : w + hi - lo] for lo, hi, w in layout.runs(rank, start, end)]
            assert torch.equal(torch.cat(got) if got else local[:0], local[start:end])
