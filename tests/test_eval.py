"""validate / test / predict at zero3 and the offload presets, world size 2, against DDP on the same checkpoint:
after fit, and alone in a new process with ``ckpt_path`` (the model built in ``configure_model`` and in
``__init__``). See [Note: evaluating under zero3] in lzero/strategy.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script

RUNS = ["zero3_after_fit", "zero3_alone", "zero3_offload_alone", "zero3_offload_nvme_alone", "zero3_alone_eager",
        "zero3_alone_plain_ckpt"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval_runs")
    run_script("eval_runs.py", "fit", str(out))
    run_script("eval_runs.py", "alone", str(out))  # a new process: nothing of the fit left
    return out


def _load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("run", RUNS)
def test_metrics_and_predictions_equal_ddp_bitwise(runs: Path, run: str) -> None:
    ours, ddp = _load(runs, run), _load(runs, "ddp")
    assert ours["val"] == ddp["val"] and ours["test"] == ddp["test"]
    assert torch.equal(ours["predictions"], ddp["predictions"])


@pytest.mark.parametrize("run", ["zero3_alone", "zero3_after_fit"])
def test_predict_holds_the_shard_and_the_estimated_working_set(runs: Path, run: str) -> None:
    """A rank holds its shard of every unit plus the gathered root and blocks the estimator counts, never the model."""
    import sys

    from lzero import ZeroConfig
    from lzero.estimate import gathered_blocks

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from eval_runs import LAYERS, VOCAB, WIDTH

    block = WIDTH * 2 + (WIDTH * 4 * WIDTH + 4 * WIDTH) + (4 * WIDTH * WIDTH + WIDTH)
    root = VOCAB * WIDTH + WIDTH * VOCAB + VOCAB
    psi = root + LAYERS * block
    expected_gathered = 4 * (root + gathered_blocks(ZeroConfig(stage=3), root, block, psi) * block)
    held = _load(runs, run)["held"]
    print(f"{run}: shards {held['shards']} B, gathered peak {held['gathered']} B (estimator {expected_gathered} B),"
          f" whole model {4 * psi} B")
    assert held["gathered"] == expected_gathered
    assert held["shards"] <= 4 * psi / 2 + 4 * (LAYERS + 1)  # 1/N of every unit, padded
    assert held["shards"] + held["gathered"] < 4 * psi


def test_predict_without_a_checkpoint_materializes_the_meta_model(runs: Path) -> None:
    predictions = _load(runs, "zero3_no_ckpt")["predictions"]
    assert predictions.shape == (16, 9, 32) and bool(torch.isfinite(predictions).all())
    assert not torch.equal(predictions, _load(runs, "ddp")["predictions"][:16])  # initialized, not trained
