"""Property-based tests (hypothesis) of the parts that take arbitrary input: the partition math, ``ZeroConfig`` and
the DeepSpeed translation. A fixed example budget and derandomized examples, so a CI run is reproducible and short;
a defect found is kept below as an explicit ``@example``."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lzero import ZeroConfig  # noqa: E402
from lzero.config import ZeroConfigError  # noqa: E402
from lzero.engine.partition import FROZEN, ParamSpec, Partition, partition_by_label, partition_by_size  # noqa: E402

BUDGET = settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
groups = st.sampled_from([(0, 0), (0, 1), (1, 0), FROZEN])


@st.composite
def param_specs(draw: st.DrawFn) -> list[ParamSpec]:
    count = draw(st.integers(1, 8))
    return [ParamSpec(f"p{i}", draw(shapes), draw(groups), draw(st.booleans())) for i in range(count)]


def check(partition: Partition, specs: list[ParamSpec]) -> None:
    """Every element of every parameter lies in exactly one unit and, within it, on exactly one rank; units are
    padded to a multiple of the world size by less than it and never mix param groups or compute dtypes."""
    n = partition.world_size
    seen = [p.name for u in partition.units for p in u.params]
    assert sorted(seen) == sorted(s.name for s in specs)
    for unit in partition.units:
        assert len({p.kind for p in unit.params}) == 1 and unit.group == unit.params[0].group
        assert unit.padded_numel % n == 0 and unit.numel <= unit.padded_numel < unit.numel + n
        assert [start for _, start, _ in unit.param_ranges()] == [sum(p.numel for p in unit.params[:i])
                                                                 for i in range(len(unit.params))]
        for spec in unit.params:
            covered = []
            for rank in range(n):
                lo, hi = unit.shard_range(rank)
                for piece, a, b, at in unit.owned_pieces(rank):
                    if piece.name == spec.name:
                        covered.append((a, b))
                        assert 0 <= at and at + (b - a) <= hi - lo
            covered.sort()
            assert sum(b - a for a, b in covered) == spec.numel  # disjoint pieces that add up to the parameter
            assert all(covered[i][1] == covered[i + 1][0] for i in range(len(covered) - 1))
            assert not covered or (covered[0][0] == 0 and covered[-1][1] == spec.numel)
    meta = partition.metadata()["params"]
    for spec in specs:
        ranks = meta[spec.name]["ranks"]
        assert sum(b - a for a, b in ranks.values()) == spec.numel


def reassemble(partition: Partition, shards: dict[tuple[int, int], list[float]]) -> dict[str, list[float]]:
    """Every parameter's values from the ranks' shards (as a checkpoint reader re-slices them)."""
    out = {}
    for unit in partition.units:
        for spec in unit.params:
            out[spec.name] = [math.nan] * spec.numel
        for rank in range(partition.world_size):
            for spec, a, b, at in unit.owned_pieces(rank):
                out[spec.name][a:b] = shards[(unit.index, rank)][at:at + b - a]
    return out


def shard(partition: Partition, values: dict[str, list[float]]) -> dict[tuple[int, int], list[float]]:
    shards = {}
    for unit in partition.units:
        flat = [0.0] * unit.padded_numel
        for spec, start, end in unit.param_ranges():
            flat[start:end] = values[spec.name]
        for rank in range(partition.world_size):
            lo, hi = unit.shard_range(rank)
            shards[(unit.index, rank)] = flat[lo:hi]
    return shards


@BUDGET
@given(param_specs(), st.integers(1, 8), st.integers(1, 60))
def test_partition_by_size_covers_every_element_once(specs: list[ParamSpec], world_size: int, bucket: int) -> None:
    partition = partition_by_size(specs, world_size, bucket)
    check(partition, specs)
    for unit in partition.units:  # a unit exceeds the bucket only by holding one parameter larger than it
        assert unit.numel <= bucket or len(unit.params) == 1


@BUDGET
@given(param_specs(), st.integers(1, 8), st.data())
def test_partition_by_label_covers_every_element_once(specs: list[ParamSpec], world_size: int, data: st.DataObject
                                                      ) -> None:
    labels = {s.name: data.draw(st.sampled_from(["", "blocks.0", "blocks.1"])) for s in specs}
    per_param = data.draw(st.booleans())
    partition = partition_by_label(specs, world_size, labels, per_param=per_param)
    check(partition, specs)
    roots = [u.index for u in partition.units if labels[u.params[0].name] == ""]
    assert roots == list(range(len(partition.units) - len(roots), len(partition.units)))  # the root units last
    for unit in partition.units:
        assert len({labels[p.name] for p in unit.params}) == 1
        assert not per_param or len(unit.params) == 1


@BUDGET
@given(param_specs(), st.integers(1, 8), st.integers(1, 8), st.integers(1, 60), st.integers(1, 60))
def test_reshard_round_trip(specs: list[ParamSpec], world_a: int, world_b: int, bucket_a: int, bucket_b: int) -> None:
    """Values sharded at one world size and bucket, re-sliced by parameter name, sharded at another: unchanged."""
    values = {s.name: [float(i * 100 + j) for j in range(s.numel)] for i, s in enumerate(specs)}
    a = partition_by_size(specs, world_a, bucket_a)
    back = reassemble(a, shard(a, values))
    assert back == values
    b = partition_by_label(specs, world_b, {s.name: "" for s in specs})
    assert reassemble(b, shard(b, back)) == values


FIELDS = sorted(ZeroConfig.__dataclass_fields__)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**10) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.sampled_from(["auto", "cpu", "nvme", "none", "sharded", "full", "device"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


@BUDGET
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=4))
@example({"unit_modules": True})  # found: a bare "'bool' object is not iterable", naming nothing
def test_zero_config_accepts_or_refuses_by_name(fields: dict) -> None:
    """Any keyword arguments: a configuration, or a ``ZeroConfigError`` / ``TypeError`` (an unknown keyword)
    naming what is wrong; never another exception."""
    try:
        ZeroConfig(**fields)
    except ZeroConfigError as err:
        assert any(f"`{key}" in str(err) or key in str(err) for key in fields) or "offload" in str(err), str(err)
    except TypeError as err:
        assert "unexpected keyword argument" in str(err) or any(key in str(err) for key in fields), str(err)


DS_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
           "fp16", "bf16", "zero_optimization", "optimizer", "scheduler", "activation_checkpointing",
           "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"]
ZERO_KEYS = ["stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
             "offload_optimizer", "offload_param", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
             "stage3_param_persistence_threshold", "sub_group_size"]


@st.composite
def deepspeed_configs(draw: st.DrawFn) -> dict:
    config = draw(st.dictionaries(st.sampled_from(DS_KEYS) | st.text(max_size=8), values, max_size=4))
    if draw(st.booleans()):
        config["zero_optimization"] = draw(st.dictionaries(st.sampled_from(ZERO_KEYS) | st.text(max_size=8), values,
                                                           max_size=4))
    return config


@BUDGET
@given(deepspeed_configs())
def test_deepspeed_translation_accepts_or_refuses_with_a_value_error(config: dict) -> None:
    """Any JSON-shaped DeepSpeed configuration: translated, or refused with a ``ValueError`` (lzero's
    ``DeepSpeedConfigError``/``ZeroConfigError``) or ``TypeError``; never another exception."""
    from lzero.deepspeed.config import translate

    try:
        translate(config)
    except (ValueError, TypeError) as err:
        assert str(err), type(err)


@st.composite
def damaged_files(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A valid shard file's bytes, and those bytes damaged: bytes overwritten (in the header mostly), cut short,
    grown, or replaced by arbitrary bytes."""
    import tempfile

    import torch

    from lzero.checkpoint.files import write_tensors

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/shard.safetensors"
        write_tensors(path, {"param/a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                             "param/b": torch.ones(4, dtype=torch.bfloat16), "step": torch.tensor(3)},
                      {"save_id": "s1", "rank": "0"})
        valid = open(path, "rb").read()
    how = draw(st.sampled_from(["overwrite", "truncate", "append", "arbitrary"]))
    if how == "arbitrary":
        return valid, draw(st.binary(max_size=300))
    if how == "truncate":
        return valid, valid[:draw(st.integers(0, len(valid) - 1))]
    if how == "append":
        return valid, valid + draw(st.binary(min_size=1, max_size=16))
    damaged = bytearray(valid)
    header_end = 8 + int.from_bytes(valid[:8], "little")
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, header_end - 1) | st.integers(0, len(valid) - 1))
        damaged[at] = draw(st.integers(0, 255))
    return valid, bytes(damaged)


