"""validate / test / predict at zero3 and the offload presets, world size 2, against DDP on the same checkpoint:
after fit, and alone in a new process with ``ckpt_path`` (the model built in ``configure_model`` and in
``__init__``). See [Note: evaluating under zero3] in lzero/lightning/trainer_strategy.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script

AFTER_FIT = ["zero3", "zero3_offload", "zero3_offload_nvme"]
ALONE = ["zero3_alone", "zero3_offload_alone", "zero3_offload_nvme_alone", "zero3_alone_eager", "zero3_alone_plain_ckpt"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval_runs")
    run_script("eval_runs.py", "fit", str(out), ranks=2)
    run_script("eval_runs.py", "alone", str(out), ranks=2)  # a new process: nothing of the fit left
    return out


def _load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def _assert_same(ours: dict, ddp: dict) -> None:
    assert ours["val"] == ddp["val"] and ours["test"] == ddp["test"]
    assert torch.equal(ours["predictions"], ddp["predictions"])


@pytest.mark.parametrize("preset", AFTER_FIT)
def test_after_fit_on_the_sharded_model_equals_ddp_bitwise(runs: Path, preset: str) -> None:
    _assert_same(_load(runs, f"{preset}_after_fit"), _load(runs, f"ddp_{preset}"))


@pytest.mark.parametrize("run", ALONE)
def test_alone_from_a_checkpoint_equals_ddp_bitwise(runs: Path, run: str) -> None:
    _assert_same(_load(runs, run), _load(runs, "ddp_zero3"))


def _sizes() -> tuple[int, int, int]:
    import sys

    from eval_runs import LAYERS, VOCAB, WIDTH

    block = WIDTH * 2 + (WIDTH * 4 * WIDTH + 4 * WIDTH) + (4 * WIDTH * WIDTH + WIDTH)
    root = VOCAB * WIDTH + WIDTH * VOCAB + VOCAB
    return root, block, root + LAYERS * block


@pytest.mark.parametrize("run", ["zero3_alone", "zero3_after_fit"])
def test_predict_holds_the_shard_and_the_estimated_working_set(runs: Path, run: str) -> None:
    """A rank holds its shard of every unit plus the gathered root and blocks the estimator counts, never the model."""
    from lzero import ZeroConfig
    from lzero.memory.estimate import gathered_blocks

    root, block, psi = _sizes()
    expected_gathered = 4 * (root + gathered_blocks(ZeroConfig(stage=3), root, block, psi) * block)
    held = _load(runs, run)["held"]
    print(f"{run}: shards {held['shards']} B, gathered peak {held['gathered']} B (estimator {expected_gathered} B),"
          f" whole model {4 * psi} B")
    assert held["gathered"] == expected_gathered
    assert held["shards"] <= 4 * psi / 2 + 4 * 16  # 1/N of every unit, padded
    assert held["shards"] + held["gathered"] < 4 * psi


@pytest.mark.parametrize("preset", AFTER_FIT)
def test_the_end_of_fit_holds_no_full_copy(runs: Path, preset: str) -> None:
    """After fit the module's parameters are placeholders (one shared element per dtype) and the rank keeps its
    shard; before, every rank held the whole model."""
    _, _, psi = _sizes()
    held = _load(runs, f"{preset}_after_fit")["held_after_fit"]
    print(f"{preset} after fit: module storage {held['module']} B, shards {held['shards']} B, whole model {4 * psi} B")
    assert held["module"] <= 8
    assert 4 * psi / 2 <= held["shards"] <= 4 * psi / 2 + 4 * 16


def test_the_sharded_model_after_fit_has_named_ways_out(runs: Path) -> None:
    """``state_dict()`` is refused with the ways out; ``trainer.save_checkpoint`` writes the shards and
    ``lzero.unshard`` gives whole tensors, both equal to the fit's own checkpoint."""
    ways = _load(runs, "ways_out")
    for named in ("gathered_parameters", "save_checkpoint", "lzero.unshard", "gather_after_fit"):
        assert named in ways["refusal"]
    plain = torch.load(runs / "plain_zero3_offload_nvme.ckpt", weights_only=True)["state_dict"]
    saved = torch.load(runs / "saved_after_fit_plain.ckpt", weights_only=True)["state_dict"]
    assert plain.keys() == saved.keys() == ways["unsharded"].keys()
    for key in plain:
        assert torch.equal(saved[key], plain[key]) and torch.equal(ways["unsharded"][key], plain[key])
    assert ways["module_bytes"] == 4 * _sizes()[2]


def test_gather_after_fit_leaves_whole_tensors_as_before(runs: Path) -> None:
    ways = _load(runs, "ways_out")
    plain = torch.load(runs / "plain_zero3.ckpt", weights_only=True)["state_dict"]
    assert ways["gather_after_fit"].keys() == plain.keys()
    for key in plain:
        assert torch.equal(ways["gather_after_fit"][key], plain[key]), key
    assert ways["gather_after_fit_bytes"] == 4 * _sizes()[2]


def test_predict_without_a_checkpoint_materializes_the_meta_model(runs: Path) -> None:
    predictions = _load(runs, "zero3_no_ckpt")["predictions"]
    assert predictions.shape == (16, 9, 32) and bool(torch.isfinite(predictions).all())
    assert not torch.equal(predictions, _load(runs, "ddp_zero3")["predictions"][:16])  # initialized, not trained
