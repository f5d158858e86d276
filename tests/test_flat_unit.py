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