@BUDGET
@given(damaged_files())
def test_a_damaged_shard_file_is_refused_by_name_or_reads_as_written(files: tuple[bytes, bytes]) -> None:
    """Opening and reading every tensor of a damaged shard file: ``CheckpointError`` naming the file, or (damage that
    leaves a well-formed file) its tensors with their declared shapes; never another exception or a hang."""
    import tempfile

    from lzero.checkpoint.files import CheckpointError, TensorFile

    _, damaged = files
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/shard.safetensors"
        open(path, "wb").write(damaged)
        try:
            file = TensorFile(path, save_id="s1")
            tensors = {name: file.read(name) for name in file.names}
        except CheckpointError as err:
            assert path in str(err)
            return
    for name, tensor in tensors.items():  # a renamed tensor parses: the manifest's coverage check refuses it
        assert tuple(tensor.shape) == tuple(file.entry(name).shape)


CHECKPOINT = Path(__file__).parent / "data" / "stop7_zero3_frozen.ckpt"


@functools.lru_cache(maxsize=1)
def _written() -> dict[str, torch.Tensor]:
    """CHECKPOINT's tensors as written: read through its undamaged manifest."""
    from lzero.checkpoint.reader import ShardedCheckpoint

    return ShardedCheckpoint(CHECKPOINT).full_state_dict()


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False)
                           | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def damaged_manifests(draw: st.DrawFn) -> bytes:
    """The committed manifest with a few values replaced by arbitrary JSON, or keys removed; or arbitrary bytes."""
    manifest = json.loads((CHECKPOINT / "manifest.json").read_text())
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(manifest)[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return json.dumps(manifest).encode()


def _manifest_with(**changes: Any) -> bytes:
    manifest = json.loads((CHECKPOINT / "manifest.json").read_text())
    for key, value in changes.items():
        if value is ...:
            del manifest[key]
        else:
            manifest[key] = value
    return json.dumps(manifest).encode()


@BUDGET
@given(damaged_manifests())
# found: each met as a bare TypeError or KeyError before the reader checked the manifest's fields
@example(_manifest_with(files=None))
@example(_manifest_with(params={"net.0.weight": {"shape": [32, 8]}}))
@example(_manifest_with(aliases=...))
@example(_manifest_with(state_dict_keys=[["net.0.weight"]]))
@example(_manifest_with(world_size="2"))
def test_a_damaged_manifest_is_refused_by_name_or_reads_as_written(manifest: bytes) -> None:
    """A checkpoint whose manifest.json is damaged: opening it and reading every tensor gives ``CheckpointError``
    naming the checkpoint or one of its files, or (damage the reader does not depend on) the checkpoint's tensors;
    never another exception."""
    import shutil
    import tempfile

    from lzero.checkpoint.files import CheckpointError
    from lzero.checkpoint.reader import ShardedCheckpoint

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "damaged.ckpt"
        shutil.copytree(CHECKPOINT, path)
        (path / "manifest.json").write_bytes(manifest)
        try:
            state = ShardedCheckpoint(path).full_state_dict()
        except CheckpointError as err:
            assert str(path) in str(err), err
            return
    written = _written()
    differ = [k for k, t in state.items()
              if k not in written or t.dtype != written[k].dtype or not torch.equal(t, written[k])]
    assert state and differ == [], f"read {sorted(state)}; not as written: {differ}"
