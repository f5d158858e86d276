"""One stage-3 unit's storage on one rank, without a process group: released and re-attached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lzero.engine.flat_unit import FlatUnit
from lzero.engine.partition import ParamSpec, partition_by_label


def stage3_unit() -> tuple[FlatUnit, nn.Linear]:
    layer = nn.Linear(3, 2)
    specs = [ParamSpec(f"layer.{n}", tuple(p.shape), (0, 0)) for n, p in layer.named_parameters()]
    (spec,) = partition_by_label(specs, 1, {s.name: "layer" for s in specs}).units
    return FlatUnit(spec, list(layer.parameters()), rank=0, stage=3), layer


def test_released_parameters_keep_real_sizes() -> None:
    unit, layer = stage3_unit()
    unit.release()
    assert not unit.gathered
    assert [p.shape for p in layer.parameters()] == [torch.Size([2, 3]), torch.Size([2])]
    assert sum(p.numel() for p in layer.parameters()) == 8


@pytest.mark.parametrize("action", ["attach", "hand_back"])
def test_a_released_unit_refuses_views_of_its_freed_buffer(action: str) -> None:
    # views of a storage resized to zero read freed memory: the end-of-fit hand-back segfaulted
    unit, layer = stage3_unit()
    expected = [p.detach().clone() for p in layer.parameters()]
    unit.release()
    with pytest.raises(RuntimeError, match=r"Cannot .* unit holding layer.weight, layer.bias: its full buffer is released"):
        getattr(unit, action)()
    unit.allocate()
    unit.flat_param.copy_(unit.compute_shard())  # world size 1: the shard is the whole unit
    unit.attach()
    unit.hand_back()
    assert all(torch.equal(p, e) for p, e in zip(layer.parameters(), expected))


def test_stage1_gradients_accumulate_in_the_flat_buffer_and_unused_ones_stay_none() -> None:
    """Stage 1 gives each parameter its view of the flat gradient as a backward starts (autograd accumulates in
    place, no copy) and takes back the views no gradient reached: over two micro-batches every gradient equals
    the plain model's bitwise, a layer used only in the second reads None after the first, and one never used
    reads None throughout, as under torch."""
    from lzero import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    plain = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "never": nn.Linear(4, 4)})
    sharded = nn.ModuleDict({k: nn.Linear(4, 4) for k in plain})
    sharded.load_state_dict(plain.state_dict())
    engine = ZeroEngine(sharded, [torch.optim.SGD(sharded.parameters(), lr=0.1)], ZeroConfig(stage=1))
    (unit,) = engine.units
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    plain["a"](x1).square().sum().backward()
    with engine.no_sync():  # an accumulating micro-batch, as Lightning runs it
        sharded["a"](x1).square().sum().backward()
    assert sharded["b"].weight.grad is None and sharded["never"].weight.grad is None
    for model in (plain, sharded):
        model["b"](model["a"](x2)).square().sum().backward()
    index = {id(p): i for i, p in enumerate(unit.params)}
    for name, p in sharded.named_parameters():
        ref = dict(plain.named_parameters())[name].grad
        if ref is None:
            assert p.grad is None, name
        else:
            assert torch.equal(p.grad, ref), name
            assert p.grad.data_ptr() == unit.grad_view(index[id(p)]).data_ptr(), name
