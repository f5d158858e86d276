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


def llama_block_specs() -> list[ParamSpec]:
    """One Llama block's matrices (hidden 32, intermediate 64, 4 heads of which 2 for keys and values) and norms."""
    shapes = {"q": (32, 32), "k": (16, 32), "v": (16, 32), "o": (32, 32), "gate": (64, 32), "up": (64, 32),
              "down": (32, 64), "norm1": (32,), "norm2": (32,)}
    return [ParamSpec(f"layers.{i}.{n}", s, (0, 0)) for i in range(4) for n, s in shapes.items()]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("by", ["size", "label"])
def test_per_tensor_units_hold_each_parameter_whole_on_one_rank(world_size: int, by: str) -> None:
    """[Note: per-tensor ownership]: every parameter lies whole in its owner's shard, every shard has one size, the
    rest of each shard is padding, and the layout is a pure function of names and shapes (every rank computes it)."""
    params = llama_block_specs()
    labels = {p.name: p.name.split(".")[1] for p in params}

    def make():
        if by == "size":
            return partition_by_size(params, world_size, max_unit_numel=4000, per_tensor=frozenset({(0, 0)}))
        return partition_by_label(params, world_size, labels, per_tensor=frozenset({(0, 0)}))

    part = make()
    assert part == make()
    seen = set()
    for unit in part.units:
        assert unit.per_tensor and len(unit.owners) == len(unit.params)
        assert unit.padded_numel == unit.shard_numel * world_size
        for rank in range(world_size):
            pieces = list(unit.owned_pieces(rank))
            owned = dict(unit.owned_params(rank))
            assert {p.name for p, *_ in pieces} == {p.name for p in owned}
            for spec, a, b, at in pieces:
                assert (a, b, at) == (0, spec.numel, owned[spec])  # whole, where owned_params says
                seen.add(spec.name)
            used = sum(b - a for _, a, b, _ in pieces) + sum(b - a for a, b in unit.padding(rank))
            assert used == unit.shard_numel
        assert json.loads(json.dumps(part.metadata()))["units"][unit.index]["owners"] == list(unit.owners)
    assert seen == {p.name for p in params}


def test_per_tensor_owners_balance_the_model() -> None:
    """Largest tensor first to the least loaded rank of the unit, ties to the least loaded of the model: over four
    blocks at world size 4 every rank owns the same number of elements."""
    part = partition_by_label(llama_block_specs(), 4, {p.name: p.name.split(".")[1] for p in llama_block_specs()},
                              per_tensor=frozenset({(0, 0)}))
    loads = [0] * 4
    for unit in part.units:
        for spec, owner in zip(unit.params, unit.owners):
            loads[owner] += spec.numel
    assert max(loads) / (sum(loads) / 4) < 1.05, loads


def test_elementwise_groups_keep_their_layout_beside_per_tensor_ones() -> None:
    params = specs()
    plain = partition_by_size(params, 3, max_unit_numel=20)
    mixed = partition_by_size(params, 3, max_unit_numel=20, per_tensor=frozenset({(0, 1)}))
    for a, b in zip(plain.units, mixed.units):
        assert (a.group == (0, 1)) == b.per_tensor
        if a.group != (0, 1):
            assert a == b
