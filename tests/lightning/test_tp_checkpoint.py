"""Checkpoints of tensor-parallel runs ([Note: tensor-parallel checkpoints] in lzero/engine/tensor_layout.py): saved
by a ModelCheckpoint at tp2 x dp2 (world 4) at zero1, zero2 and zero3, for the small block (its down projection cut
on dimension 1: many runs per piece) and a tiny Hugging Face Llama; resumed at tp2 x dp2 (bitwise the uninterrupted
run), tp1 x dp4, tp4 x dp1 and world size 1: the resumed epoch's losses and final parameters within 1e-6 relative of
the uninterrupted run (measured: 2.1e-7); ``lzero consolidate`` and ``export-hf`` give the gathered model bitwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _launch import run_script
from tp_checkpoint_runs import STAGES

TOLERANCE = 1e-6
LAYOUTS = [(2, 2), (1, 4), (4, 1), (1, 1)]  # (tensor, data) sizes of the resumes


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tensor_parallel_runs import save_llama

    out = tmp_path_factory.mktemp("tp_checkpoint_runs")
    save_llama(out / "llama")
    run_script("tp_checkpoint_runs.py", str(out), str(out / "llama"), "save", ranks=4)
    for tp, dp in LAYOUTS:
        run_script("tp_checkpoint_runs.py", str(out), str(out / "llama"), f"resume:{tp}", ranks=tp * dp)
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


RESUMES = [(tp, dp, stage, model) for tp, dp in LAYOUTS for stage in STAGES for model in ("", "llama_")
           if not (model and tp == 4)]  # the Llama's 2 KV heads do not split over 4 tensor ranks


@pytest.mark.parametrize("tp, dp, stage, model", RESUMES)
def test_a_resume_at_other_sizes_continues_the_run(runs: Path, tp: int, dp: int, stage: int, model: str) -> None:
    want = torch.load(runs / f"{model}zero{stage}.pt", weights_only=True)
    got = torch.load(runs / f"{model}zero{stage}_from_tp2dp2_at_tp{tp}dp{dp}.pt", weights_only=True)
    assert len(want["losses"]) == 4 and len(got["losses"]) == 2  # epoch 1 only: epoch 0 came from the checkpoint
    assert got["params"].keys() == want["params"].keys()
    if (tp, dp) == (2, 2):  # the same layout: bitwise
        assert got["losses"] == want["losses"][2:]
        assert all(torch.equal(got["params"][k], v) for k, v in want["params"].items())
        return
    for ours, theirs in zip(got["losses"], want["losses"][2:]):
        assert abs(ours - theirs) <= TOLERANCE * abs(theirs)
    moved = max(_relative(want["params"][k], want["epoch0"][k]) for k in want["params"])
    assert moved > 1e-3  # epoch 1 moved the weights (a resume that lost its optimizer state would not land here)
    for name, value in want["params"].items():
        assert _relative(got["params"][name], value) <= TOLERANCE, name


@pytest.mark.parametrize("model", ["", "llama_"])
@pytest.mark.parametrize("stage", STAGES)
def test_consolidate_gives_the_gathered_model(runs: Path, tmp_path: Path, stage: int, model: str) -> None:
    from lzero.cli import main

    checkpoint = runs / f"{model}zero{stage}" / "epoch=0.ckpt"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["tensor_parallel"]["size"] == 2
    assert {"dim": 1} in manifest["tensor_parallel"]["params"].values()  # a row-wise weight: runs of rows
    assert main(["consolidate", str(checkpoint), str(tmp_path / "whole.pt")]) == 0
    state = torch.load(tmp_path / "whole.pt", weights_only=True)["state_dict"]
    gathered = torch.load(runs / f"{model}zero{stage}.pt", weights_only=True)["epoch0"]
    assert state.keys() == {f"model.{k}" for k in gathered}
    for name, value in gathered.items():
        assert torch.equal(state[f"model.{name}"], value), name


def test_export_hf_gives_the_gathered_llama(runs: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lzero.cli import main

    assert main(["export-hf", str(runs / "llama_zero3" / "epoch=0.ckpt"), str(tmp_path / "hf"),
                 "--config", str(runs / "llama")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    gathered = torch.load(runs / "llama_zero3.pt", weights_only=True)["epoch0"]
    assert all(torch.equal(exported[name], value) for name, value in gathered.items())


def test_a_damaged_tensor_parallel_record_is_refused(runs: Path, tmp_path: Path) -> None:
    from lzero.checkpoint.files import CheckpointError
    from lzero.checkpoint.reader import ShardedCheckpoint

    copy = tmp_path / "copy.ckpt"
    shutil.copytree(runs / "zero2" / "epoch=0.ckpt", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tensor_parallel"]["size"] = 3  # does not divide the 4 files
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"`tensor_parallel` must be .*HINT"):
        ShardedCheckpoint(copy)


def test_inspect_names_the_tensor_layout(runs: Path) -> None:
    """``lzero inspect``: the tensor size and what it splits, and the saving run's model states per rank (ZeRO over
    the 2 data ranks of the 1,664 - 1,584 + 1,584 / 2 = 872 elements a tensor rank holds: 16 bytes each at zero3, the
    gradient's 4 left out as between steps)."""
    from lzero.checkpoint.consolidate import inspect

    info = inspect(runs / "zero3" / "epoch=0.ckpt")
    assert info["tensor_parallel"] == ("2 (6 of 11 parameters, 1,584 of 1,664 trainable elements, split over the tensor"
                                       " ranks)")
    assert info["model_states_bytes_per_rank"] == 872 * 12 // 2
