"""A LoRA or QLoRA checkpoint without its frozen base ([Note: a checkpoint without its frozen base] in
lzero/checkpoint/base_files.py): references are the same run's checkpoints saved with the base (``save_frozen=True``)
and the uninterrupted run. The runs: tests/hf/base_runs.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import run_script
from _pretrained_models import save_models, save_quantizable

pytest.importorskip("peft")
QLORA = importlib.util.find_spec("bitsandbytes") is not None
MODELS = ["gpt2", *(["qlora"] if QLORA else [])]
RUNS = [f"{m}:{mode}" for m in MODELS for mode in ("whole", "lean", "resume")] + ["gpt2:touched", "gpt2:fabric"] + [
    f"gpt2:{mode}:2" for mode in ("whole", "lean", "resume")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base_runs")
    models = out / "models"  # the runs' own copy: a test changes a file of it
    save_models(models, ["gpt2"])
    if QLORA:
        save_quantizable(models, ("llama",))
    run_script("base_runs.py", str(models), str(out), *RUNS, ranks=2, timeout=600)
    return out


def _load(runs: Path, run: str) -> dict[str, Any]:
    return torch.load(runs / f"{run.replace(':', '-')}.pt", weights_only=True)


def _checkpoint(runs: Path, model: str, mode: str, step: int = 3) -> Path:
    return runs / f"{model}-{mode}-ckpt" / f"epoch={step // 3 - 1}-step={step}.ckpt"


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _saved_keys(path: Path) -> set[str]:
    from lzero.checkpoint import TensorFile

    return {k for f in _manifest(path)["files"] for k in TensorFile(path / f["name"]).names}


@pytest.mark.parametrize("model", MODELS)
def test_the_checkpoint_holds_what_training_changes_and_records_the_base(runs: Path, model: str) -> None:
    lean, whole = _checkpoint(runs, model, "lean"), _checkpoint(runs, model, "whole")
    m, w = _manifest(lean), _manifest(whole)
    frozen = {n for n, p in m["params"].items() if p.get("frozen")}
    assert frozen and set(m["base"]["tensors"]) == frozen and "base" not in w
    assert not any(k.startswith("param/") and k[len("param/"):] in frozen for k in _saved_keys(lean))
    assert all(f"param/{n}" in _saved_keys(whole) for n in frozen)
    files = m["base"]["files"]
    assert files and all(Path(f).is_file() and os.stat(f).st_size == info["bytes"] for f, info in files.items())
    if model == "qlora":  # the codes of the 4-bit weights are quantized again from the bf16 files, as they were read
        quantized = [t["quantized"] for t in m["base"]["tensors"].values() if "quantized" in t]
        assert len(quantized) == 14 and {q["quant_type"] for q in quantized} == {"nf4"}
        assert {q["table"] for q in quantized} <= {"float32", "bfloat16"}
        # and their quantization state (absmax, code books, the nested state) is computed again, not held
        from lzero.checkpoint.reader import ShardedCheckpoint

        reader = ShardedCheckpoint(lean)
        held = reader.lightning_state()["lzero/module_state"]
        assert len(reader.derived_keys()) == 14 * 5 and not any(k in held for k in reader.derived_keys())
        assert all(k in ShardedCheckpoint(whole).lightning_state()["lzero/module_state"] for k in reader.derived_keys())
    # what is no longer written: the base's bytes, every one of them
    saved = lambda manifest: sum(f["bytes"] for f in manifest["files"])  # noqa: E731
    base_bytes = sum(p["numel"] for n, p in w["params"].items() if n in frozen) * (4 if model == "gpt2" else 2)
    assert saved(w) - saved(m) >= base_bytes


@pytest.mark.parametrize("model", MODELS)
def test_consolidate_and_export_read_the_base_back_as_saved(runs: Path, model: str, tmp_path: Path) -> None:
    from peft import LoraConfig

    from lzero.checkpoint.consolidate import consolidate, inspect
    from lzero.checkpoint.reader import ShardedCheckpoint
    from lzero.hf import export_hf

    lean, whole = _checkpoint(runs, model, "lean"), _checkpoint(runs, model, "whole")
    a = torch.load(consolidate(lean, tmp_path / "lean.ckpt"), weights_only=True)["state_dict"]
    b = torch.load(consolidate(whole, tmp_path / "whole.ckpt"), weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    for key, value in b.items():  # as bytes: packed 4-bit codes in bf16 storage read as NaN here and there
        assert a[key].dtype == value.dtype and torch.equal(_bytes(a[key]), _bytes(value)), key
    reader = ShardedCheckpoint(lean)  # each parameter read by ranges, as a resume at another world size reads it
    for name in reader.base:
        whole_param = ShardedCheckpoint(whole).full_param(name).reshape(-1)
        n = whole_param.numel()
        pieces = torch.cat([reader.read_range(f"param/{name}", 0, n // 3), reader.read_range(f"param/{name}", n // 3, n)])
        assert torch.equal(_bytes(pieces), _bytes(whole_param)), name
    config = tmp_path / "adapter"
    LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"] if model == "gpt2" else ["q_proj", "v_proj"],
               fan_in_fan_out=model == "gpt2").save_pretrained(config)
    for path, out in ((lean, "lean-adapters"), (whole, "whole-adapters")):
        export_hf(path, tmp_path / out, config=config, adapters_only=True)
    assert (tmp_path / "lean-adapters" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "whole-adapters" / "adapter_model.safetensors").read_bytes()
    # the merged export streams the base back from the files (a QLoRA base dequantized from codes quantized again)
    base_folder = runs / "models" / ("gpt2" if model == "gpt2" else "llama")
    for path, out in ((lean, "lean-merged"), (whole, "whole-merged")):
        export_hf(path, tmp_path / out, config=base_folder, merge=True, adapter_config=config)
    merged = sorted(p.name for p in (tmp_path / "lean-merged").iterdir())
    assert merged == sorted(p.name for p in (tmp_path / "whole-merged").iterdir()) and "model.safetensors" in merged
    for name in merged:
        assert (tmp_path / "lean-merged" / name).read_bytes() == (tmp_path / "whole-merged" / name).read_bytes(), name
    assert inspect(lean)["total_parameters"] == inspect(whole)["total_parameters"]
    assert inspect(whole)["frozen_base"] is None
    assert inspect(lean)["frozen_base"] == {"tensors": len(_manifest(lean)["base"]["tensors"]), "files": {
        path: os.stat(path).st_size for path in _manifest(lean)["base"]["files"]}}


@pytest.mark.parametrize("model", MODELS)
def test_resume_from_a_checkpoint_without_its_base_continues_the_run(runs: Path, model: str) -> None:
    """Bitwise: the base read back (the QLoRA codes quantized again) is what the run had."""
    whole, lean, resumed = (_load(runs, f"{model}:{mode}") for mode in ("whole", "lean", "resume"))
    assert lean["losses"] == whole["losses"]
    assert resumed["losses"] == lean["losses"][3:]
    assert resumed["trained"].keys() == lean["trained"].keys()
    for key, value in lean["trained"].items():
        assert torch.equal(resumed["trained"][key], value), key


def test_fabric_saves_without_the_base_and_loads_into_a_model_built_alike(runs: Path) -> None:
    """Fabric's door: ``fabric.save`` after 3 steps leaves the base out; a second model built in ``init_module`` (on
    the meta device, its construction replayed) loads it, reading the base back from the files, and steps 4-6 are the
    uninterrupted run's, bitwise."""
    m = _manifest(runs / "gpt2-fabric.ckpt")
    assert {n for n, p in m["params"].items() if p.get("frozen")} == set(m["base"]["tensors"])
    run = _load(runs, "gpt2:fabric")
    assert run["resumed_losses"] == run["losses"][3:]
    assert run["trained"].keys() == run["resumed"].keys() and len(run["trained"]) == 4
    for key, value in run["trained"].items():
        assert torch.equal(run["resumed"][key], value), key


