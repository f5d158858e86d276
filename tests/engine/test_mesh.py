"""The mesh (lzero/engine/mesh.py): the one owner of the run's process groups. Which ranks each named group spans,
that each is made once and handed out by name, and that nothing else in lzero makes a group or reads the ranks per
node. ``dist.new_group`` is recorded in place of a process group (every rank makes every group of a dimension, so
one rank's calls show the whole partition)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

from lzero.config import ZeroConfigError
from lzero.engine import mesh as mesh_module
from lzero.engine.mesh import GROUPS, Mesh

PACKAGE = Path(__file__).resolve().parents[2] / "lzero"


class Recorded:
    """What ``dist.new_group`` was asked for, in order; each call returns a token naming its ranks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[list[int], dict]] = []
        self.destroyed: list[str] = []
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroyed.append)

    def new_group(self, ranks: list[int], **options) -> str:
        self.calls.append((list(ranks), options))
        return f"group{len(self.calls)}:{ranks}"


def test_dimensions_partition_the_world() -> None:
    mesh = Mesh(world=8, rank=5, local_world=4, shard_size=4, hpz_size=1, ranks=tuple(range(8)))
    assert mesh.partition("world") == [list(range(8))]
    assert mesh.partition("shard") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.partition("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (mesh.hybrid, mesh.replicas, mesh.replica_index, mesh.shard_rank) == (True, 2, 1, 1)
    hpz = Mesh(world=8, rank=5, local_world=4, shard_size=8, hpz_size=2, ranks=tuple(range(8)))
    assert hpz.partition("hpz") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (hpz.hybrid, hpz.hpz_rank) == (False, 1)


def test_each_group_is_made_once_and_handed_out_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Recorded(monkeypatch)
    mesh = Mesh(world=4, rank=2, local_world=2, shard_size=2, hpz_size=1, ranks=tuple(range(4)))
    shard = mesh.group("shard")
    assert made.calls == [([0, 1], {}), ([2, 3], {})]  # every rank makes every shard group; rank 2 keeps [2, 3]
    assert shard == "group2:[2, 3]" and mesh.group("shard") is shard and len(made.calls) == 2
    assert mesh.group("replicate") == "group3:[0, 2]"  # rank 2 holds shard 0 of group 1
    assert made.calls[2:] == [([0, 2], {}), ([1, 3], {})]
    control = mesh.group("control", timeout_s=7)
    assert made.calls[-1][0] == [0, 1, 2, 3] and made.calls[-1][1]["backend"] == "gloo"
    assert made.calls[-1][1]["timeout"].total_seconds() == 7
    assert mesh.group("world") is None and mesh.group("hpz") is None  # the default group; hpZ off
    assert mesh.group("control") is control and len(made.calls) == 5


def test_a_group_goes_when_its_last_requester_destroys_it(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Recorded(monkeypatch)
    mesh = Mesh(world=2, rank=0, local_world=2, shard_size=2, ranks=(0, 1))
    first = mesh.group("gather")  # two engines of one Fabric share it
    assert mesh.group("gather") is first and len(made.calls) == 1
    mesh.destroy("gather")
    assert made.destroyed == [] and mesh.made("gather")
    mesh.destroy("gather", "flags")  # flags never made: skipped
    assert made.destroyed == [first] and not mesh.made("gather")
    assert mesh.group("gather") != first and len(made.calls) == 2  # made afresh


def test_flat_and_single_rank_meshes_make_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Recorded(monkeypatch)
    flat = Mesh(world=2, rank=1, local_world=2, shard_size=2, ranks=(0, 1))
    assert flat.group("shard") is None and flat.group("replicate") is None  # the default group shards
    solo = Mesh.of()  # no process group: one rank
    assert (solo.world, solo.rank, solo.shard_size, solo.hpz_size) == (1, 0, 1, 1)
    for name in GROUPS:
        assert solo.group(name) is None, name
    assert made.calls == []


def test_sizes_are_checked_against_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_module, "_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 6)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    node = Mesh.of("node", "node")
    assert (node.world, node.rank, node.shard_size, node.hpz_size, node.local_world) == (6, 4, 3, 3, 3)
    with pytest.raises(ZeroConfigError, match=r"shard_group_size=4.*does not divide the world size 6.*HINT"):
        Mesh.of(4)
    with pytest.raises(ZeroConfigError, match=r"hpz_partition_size=4.*does not divide the world size 6.*HINT"):
        Mesh.of(None, 4)
    assert Mesh.of(None, 6).hpz_size == 1  # one node: the primary gather is the node's already


def test_only_the_mesh_makes_groups_or_reads_the_ranks_per_node() -> None:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        for pattern in (r"\bnew_group\(", r"[\"']LOCAL_WORLD_SIZE[\"']"):
            if re.search(pattern, code):
                found.setdefault(pattern, set()).add(path.relative_to(PACKAGE).as_posix())
    assert found == {r"\bnew_group\(": {"engine/mesh.py"}, r"[\"']LOCAL_WORLD_SIZE[\"']": {"engine/mesh.py"}}


def test_a_mesh_knows_when_its_process_group_is_gone(tmp_path: Path, in_process_fit) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh = Mesh.of()
    assert mesh.current() and (mesh.world, mesh.rank) == (1, 0)
    dist.destroy_process_group()
    assert not mesh.current()  # a strategy outliving its process group makes a new mesh (the doors' _run_mesh)
    assert Mesh.of().current()
