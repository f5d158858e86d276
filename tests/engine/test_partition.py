"""Partition math: pure functions, no processes."""

from __future__ import annotations

import json

import pytest

from lzero.engine.partition import ParamSpec, partition_by_label, partition_by_size


def specs() -> list[ParamSpec]:
    return [
        ParamSpec("embed.weight", (10, 4), (0, 0)),
        ParamSpec("a.weight", (4, 4), (0, 0)),
        ParamSpec("a.bias", (4,), (0, 1)),
        ParamSpec("b.weight", (3, 4), (0, 0)),
        ParamSpec("b.bias", (3,), (0, 1)),
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_every_element_owned_exactly_once(world_size: int) -> None:
    part = partition_by_size(specs(), world_size, max_unit_numel=20)
    covered = {s.name: [0] * s.numel for s in specs()}
    for unit in part.units:
        assert unit.padded_numel % world_size == 0
        assert 0 <= unit.padded_numel - unit.numel < world_size
        assert len({p.group for p in unit.params}) == 1
        for rank in range(world_size):
            for spec, a, b, s in unit.owned_pieces(rank):
                assert 0 <= s and s + (b - a) <= unit.shard_numel
                for i in range(a, b):
                    covered[spec.name][i] += 1
    assert all(all(c == 1 for c in counts) for counts in covered.values())


def test_units_follow_backward_order_and_size_limit() -> None:
    part = partition_by_size(specs(), 2, max_unit_numel=20)
    first_names = [u.params[0].name for u in part.units]
    assert first_names[0] == "b.bias"  # the last registered parameter completes first in backward
    for unit in part.units:
        assert unit.numel <= 20 or len(unit.params) == 1  # a larger parameter forms its own unit
    assert [u.index for u in part.units] == list(range(len(part.units)))


def test_metadata_keyed_by_name_is_json_and_world_size_independent_in_content() -> None:
    meta2 = partition_by_size(specs(), 2, 20).metadata()
    meta3 = partition_by_size(specs(), 3, 20).metadata()
    json.dumps(meta2)
    assert meta2["params"].keys() == meta3["params"].keys() == {s.name for s in specs()}
    entry = meta2["params"]["embed.weight"]
    assert entry["shape"] == [10, 4] and entry["numel"] == 40
    covered = sorted(tuple(r) for r in entry["ranks"].values())
    assert covered[0][0] == 0 and covered[-1][1] == 40
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_deterministic() -> None:
    assert partition_by_size(specs(), 4, 16) == partition_by_size(list(specs()), 4, 16)


def test_duplicate_names_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        partition_by_size(specs() + [ParamSpec("a.bias", (4,), (0, 1))], 2, 20)


def test_find_unused_parameters_layouts_give_every_parameter_its_own_unit() -> None:
    """``find_unused_parameters``: units of one parameter, still in backward order (stages 1-2) and
    block order, root last (stage 3)."""
    by_size = partition_by_size(specs(), 2, max_unit_numel=1)
    assert [[p.name for p in u.params] for u in by_size.units] == [[n] for n in
                                                                   ("b.bias", "b.weight", "a.bias", "a.weight", "embed.weight")]
    labels = {"embed.weight": "", "a.weight": "a", "a.bias": "a", "b.weight": "b", "b.bias": "b"}
    by_label = partition_by_label(specs(), 2, labels, per_param=True)
    assert [[p.name for p in u.params] for u in by_label.units] == [["b.bias"], ["b.weight"], ["a.bias"], ["a.weight"],
                                                                   ["embed.weight"]]
    assert len(partition_by_label(specs(), 2, labels).units) == 5  # two groups per block: 2 + 2 + root
