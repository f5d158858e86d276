"""Checkpoint file formats: tensor files, the tree codec, the manifest, the streaming writers.

References: the input tensors and trees themselves, slicing of the flattened tensor, torch.save /
torch.load, draws from the original RNG states, and (when installed) the `safetensors` package.
"""

from __future__ import annotations

import argparse
import collections
import enum
import json
import math
import os
import pathlib
import pickle
import random
import struct
import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from lzero.checkpoint import (
    DTYPES,
    CheckpointError,
    SafetensorsStreamWriter,
    TensorFile,
    TorchStreamWriter,
    decode_tree,
    encode_tree,
    read_json,
    write_json_atomic,
    write_tensors,
)

try:
    import safetensors.torch as real_safetensors
except ImportError:  # the checks against the real package run where it is installed
    real_safetensors = None

REPO = pathlib.Path(__file__).resolve().parents[2]


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for code, dtype in DTYPES.items():
        if dtype.is_floating_point:
            t = torch.randn(3, 5, generator=g).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, (3, 5), generator=g).bool()
        else:
            t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, (3, 5), generator=g).to(dtype)
        out[code] = t
        out[f"{code}.scalar"] = t[1, 2].clone()
        out[f"{code}.empty"] = t[:0]
    out["F32.transposed"] = out["F32"].t()  # non-contiguous
    out["F32.view"] = out["F32"][1:, 1:4]  # non-contiguous, offset into its storage
    return out


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def written(
    tmp_path: pathlib.Path, name: str = "shard.safetensors", save_id: str = "save-1"
) -> tuple[str, dict[str, torch.Tensor]]:
    tensors = sample_tensors()
    path = str(tmp_path / name)
    write_tensors(path, tensors, {"save_id": save_id, "note": "ünï"})
    return path, tensors


def raw_file(path: pathlib.Path, header: Any, data: bytes = b"") -> str:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


# ---------------------------------------------------------------------------------------- tensor files


def test_round_trip_every_dtype_and_shape(tmp_path: pathlib.Path) -> None:
    path, tensors = written(tmp_path)
    f = TensorFile(path, save_id="save-1")
    assert f.names == list(tensors)
    assert f.metadata == {"save_id": "save-1", "note": "ünï"}
    for name, want in tensors.items():
        assert f.entry(name) == (want.dtype, tuple(want.shape), want.numel() * want.element_size())
        assert_same_tensor(f.read(name), want)
    assert f.read("F32").untyped_storage().nbytes() == 60  # fresh memory of its own
    if real_safetensors is not None:
        loaded = real_safetensors.load_file(path)
        assert set(loaded) == set(tensors)
        for name, want in tensors.items():
            assert_same_tensor(loaded[name], want)
        from safetensors import safe_open

        with safe_open(path, framework="pt") as g:
            assert g.metadata() == {"save_id": "save-1", "note": "ünï"}


def test_refuses_to_overwrite_and_leaves_nothing_on_failure(tmp_path: pathlib.Path) -> None:
    path, _ = written(tmp_path)
    before = pathlib.Path(path).read_bytes()
    with pytest.raises(CheckpointError, match="already exists"):
        write_tensors(path, {"x": torch.ones(2)}, {})
    assert pathlib.Path(path).read_bytes() == before
    other = tmp_path / "complex.safetensors"
    with pytest.raises(CheckpointError, match="complex64"):
        write_tensors(other, {"x": torch.ones(2, dtype=torch.complex64)}, {})
    with pytest.raises(CheckpointError, match="metadata"):
        write_tensors(other, {"x": torch.ones(2)}, {"step": 3})  # type: ignore[dict-item]
    assert not other.exists()


