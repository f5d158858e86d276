"""The one owner of a run's process groups: which ranks shard, replicate and talk together, each group made once.

[Note: the mesh]
A run's ranks form named dimensions, and every process group lzero uses is one of them, made by ``Mesh.group(name)``
on first request and handed out by name after that (nothing else in lzero calls ``dist.new_group``):

- ``world``: every rank of the run (the default group, or the group a caller passed in place of it).
- ``shard``: the G ranks that shard parameters, gradients and optimizer state together: every rank when flat, one
  node's when hybrid (``shard_group_size``; see [Note: hybrid sharding]).
- ``replicate``: hybrid only, the ranks holding the same shard, one per shard group (None when flat).
- ``gather``: the shard ranks again, on a communicator of their own: stage 3's parameter gathers follow
  forward/backward order while reductions follow unit order and are launched when ready, and on one group their
  interleaving would differ between ranks.
- ``unit_order``: the shard ranks on gloo with a short timeout, for the block-order check (unit_order.py).
- ``hpz``: hpZ's secondary partition, H consecutive ranks (a node; see [Note: hpZ] in hpz.py).
- ``flags``: every rank, for the tiny "was this unit used anywhere" all-reduces, which must not queue behind the
  reductions in flight on the main group.
- ``control``: every rank on gloo with a short timeout: "is every rank here?" before a collective that a failed rank
  would never join (a checkpoint after an exception, Fabric's checks).
- ``saver``: every rank on gloo, for the asynchronous checkpoint writer's commit, off the device's communicator.

Every rank makes every group of a dimension (``dist.new_group`` is a collective over the default group, even for
the groups a rank is not in), and the ranks ask for groups in the same order, since they run the same setup.
A group stays made until each of its requesters has destroyed it by name (``destroy``): the engine its ``gather``,
``unit_order`` and ``flags`` when it detaches, a strategy its ``control`` and ``saver`` at teardown; a later
request makes it afresh.
``LOCAL_WORLD_SIZE``, the ranks per node, is read here only (``local_world_size``).

[Note: the tensor dimension]
With ``tensor_parallel_size=T`` the run's N*T ranks form a 2-D torch ``DeviceMesh`` (``tensor_parallel_mesh``),
dimensions ``("data_parallel", "tensor_parallel")``, the tensor dimension innermost: rank r has tensor coordinate
r % T and data coordinate r // T, as torchtitan's ``ParallelDims`` and Lightning's ``ModelParallelStrategy`` lay
them out. The user's model is parallelized over the tensor dimension; lzero's mesh is then made over the
data-parallel group of this rank's tensor coordinate (``base``, ``tensor_size=T``), so ``world`` above is that
group's N ranks and every ZeRO collective runs over it. Since ``dist.new_group`` is a collective over the default
group, each named group is made for every tensor coordinate's data group alike (``layers``), this rank keeping its
own. ``tensor`` is this rank's tensor-parallel group (the DeviceMesh made it): the norm sums tensor-sharded
gradients over it (see [Note: tensor parallel under ZeRO] in tensor_parallel.py).

[Note: the pipeline dimension]
With ``pipeline_parallel_size=P`` the run's P*N*T ranks form a 3-D ``DeviceMesh``, dimensions ``("pipeline_parallel",
"data_parallel", "tensor_parallel")``, the pipeline dimension outermost (torchtitan's order): rank r is on pipeline
rank r // (N*T), so a stage's data and tensor ranks are consecutive (one node when they fit) and only the
activations between stages cross nodes. lzero's mesh is then made over this rank's data-parallel group, as under
tensor parallel, and ``layers`` lists one data group per (pipeline, tensor) coordinate. ``pipeline`` is this rank's
pipeline group, its P ranks in stage order: the schedule's sends and receives, and the step's agreements (the global
gradient norm, fp16 overflow, tied embeddings: see [Note: pipeline parallel under ZeRO] in pipeline.py), run over it.

[Note: hybrid sharding]
With ``shard_group_size=G`` the N ranks form N/G shard groups of G consecutive ranks (one node each, typically):
parameters, gradients and optimizer state are sharded within a group, as a flat run of world size G would shard
them, and replicated across the R = N/G groups. Within a group nothing changes: units padded to G, all-gathers and
reduce-scatters over the group's G ranks. A gradient is reduce-scattered within the group, then all-reduced across
the groups on the shard only (1/G of it), so the slow links between nodes carry a shard per step rather than the
whole model twice (MiCS, arXiv 2205.00119; FSDP2's HSDP). Every rank divides by N before summing, as DDP does, so
the sum of both reductions is DDP's average in another order: equal within rounding. What must agree across every
rank (the initial weights of an eager model, the seed of a block-wise initialization, the replay's RNG state)
is broadcast over the whole world; checkpoints are written by group 0 alone, in the flat format of world size G, so
they resume flat or hybrid at any world size.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import torch.distributed as dist

from lzero.config import ZeroConfigError

_WORLD, _SHARD, _REPLICATE, _HPZ = "world", "shard", "replicate", "hpz"

GROUPS: dict[str, tuple[str, Optional[str]]] = {  # name: (the dimension it spans, its backend; None: the default's)
    "shard": (_SHARD, None),
    "replicate": (_REPLICATE, None),
    "gather": (_SHARD, None),
    "unit_order": (_SHARD, "gloo"),
    "hpz": (_HPZ, None),
    "flags": (_WORLD, None),
    "control": (_WORLD, "gloo"),
    "saver": (_WORLD, "gloo"),
}
"""The groups a mesh makes, by name. See [Note: the mesh]."""


def local_world_size(default: int) -> int:
    """The ranks on this node: ``LOCAL_WORLD_SIZE`` as torchrun and Lightning's launchers set it, else ``default``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _default_group() -> Any:
    world = dist.GroupMember.WORLD if _initialized() else None
    return weakref.ref(world) if world is not None else None


