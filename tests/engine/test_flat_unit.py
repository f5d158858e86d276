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


def test_gradients_pack_rank_by_rank_into_a_shared_bucket() -> None:
    """A coalesced reduction's bucket holds every unit's rank-0 slice, then every unit's rank-1 slice, ...: each unit
    packs ``scale * grad`` straight into its columns. With 3 ranks a param crosses from one rank's shard into the
    next, a param without a gradient and the padding read zeros, and the result equals the units' own padded
    buckets laid side by side (the torch.cat the reducer used to do)."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 2), nn.Linear(2, 2)]  # 8 and 6 elements over 3 ranks: shards of 3 and 2, padding 1 and 0
    units = []
    for i, layer in enumerate(layers):
        specs = [ParamSpec(f"l{i}.{n}", tuple(p.shape), (0, 0)) for n, p in layer.named_parameters()]
        (spec,) = partition_by_label(specs, 3, {s.name: "l" for s in specs}).units
        units.append(FlatUnit(spec, list(layer.parameters()), rank=0, stage=2))
    grads = [[torch.randn(2, 3), None], [torch.randn(2, 2), torch.randn(2)]]
    expected = []
    for unit, layer, gs in zip(units, layers, grads):
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) * 0.25
                          for p, g in zip(layer.parameters(), gs)])
        expected.append(torch.cat([flat, torch.zeros(unit.spec.padded_numel - flat.numel())]).view(3, -1))
    for alone in (True, False):
        for layer, gs in zip(layers, grads):
            for p, g in zip(layer.parameters(), gs):
                p.grad = None if g is None else g.clone()
        if alone:
            for unit, want in zip(units, expected):
                assert torch.equal(unit.pack_grads(0.25), want.reshape(-1))
            continue
        rows = torch.full((3, 5), float("nan"))  # every element must be written
        units[0].pack_grads(0.25, out=rows[:, :3])
        units[1].pack_grads(0.25, out=rows[:, 3:])
        assert torch.equal(rows, torch.cat(expected, dim=1))
        assert all(p.grad is None for layer in layers for p in layer.parameters())  # the full gradients are released