@pytest.mark.parametrize("name", ["F32", "BF16", "I64", "BOOL", "F32.transposed", "U8.scalar", "F16.empty"])
def test_read_flat_range_is_a_slice_of_the_flat_tensor(tmp_path: pathlib.Path, name: str) -> None:
    path, tensors = written(tmp_path)
    f = TensorFile(path)
    flat = tensors[name].reshape(-1)
    n = flat.numel()
    for start, end in {(0, 0), (0, n), (n, n), (0, n // 2), (n // 3, n - 1), (n - 1, n), (n // 2, n // 2)}:
        if 0 <= start <= end <= n:
            assert_same_tensor(f.read_flat_range(name, start, end), flat[start:end])
    for start, end in [(-1, 1), (0, n + 1), (1, 0), (0.0, 1)]:
        with pytest.raises(CheckpointError, match=f"`{name}`") as err:
            f.read_flat_range(name, start, end)  # type: ignore[arg-type]
        assert path in str(err.value) and "HINT:" in str(err.value)


def test_missing_name_is_named(tmp_path: pathlib.Path) -> None:
    path, _ = written(tmp_path)
    with pytest.raises(CheckpointError, match="no tensor `layer.9.weight`") as err:
        TensorFile(path).read("layer.9.weight")
    assert path in str(err.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        TensorFile(tmp_path / "model-r00007.safetensors")


def test_truncated_file_refused_at_every_cut(tmp_path: pathlib.Path) -> None:
    path, _ = written(tmp_path)
    whole = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", whole[:8])
    cuts = {
        "length": 4,
        "header start": 9,
        "header": 8 + n // 2,
        "data start": 8 + n,
        "data": (8 + n + len(whole)) // 2,
        "last byte": len(whole) - 1,
    }
    for where, cut in cuts.items():
        cut_path = tmp_path / f"cut-{cut}.safetensors"
        cut_path.write_bytes(whole[:cut])
        with pytest.raises(CheckpointError) as err:
            TensorFile(cut_path)
        assert str(cut_path) in str(err.value), where
        assert "truncated" in str(err.value) or "not JSON" in str(err.value), (where, str(err.value))
        assert "HINT:" in str(err.value)


def test_trailing_bytes_refused(tmp_path: pathlib.Path) -> None:
    path, _ = written(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0" * 3)
    with pytest.raises(CheckpointError, match="3 bytes after its last tensor") as err:
        TensorFile(path)
    assert path in str(err.value)


def test_wrong_save_id_names_both(tmp_path: pathlib.Path) -> None:
    path, _ = written(tmp_path, save_id="2024-old")
    TensorFile(path, save_id="2024-old")
    with pytest.raises(CheckpointError, match="2024-old") as err:
        TensorFile(path, save_id="2025-new")
    assert "2025-new" in str(err.value) and path in str(err.value)
    bare = tmp_path / "bare.safetensors"
    write_tensors(bare, {"x": torch.ones(1)}, {})
    with pytest.raises(CheckpointError, match="None"):
        TensorFile(bare, save_id="2025-new")


def test_corrupt_header_json_refused(tmp_path: pathlib.Path) -> None:
    path, _ = written(tmp_path)
    whole = bytearray(pathlib.Path(path).read_bytes())
    whole[8:20] = b"#" * 12
    pathlib.Path(path).write_bytes(bytes(whole))
    with pytest.raises(CheckpointError, match="not JSON") as err:
        TensorFile(path)
    assert path in str(err.value)


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE_HEADERS = {
    "offsets past the file": ({"a": entry("F32", [4], 0, 16)}, 8, "truncated"),
    "overlapping entries": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlapping"),
    "a gap": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, 12, "unused bytes"),
    "negative shape": ({"a": entry("F32", [-2], 0, 0)}, 0, "non-negative"),
    "bool in shape": ({"a": entry("F32", [True], 0, 4)}, 4, "non-negative"),
    "unknown dtype": ({"a": entry("F128", [1], 0, 16)}, 16, "unknown dtype"),
    "offsets not dtype x numel": ({"a": entry("F32", [3], 0, 8)}, 8, "needs 12"),
    "negative offsets": ({"a": entry("F32", [1], -4, 0)}, 0, "non-negative"),
    "extra key": ({"a": {**entry("F32", [1], 0, 4), "x": 1}}, 4, "exactly the keys"),
    "a list header": ([1, 2], 0, "not an object"),
    "metadata not strings": ({"__metadata__": {"save_id": 3}}, 0, "__metadata__"),
    "NaN in JSON": (b'{"a": NaN}', 0, "not JSON"),
    "repeated name": (
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        1,
        "repeated",
    ),
    "huge header length": (None, 0, "header, more than"),
}


@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_hostile_header_refused(tmp_path: pathlib.Path, case: str) -> None:
    header, data_bytes, message = HOSTILE_HEADERS[case]
    path = tmp_path / "hostile.safetensors"
    if header is None:
        path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    else:
        raw_file(path, header, b"\1" * data_bytes)
    with pytest.raises(CheckpointError, match=message) as err:
        TensorFile(path)
    assert str(path) in str(err.value)


def test_handmade_file_is_read(tmp_path: pathlib.Path) -> None:
    """The control for the hostile headers: the same builder makes a file that reads fine."""
    data = torch.tensor([1.0, 2.0]).numpy().tobytes() + bytes([7])
    path = raw_file(tmp_path / "ok.safetensors", {"b": entry("U8", [1], 8, 9), "a": entry("F32", [2], 0, 8)}, data)
    f = TensorFile(path)
    assert_same_tensor(f.read("a"), torch.tensor([1.0, 2.0]))
    assert_same_tensor(f.read("b"), torch.tensor([7], dtype=torch.uint8))


class Payload:
    """Unpickling this creates `marker`: the code an attacker would run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return pathlib.Path.touch, (self.marker,)


def test_pickles_never_run(tmp_path: pathlib.Path) -> None:
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(Payload(control)))
    assert control.exists()  # the payload is live

    marker = tmp_path / "marker"
    bomb = pickle.dumps(Payload(marker))
    ckpt = tmp_path / "epoch=0-step=1.ckpt"
    ckpt.mkdir()
    (ckpt / "model-r00000.safetensors").write_bytes(bomb)
    (ckpt / "manifest.json").write_bytes(bomb)
    torch.save({"x": Payload(marker)}, ckpt / "zip.safetensors")  # torch.save's zip, same payload inside
    for shard in ("model-r00000.safetensors", "zip.safetensors"):
        with pytest.raises(CheckpointError) as err:
            TensorFile(ckpt / shard)
        assert shard in str(err.value)
    with pytest.raises(CheckpointError, match="pickle") as err:
        read_json(ckpt / "manifest.json", "manifest")
    assert "manifest.json" in str(err.value)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ tree codec


def assert_same_tree(got: Any, want: Any, path: str = "") -> None:
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), path
    elif isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want)
        ), path
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{path}.{i}")
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        assert [type(k) for k in got] == [type(k) for k in want], path
        for k in want:
            assert_same_tree(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, argparse.Namespace):
        assert_same_tree(vars(got), vars(want), path)
    else:
        assert got == want, path


def through_files(tmp_path: pathlib.Path, obj: Any) -> Any:
    """Encode, write the manifest and the tensor file, read both back, decode."""
    encoded, tensors = encode_tree(obj)
    json.dumps(encoded, allow_nan=False)
    write_json_atomic(tmp_path / "manifest.json", {"state": encoded})
    write_tensors(tmp_path / "state.safetensors", tensors, {"save_id": "s"})
    f = TensorFile(tmp_path / "state.safetensors", save_id="s")
    return decode_tree(read_json(tmp_path / "manifest.json", "manifest")["state"], {n: f.read(n) for n in f.names})


def test_tree_round_trip(tmp_path: pathlib.Path) -> None:
    from lightning.pytorch.utilities.parsing import AttributeDict

    shared = torch.arange(4.0)
    tree = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64, -(2**200)],
        "floats": [0.1, -0.0, 1e308, float("nan"), float("inf"), float("-inf")],
        "text": ["", "é ∑ \0"],
        "bytes": b"\x00\xffabc",
        "tuple": (1, [2, (3,)], ()),
        "list": [1, (2,)],
        "keys": {1: "int", 2.5: "float", None: "none", False: "bool", (1, "a"): "tuple", "s": "str"},
        "looks_tagged": {"@tensor": "not a tensor"},
        "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
        "sets": [{1, 2, 3}, frozenset({"a"})],
        "tensors": [
            torch.tensor(2.5, dtype=torch.bfloat16),
            torch.zeros(0, 2, dtype=torch.int64),
            torch.ones(2, 3).t(),
            shared,
        ],
        "shared_again": shared,
        "arrays": [
            np.arange(6, dtype=np.uint32).reshape(2, 3),
            np.array(1.5, dtype=">f8"),
            np.zeros((0,), np.int16),
            np.arange(6.0)[::2],
        ],
        "np_scalars": [np.float32(0.1), np.int64(-3), np.bool_(True), np.float64("nan"), np.uint8(255)],
        "dtypes": [torch.float32, torch.bfloat16, torch.bool],
        "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
        "namespace": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "hparams": AttributeDict(lr=0.1, name="gpt"),
        "default": collections.defaultdict(int, a=1),
    }
    got = through_files(tmp_path, tree)
    tree["default"] = dict(tree["default"])  # documented: other dict subclasses come back as dict
    assert_same_tree(got, tree)
    assert got["shared_again"] is got["tensors"][3]
    assert got["arrays"][3].flags.c_contiguous


def test_rng_states_round_trip(tmp_path: pathlib.Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1), random.gauss(0, 1), np.random.randn()
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": np.random.default_rng(4).bit_generator.state,  # 128-bit ints
    }
    want = [random.random() for _ in range(3)], np.random.rand(3), np.random.randn(3), torch.rand(3)
    got_states = through_files(tmp_path, states)
    assert_same_tree(got_states, states)
    random.setstate(got_states["python"])
    np.random.set_state(got_states["numpy"])
    torch.set_rng_state(got_states["torch"])
    got = [random.random() for _ in range(3)], np.random.rand(3), np.random.randn(3), torch.rand(3)
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])
    assert torch.equal(got[3], want[3])
    bit_gen = np.random.PCG64()
    bit_gen.state = got_states["generator"]
    assert np.random.Generator(bit_gen).random() == np.random.default_rng(4).random()


class Color(enum.IntEnum):
    RED = 1


class Point(NamedTuple):
    x: int


def cyclic() -> dict:
    d: dict = {"a": []}
    d["a"].append(d)
    return d


REFUSED = {
    "a lambda": (
        {"hyper_parameters": {"model": {"activation": lambda x: x}}},
        "hyper_parameters.model.activation",
        "a function",
    ),
    "a builtin": ({"hyper_parameters": {"fn": print}}, "hyper_parameters.fn", "a function"),
    "a class": ({"cls": torch.nn.ReLU}, "cls", "the class torch.nn"),
    "an instance": ({"x": [1, torch.nn.ReLU()]}, "x.1", "torch.nn.modules.activation.ReLU"),
    "an IntEnum": ({"x": Color.RED}, "x", "Color"),
    "a namedtuple": ({"x": Point(1)}, "x", "Point"),
    "a path": ({"dir": pathlib.Path("/tmp")}, "dir", "Path"),
    "a complex tensor": ({"t": torch.ones(1, dtype=torch.complex64)}, "t", "complex64"),
    "a sparse tensor": ({"t": torch.eye(2).to_sparse()}, "t", "sparse"),
    "an object array": ({"a": np.array([None])}, "a", "object"),
    "a bad key": ({"d": {torch.nn.ReLU: 1}}, "d.<key", "the class"),
    "a cycle": (cyclic(), "a.0", "contains itself"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_tree_refusals_name_the_path(case: str) -> None:
    obj, path, what = REFUSED[case]
    with pytest.raises(CheckpointError) as err:
        encode_tree(obj)
    message = str(err.value)
    assert f"`{path}" in message and what in message and "HINT:" in message, message


@pytest.mark.parametrize(
    "encoded, message",
    [
        ({"@tensor": "gone"}, "missing"),
        ({"@pickle": "gASV"}, "unknown tag"),
        ({"@float": "1.5"}, "unknown tag"),
        ({"@dtype": "_dynamo"}, "unknown tag"),
        ({"@attrdict": ["os.system", {}]}, "not a known AttributeDict"),
        ({"@ndarray": {"dtype": "O", "shape": [1], "data": "t"}}, "objects"),
        ({"@ndarray": {"dtype": "<f4", "shape": [3], "data": "t"}}, "cannot be a"),
        ({"@dict": [[[1], 2]]}, "unhashable"),
        ({"a": [{"@bytes": "!!"}]}, "a.0"),
    ],
)
def test_decode_refuses_bad_trees(encoded: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as err:
        decode_tree(encoded, {"t": torch.zeros(4, dtype=torch.uint8)}, source="/ckpt/manifest.json")
    assert "/ckpt/manifest.json" in str(err.value)


# -------------------------------------------------------------------------------------------- manifest


def test_write_json_atomic_keeps_old_file_on_failure(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"version": 1})
    temp_names = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (temp_names.append(src), real_replace(src, dst)))

    def broken_dump(obj: Any, f: Any, **kwargs: Any) -> None:
        temp_names.append(f.name)
        f.write('{"version": 2, "half')
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        write_json_atomic(path, {"version": 2})
    monkeypatch.undo()
    assert read_json(path, "manifest") == {"version": 1}
    assert os.listdir(tmp_path) == ["manifest.json"]
    with pytest.raises(CheckpointError, match="not plain JSON"):
        write_json_atomic(path, {"loss": float("nan")})
    assert os.listdir(tmp_path) == ["manifest.json"] and read_json(path, "manifest") == {"version": 1}
    assert temp_names and all(os.path.dirname(n) == str(tmp_path) for n in temp_names)
    assert not any(n.endswith((".json", ".ckpt")) for n in temp_names), temp_names


@pytest.mark.parametrize(
    "content, message",
    [
        (b"[1, 2]", "JSON list"),
        (b"\xff\xfe{}", "not a JSON"),
        (b'{"a": Infinity}', "not a JSON"),
        (b'{"a": 1', "not a JSON"),
        (b"PK\x03\x04rest", "torch.save"),
    ],
)
def test_read_json_refusals(tmp_path: pathlib.Path, content: bytes, message: str) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as err:
        read_json(path, "manifest")
    assert str(path) in str(err.value)
    with pytest.raises(CheckpointError, match="did not finish"):
        read_json(tmp_path / "absent.json", "manifest")


# ----------------------------------------------------------------------------------- streaming writers


def test_safetensors_stream_writer(tmp_path: pathlib.Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "consolidated.safetensors"
    with SafetensorsStreamWriter(path, [(n, t.dtype, t.shape) for n, t in tensors.items()], {"save_id": "s"}) as w:
        for name, t in tensors.items():
            w.write(name, t)
    assert sorted(os.listdir(tmp_path)) == ["consolidated.safetensors"]
    f = TensorFile(path, save_id="s")
    for name, want in tensors.items():
        assert_same_tensor(f.read(name), want)
    if real_safetensors is not None:
        for name, got in real_safetensors.load_file(path).items():
            assert_same_tensor(got, tensors[name])


def test_safetensors_stream_writer_refusals(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "out.safetensors"
    declared = [("a", torch.float32, (2,)), ("b", torch.int64, (3,))]
    for name, tensor, message in [
        ("b", torch.zeros(3, dtype=torch.int64), "expected tensor `a` next"),
        ("a", torch.zeros(3), r"float32 \[2\], got torch.float32 \[3\]"),
        ("a", torch.zeros(2, dtype=torch.float64), "got torch.float64"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            with SafetensorsStreamWriter(path, declared, {}) as w:
                w.write(name, tensor)
        assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="1 declared tensors unwritten"):
        with SafetensorsStreamWriter(path, declared, {}) as w:
            w.write("a", torch.zeros(2))
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="gather failed"):
        with SafetensorsStreamWriter(path, declared, {}) as w:
            w.write("a", torch.zeros(2))
            raise RuntimeError("gather failed")
    assert os.listdir(tmp_path) == []


def lightning_like(refs: dict[str, Any]) -> dict[str, Any]:
    return {
        "state_dict": refs,
        "pytorch-lightning_version": "2.6.6",
        "hyper_parameters": {"lr": 0.001, "layers": [4, 4], "name": None, "flag": True, "big": 2**70},
        "epoch": 3,
        "loops": collections.OrderedDict(fit=(1, 2.5, "x")),
    }


def test_torch_stream_writer_matches_torch_save(tmp_path: pathlib.Path) -> None:
    tensors = sample_tensors()
    tensors["complex"] = torch.ones(2, dtype=torch.complex64)  # torch.save's format has no dtype limit
    tied = torch.randn(4, 3)
    path = tmp_path / "model.ckpt"
    with TorchStreamWriter(path) as w:
        refs = {name: w.add(t) for name, t in tensors.items()}
        refs["embed.weight"] = w.add(tied)
        refs["head.weight"] = w.add(tied)  # the same object
        refs["head.weight.detached"] = w.add(tied.detach())  # another object, same memory
        w.close(lightning_like(refs))
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]
    want = lightning_like({**tensors, "embed.weight": tied, "head.weight": tied, "head.weight.detached": tied})
    torch.save(want, tmp_path / "reference.ckpt")
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert_same_tree(got, torch.load(tmp_path / "reference.ckpt", weights_only=True))
        assert_same_tree(got, want)
        sd = got["state_dict"]
        assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr() == sd["head.weight.detached"].data_ptr()
    assert os.path.getsize(path) < os.path.getsize(tmp_path / "reference.ckpt") + 4096  # nothing written twice


def test_torch_stream_writer_refusals(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "model.ckpt"
    other = TorchStreamWriter(tmp_path / "other.ckpt")
    stranger = other.add(torch.ones(1))
    other.abort()
    cases = [
        (lambda w: {"fn": lambda: 0}, r"`fn` \(a function\)"),
        (lambda w: {"sd": {"w": torch.ones(1)}}, "`sd.w` is a tensor that was not added"),
        (lambda w: {"s": {1, 2}}, r"`s` \(a set\)"),
        (lambda w: {"sd": [stranger]}, "`sd.0` is a tensor stored by another writer"),
        (lambda w: {("a", 1): w.add(torch.ones(1))}, "not a str/int"),
    ]
    for make, message in cases:
        with pytest.raises(CheckpointError, match=message):
            with TorchStreamWriter(path) as w:
                w.add(torch.ones(3))
                w.close(make(w))
        assert os.listdir(tmp_path) == []
    with TorchStreamWriter(path) as w:  # left without close(): nothing is committed
        w.add(torch.ones(3))
    assert os.listdir(tmp_path) == []


STREAM_SCRIPT = r"""
import json, sys, torch
from lzero.checkpoint import SafetensorsStreamWriter, TorchStreamWriter

NUMEL = 625_000  # 2.5 MB of float32

def peak_bytes():
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

def stream(kind, path, count):
    if kind == "safetensors":
        with SafetensorsStreamWriter(path, [(f"t{i}", torch.float32, (NUMEL,)) for i in range(count)], {}) as w:
            for i in range(count):
                w.write(f"t{i}", torch.full((NUMEL,), float(i)))
    else:
        with TorchStreamWriter(path) as w:
            w.close({"state_dict": {f"t{i}": w.add(torch.full((NUMEL,), float(i))) for i in range(count)}})

cold, growth = peak_bytes(), {}
for kind in ("safetensors", "torch"):  # one tensor live, and first-use costs (allocator, zip writer)
    stream(kind, f"{sys.argv[1]}.{kind}.warmup", 1)
for kind in ("safetensors", "torch"):
    before = peak_bytes()
    stream(kind, f"{sys.argv[1]}.{kind}", 20)
    growth[kind] = peak_bytes() - before
growth["all"] = peak_bytes() - cold
print(json.dumps(growth))
"""


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS is read from /proc (Linux)")
def test_streaming_peak_memory(tmp_path: pathlib.Path) -> None:
    """Streams 20 tensors of 2.5 MB through each writer in a fresh process; holding them would be +50 MB."""
    largest = 625_000 * 4
    # A fixed mmap threshold makes glibc return each freed 2.5 MB block at once; with its default
    # (dynamic) threshold freed blocks stay in the heap and RSS grows with no live tensor behind it.
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", STREAM_SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    growth = json.loads(run.stdout.splitlines()[-1])
    print(", ".join(f"{kind} +{mib(n)}" for kind, n in growth.items()), f"(largest tensor {mib(largest)})")
    assert growth["safetensors"] < 3 * largest and growth["torch"] < 3 * largest, growth
    assert growth["all"] < 6 * largest, growth  # including one live tensor and the first use of each writer
    sd = torch.load(f"{out}.torch", weights_only=True, mmap=True)["state_dict"]
    assert len(sd) == 20 and sd["t19"][-1].item() == 19.0
    f = TensorFile(f"{out}.safetensors")
    assert len(f.names) == 20 and f.read_flat_range("t19", 624_999, 625_000).item() == 19.0