@dataclass(eq=False)
class Mesh:
    """This rank's place among the run's ranks and the process groups made over them. See [Note: the mesh]."""

    world: int  # N
    rank: int  # this rank's index among the N
    local_world: int  # ranks per node
    shard_size: int  # G: N when flat
    hpz_size: int = 1  # H: 1 when hpZ is off, or when its partition is the whole shard group
    base: Any = None  # the group of the N ranks; None: the default group
    ranks: tuple[int, ...] = ()  # the N ranks' global ranks, in order
    default: Any = None  # a weak reference to the default process group this mesh was made in (None: no group);
    # weak, since a strong one would keep a destroyed group's connections open, and a peer blocked in a collective
    # with this rank would then wait for the process to exit ([Note: the misuse named on every rank])
    tensor_size: int = 1  # T: the ranks of a tensor-parallel group; see [Note: the tensor dimension]
    tensor: Any = None  # this rank's tensor-parallel group (None: T = 1)
    pipeline_size: int = 1  # P: the pipeline's ranks; see [Note: the pipeline dimension]
    pipeline: Any = None  # this rank's pipeline group, its ranks in stage order (None: P = 1)
    _made: dict[str, Any] = field(default_factory=dict, repr=False)
    _users: dict[str, int] = field(default_factory=dict, repr=False)  # requests not yet followed by a destroy

    @classmethod
    def of(cls, shard_group_size: Union[int, str, None] = None, hpz_partition_size: Union[int, str] = 1,
           base: Any = None, device_mesh: Any = None) -> "Mesh":
        """The mesh of the current process group (``base``: a group in place of the default one). A plain process,
        without ``torch.distributed``, is a mesh of one rank. ``device_mesh``: a 2-D ``tensor_parallel_mesh``; the
        mesh is then its data-parallel group's (see [Note: the tensor dimension]); a 3-D one's too (see [Note: the
        pipeline dimension])."""
        tensor_size = device_mesh["tensor_parallel"].size() if device_mesh is not None else 1
        names = device_mesh.mesh_dim_names if device_mesh is not None else ()
        pipeline_size = device_mesh["pipeline_parallel"].size() if "pipeline_parallel" in names else 1
        if device_mesh is not None:
            base = device_mesh["data_parallel"].get_group()
        if _initialized():
            world, rank = dist.get_world_size(base), dist.get_rank(base)
            ranks = tuple(dist.get_process_group_ranks(base)) if base is not None else tuple(range(world))
        else:
            world, rank, ranks = 1, 0, (0,)
        # a node's data-parallel ranks: its ranks over the tensor size (a tensor group lies within a node)
        local = max(local_world_size(world * tensor_size * pipeline_size) // tensor_size, 1)
        shard = world if shard_group_size is None else local if shard_group_size == "node" else int(shard_group_size)
        if shard <= 0 or world % shard:
            raise ZeroConfigError(
                f"`shard_group_size={shard_group_size!r}` ({shard} ranks per shard group) does not divide the world"
                f" size {world}. HINT: use a divisor of {world} (the ranks per node, typically), or drop it to shard"
                " over every rank.")
        hpz = local if hpz_partition_size == "node" else int(hpz_partition_size)
        if hpz > 1 and world % hpz:
            raise ZeroConfigError(
                f"`hpz_partition_size={hpz}` does not divide the world size {world}. HINT: use the ranks per node,"
                f" a divisor of {world}.")
        if hpz >= world:  # one node: the primary gather is the node's already
            hpz = 1
        mesh = cls(world, rank, local, shard, max(hpz, 1), base, ranks, _default_group())
        mesh.tensor_size = tensor_size
        if device_mesh is not None and (tensor_size > 1 or pipeline_size == 1):  # a 3-D mesh's T = 1: no tensor group
            mesh.tensor = device_mesh["tensor_parallel"].get_group()
        if pipeline_size > 1:
            mesh.pipeline_size = pipeline_size
            mesh.pipeline = device_mesh["pipeline_parallel"].get_group()
        return mesh

    def current(self) -> bool:
        """Whether the process group this mesh was made in is still the default one (a strategy that outlives a
        ``destroy_process_group`` makes a new mesh)."""
        now = dist.GroupMember.WORLD if _initialized() else None
        return now is None if self.default is None else now is not None and self.default() is now

    @property
    def hybrid(self) -> bool:
        """Shard groups smaller than the world, replicated across it."""
        return self.shard_size < self.world

    @property
    def replicas(self) -> int:
        """R = N / G."""
        return self.world // self.shard_size

    @property
    def replica_index(self) -> int:
        """Which shard group this rank is in (0: the one that writes checkpoints)."""
        return self.rank // self.shard_size

    @property
    def shard_rank(self) -> int:
        """This rank's index within its shard group."""
        return self.rank % self.shard_size

    @property
    def hpz_rank(self) -> int:
        """This rank's index within its hpZ partition."""
        return self.rank % self.hpz_size

    def partition(self, dim: str) -> list[list[int]]:
        """The groups of ranks (indices among the N) that ``dim`` divides the world into."""
        n, g, h = self.world, self.shard_size, self.hpz_size
        if dim == _WORLD:
            return [list(range(n))]
        if dim == _SHARD:
            return [list(range(i * g, (i + 1) * g)) for i in range(n // g)]
        if dim == _REPLICATE:
            return [list(range(r, n, g)) for r in range(g)]
        if dim == _HPZ:
            return [list(range(i * h, (i + 1) * h)) for i in range(n // h)]
        raise ValueError(f"no dimension {dim!r}; the mesh has {[_WORLD, _SHARD, _REPLICATE, _HPZ]}")

    def layers(self) -> list[tuple[int, ...]]:
        """The global ranks of every data-parallel group like this mesh's, one per (pipeline, tensor) coordinate (this
        mesh's own alone when T = P = 1): every rank makes every group of a dimension in each of them."""
        t_size, p_size = self.tensor_size, self.pipeline_size
        if t_size == 1 and p_size == 1:
            return [self.ranks]
        per_stage = self.world * t_size  # the ranks of one pipeline stage: data x tensor
        return [tuple(p * per_stage + i * t_size + t for i in range(self.world))
                for p in range(p_size) for t in range(t_size)]

    def group(self, name: str, timeout_s: Optional[float] = None) -> Any:
        """The named process group of this rank (see ``GROUPS``), made on first request; a collective then.
        ``timeout_s``: the group's timeout, when this request makes it. ``world`` is the base group; ``shard`` is
        it too when flat; ``replicate`` (flat) and ``hpz`` (off) are None, and a side group of this rank alone is the
        base group (of one rank: its collectives are local copies; a process without a process group: None)."""
        if name == _WORLD:
            return self.base
        if name not in GROUPS:
            raise ValueError(f"no process group {name!r}; the mesh makes {sorted(GROUPS)} and {_WORLD!r}")
        if name in self._made:
            self._users[name] += 1
            return self._made[name]
        dim, backend = GROUPS[name]
        size = len(self.partition(dim)[0])
        if name == "shard" and not self.hybrid:
            return self.base  # flat: the run's own group shards
        if name == "gather" and size == 1:
            return self.group("shard")  # a group of one: local copies
        if name == "replicate" and not self.hybrid or name == "hpz" and size == 1:
            return None  # flat, or hpZ off
        if size == 1 and name not in ("shard", "replicate"):  # a side group of this rank alone: local copies
            # None would be the default group: every rank of the run under tensor or pipeline parallel, whose other
            # coordinates run other collectives (another pipeline stage's schedule); the base group is this rank's
            return self.base
        mine = None
        options: dict[str, Any] = {} if backend is None else {"backend": backend}
        if timeout_s is not None:
            options["timeout"] = timedelta(seconds=timeout_s)
        for layer in self.layers():
            for indices in self.partition(dim):
                made = dist.new_group([layer[i] for i in indices], **options)
                if layer == self.ranks and self.rank in indices:
                    mine = made
        self._made[name], self._users[name] = mine, 1
        return mine

    def pipeline_ends(self) -> Any:
        """Pipeline parallel: the data ranks of the first and the last stage at this rank's tensor coordinate, the
        group over which a parameter both stages hold (embeddings tied to the head) sums its gradients. Made once, a
        collective over every rank (one group per tensor coordinate); None without a pipeline."""
        if self.pipeline_size == 1:
            return None
        if "pipeline_ends" not in self._made:
            layers = self.layers()
            mine = None
            for t in range(self.tensor_size):
                ranks = sorted(layers[t] + layers[(self.pipeline_size - 1) * self.tensor_size + t])
                made = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = made
            self._made["pipeline_ends"], self._users["pipeline_ends"] = mine, 1
        return self._made["pipeline_ends"]

    def made(self, name: str) -> bool:
        """Whether the named group is made and alive (it has not been destroyed since)."""
        return self._made.get(name) is not None

    def destroy(self, *names: str) -> None:
        """Each named group's requester is done with it: the group is destroyed once every request has been followed
        by a destroy (two engines of one Fabric share a ``gather`` group; the first to detach leaves it to the
        other); a later ``group`` makes it afresh. Names never made are skipped. Waits for no other rank, so only for
        groups with nothing pending on them."""
        for name in names:
            if name not in self._made:
                continue
            self._users[name] -= 1
            if self._users[name] == 0:
                made = self._made.pop(name)
                del self._users[name]
                if made is not None:
                    dist.destroy_process_group(made)


def tensor_parallel_mesh(tensor_parallel_size: int, device_type: str, pipeline_parallel_size: int = 1) -> Any:
    """The run's ``DeviceMesh``: 2-D, ``("data_parallel", "tensor_parallel")``, the tensor dimension innermost (see
    [Note: the tensor dimension]); with a pipeline, 3-D, ``("pipeline_parallel", "data_parallel",
    "tensor_parallel")``, the pipeline dimension outermost (see [Note: the pipeline dimension]). A collective: every
    rank makes every group of every dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size() if _initialized() else 1
    if world % pipeline_parallel_size:
        raise ZeroConfigError(
            f"`pipeline_parallel_size={pipeline_parallel_size}` does not divide the world size {world}. HINT: use a"
            f" divisor of {world}, or 1 for no pipeline.")
    per_stage = world // pipeline_parallel_size
    if per_stage % tensor_parallel_size:
        over = f" over `pipeline_parallel_size={pipeline_parallel_size}`" if pipeline_parallel_size > 1 else ""
        raise ZeroConfigError(
            f"`tensor_parallel_size={tensor_parallel_size}` does not divide the {per_stage} ranks of the world size"
            f" {world}{over}. HINT: use a divisor of {per_stage} (the ranks of one node, typically), or 1 for no"
            " tensor parallel.")
    if pipeline_parallel_size == 1:
        return init_device_mesh(device_type, (world // tensor_parallel_size, tensor_parallel_size),
                                mesh_dim_names=("data_parallel", "tensor_parallel"))
    shape = (pipeline_parallel_size, per_stage // tensor_parallel_size, tensor_parallel_size)
    names = ("pipeline_parallel", "data_parallel", "tensor_parallel")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