def test_at_zero2_the_base_transformers_loaded_is_left_out_and_read_back(runs: Path, tmp_path: Path) -> None:
    """zero2: the base is whole on every rank, loaded by transformers' own ``from_pretrained``; found again in its
    files ([Note: an eager model's frozen base] in lzero/hf/eager_base.py), it is left out of the module's state and
    read back: consolidate equal, resume bitwise."""
    from lzero.checkpoint.consolidate import consolidate
    from lzero.checkpoint.reader import ShardedCheckpoint

    lean, whole = _checkpoint(runs, "gpt2", "lean-2"), _checkpoint(runs, "gpt2", "whole-2")
    held = ShardedCheckpoint(whole).lightning_state()["lzero/module_state"]
    frozen = {k for k in held if "lora_" not in k}
    recorded = _manifest(lean)["base"]["whole"]
    assert set(recorded) == frozen and len(frozen) == 29  # 28 tensors, and the head tied to the embedding
    reader = ShardedCheckpoint(lean)
    assert not any(k in reader.lightning_state()["lzero/module_state"] for k in frozen)
    saved = lambda path: sum(f["bytes"] for f in _manifest(path)["files"])  # noqa: E731
    base_bytes = sum(held[k].numel() * 4 for k in frozen if k != "model.base_model.model.lm_head.weight")
    assert saved(whole) - saved(lean) >= base_bytes
    a = torch.load(consolidate(lean, tmp_path / "lean.ckpt"), weights_only=True)["state_dict"]
    b = torch.load(consolidate(whole, tmp_path / "whole.ckpt"), weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    lean_run, resumed = _load(runs, "gpt2:lean:2"), _load(runs, "gpt2:resume:2")
    assert lean_run["losses"] == _load(runs, "gpt2:whole:2")["losses"] and resumed["losses"] == lean_run["losses"][3:]
    assert all(torch.equal(resumed["trained"][k], v) for k, v in lean_run["trained"].items())


def test_a_base_changed_after_loading_is_written_whole(runs: Path, tmp_path: Path) -> None:
    """``on_fit_start`` adds 1 to one frozen weight: its unit (the first block) is no longer the files', so the
    checkpoint holds it; the other units are still read back from the files."""
    from lzero.checkpoint.consolidate import consolidate

    from base_runs import TOUCHED

    path = _checkpoint(runs, "gpt2", "touched")
    m = _manifest(path)
    written = {k[len("param/"):] for k in _saved_keys(path) if k.startswith("param/")}
    assert TOUCHED in written and TOUCHED not in m["base"]["tensors"]
    assert all(".h.0." in n for n in written if m["params"][n].get("frozen"))
    assert any(".h.1." in n for n in m["base"]["tensors"])
    touched = torch.load(consolidate(path, tmp_path / "touched.ckpt"), weights_only=True)["state_dict"][TOUCHED]
    plain = torch.load(consolidate(_checkpoint(runs, "gpt2", "whole"), tmp_path / "plain.ckpt"),
                       weights_only=True)["state_dict"][TOUCHED]
    assert torch.equal(touched, plain + 1.0)


def test_a_changed_or_missing_base_file_is_refused_by_name(runs: Path) -> None:
    from lzero.checkpoint import CheckpointError
    from lzero.checkpoint.reader import ShardedCheckpoint

    lean = _checkpoint(runs, "gpt2", "lean")
    file = Path(sorted(_manifest(lean)["base"]["files"])[0])
    original = file.read_bytes()
    try:
        changed = bytearray(original)
        changed[-1] ^= 0x01  # one bit of the last tensor's last element: same size, another hash
        file.write_bytes(bytes(changed))
        with pytest.raises(CheckpointError, match=f"`{file}`, which has changed: its sha256 differs"):
            ShardedCheckpoint(lean)
        file.write_bytes(original + b"\0")
        with pytest.raises(CheckpointError, match=f"`{file}`, which has changed: {len(original) + 1} bytes"):
            ShardedCheckpoint(lean)
        file.unlink()
        with pytest.raises(CheckpointError, match=f"`{file}`, which does not exist.*save_frozen=True"):
            ShardedCheckpoint(lean)
    finally:
        file.write_bytes(original)
    assert ShardedCheckpoint(lean).base  # the original back: read again


def test_save_frozen_must_be_true_or_false() -> None:
    from lzero.config import ZeroConfig
    from lzero.errors import ZeroConfigError

    with pytest.raises(ZeroConfigError, match="save_frozen"):
        ZeroConfig(save_frozen="no")
    assert ZeroConfig().save_frozen is False


def test_a_moved_checkpoint_still_finds_its_base(runs: Path, tmp_path: Path) -> None:
    """The record names the pretrained files by absolute path: a checkpoint copied elsewhere reads the same base."""
    from lzero.checkpoint.reader import ShardedCheckpoint

    lean = _checkpoint(runs, "gpt2", "lean")
    moved = shutil.copytree(lean, tmp_path / "moved.ckpt")
    a, b = ShardedCheckpoint(moved), ShardedCheckpoint(lean)
    assert a.full_state_dict().keys() == b.full_state_dict().keys()
    assert all(torch.equal(_bytes(x), _bytes(y)) for x, y in zip(a.full_state_dict().values(), b.full_state_dict().values()))
