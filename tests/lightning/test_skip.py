"""fp16 dynamic loss scaling and skipped steps at world size 2, under the Trainer.

See tests/lightning/skip_runs.py: rank 1 injects inf/NaN into one parameter's gradient at global
steps 3 (inf), 4 (NaN) and 9 (inf); the scaler starts at 2**8 with window 5 and hysteresis 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script

SKIPPED = [3, 4, 9]
# hand-computed (DeepSpeed's rules): step 3 uses up hysteresis, 4 halves, 9 halves again (the
# counter was not refilled: no growth since), then x2 at steps 14, 19, 24, 29, 34, 39
# ((step - 9) % 5 == 0)
SCALES = [256.0] * 4 + [128.0] * 5 + [64.0] * 5 + [128.0] * 5 + [256.0] * 5 + [512.0] * 5 + [1024.0] * 5 \
    + [2048.0] * 5 + [4096.0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("skip_runs")
    run_script("skip_runs.py", str(out), ranks=2)
    return out


def load(runs: Path, name: str, rank: int) -> dict:
    return torch.load(runs / f"{name}_rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_everywhere_and_follows_the_scale_rules(runs: Path, stage: str) -> None:
    for rank in (0, 1):
        res = load(runs, f"fp16_zero{stage}", rank)
        rows = res["rows"]
        assert res["global_step"] == 40  # skipped steps count toward global_step
        assert [i for i, r in enumerate(rows) if r["skipped"]] == SKIPPED
        # masters and optimizer state bitwise unchanged exactly across the skipped steps
        assert [i for i, r in enumerate(rows) if r["unchanged"]] == SKIPPED
        assert [r["scale"] for r in rows] == SCALES
        assert res["skipped_steps"] == 3
        # metrics: the scale each step used, and the running skip count
        assert [r["logged_scale"] for r in rows] == [256.0] + SCALES[:-1]
        assert [r["logged_skips"] for r in rows] == [float(sum(s <= i for s in SKIPPED)) for i in range(40)]
        # the step-interval LambdaLR(0.97**s) stepped only for the 37 steps taken
        assert rows[-1]["lr"] == pytest.approx(2e-2 * 0.97**37, rel=1e-12)
        assert rows[0]["master_dtype"] == "torch.float32" and rows[0]["param_dtype"] == "torch.float16"
        assert all(torch.isfinite(p).all() for p in res["params"].values())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_converges_and_tracks_fp32_with_the_same_skips(runs: Path, stage: int) -> None:
    fp16, fp32 = load(runs, f"fp16_zero{stage}", 0)["rows"], load(runs, "fp32_zero2", 0)["rows"]
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(fp16, fp32, strict=True))
    last = sum(r["loss"] for r in fp16[-5:]) / 5
    print(f"zero{stage} fp16: loss {fp16[0]['loss']:.3f} -> {last:.3f} (last 5), worst relative difference vs fp32"
          f" {worst:.2e}")
    assert last < 0.25 * fp16[0]["loss"]
    assert worst < 1e-2


@pytest.mark.parametrize("name", ["fp32_zero2", "bf16_zero3"])
def test_nonfinite_gradient_skips_and_counts_in_fp32_and_bf16(runs: Path, name: str) -> None:
    for rank in (0, 1):
        res = load(runs, name, rank)
        assert [i for i, r in enumerate(res["rows"]) if r["skipped"]] == SKIPPED
        assert [i for i, r in enumerate(res["rows"]) if r["unchanged"]] == SKIPPED
        assert res["skipped_steps"] == 3
        assert all(r["scale"] == 1.0 for r in res["rows"])
        assert [r["logged_skips"] for r in res["rows"]][:5] == [-1.0, -1.0, -1.0, 1.0, 2.0]  # from the first skip
        assert all(torch.isfinite(p).all() for p in res["params"].values())  # NaN never reached the masters


def test_loss_scaler_state_survives_save_and_resume(runs: Path) -> None:
    # 20 steps, save, resume to 30 vs 30 uninterrupted; overflow again at 22, after the resume
    full, resumed = load(runs, "fp16_full", 0), load(runs, "fp16_resumed", 0)
    ckpt = torch.load(runs / "fp16_first.ckpt", weights_only=True)
    assert ckpt["ZeroPrecision"] == {"skipped_steps": 3, "loss_scaler": {
        "scale": 256.0, "iteration": 20, "last_overflow_iteration": 9, "hysteresis_left": 2,
        "overflows_at_min_scale": 0}}
    assert [r["scale"] for r in resumed["rows"]] == [r["scale"] for r in full["rows"]][20:]
    assert [r["loss"] for r in resumed["rows"]] == [r["loss"] for r in full["rows"]][20:]
    assert resumed["skipped_steps"] == full["skipped_steps"] == 4
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_overflowing_at_min_scale_ends_training_with_a_clear_error(runs: Path) -> None:
    for rank in (0, 1):
        res = load(runs, "fp16_stuck", rank)
        # 256 -> 128 -> 64 (= min_loss_scale) at steps 2 and 3, then 3 overflows at 64: steps 4, 5, 6
        assert res["global_step"] == 6
        assert res["error"].startswith("LossScaleError: fp16 gradients overflowed in 3 consecutive steps at the"
                                       " minimum loss scale 64")
        assert "HINT" in res["error"]


def test_nonfinite_raise_policy(runs: Path) -> None:
    for rank in (0, 1):
        res = load(runs, "fp32_raise", rank)
        assert res["error"].startswith("FloatingPointError: A gradient is inf/NaN at global step 3")
        assert res["global_step"] == 3


def _nan_fit(precision_plugin, steps: int, nan_from: int):
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class NanFrom(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            return loss * float("nan") if self.global_step >= nan_from else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(128, 3), torch.randn(128, 1)), batch_size=4)
    trainer = Trainer(strategy="zero2", plugins=[precision_plugin], accelerator="cpu", devices=1, max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = NanFrom()
    trainer.fit(model, data)
    return trainer, model


def test_a_run_of_skipped_steps_stops_training_naming_the_first(in_process_fit) -> None:
    """Every gradient NaN from global step 2 on: the 10th skip in a row stops the run, naming steps 2 to 11,
    with the parameters as they were after step 1 (no NaN reached them)."""
    from lzero import ZeroPrecision

    with pytest.raises(FloatingPointError, match=r"10 optimizer steps in a row were skipped .* from global step 2"
                                                 r" to 11: the model is not training\. HINT"):
        _nan_fit(ZeroPrecision("32-true"), steps=20, nan_from=2)


def test_a_disabled_limit_lets_training_finish(in_process_fit) -> None:
    from lzero import ZeroPrecision

    trainer, model = _nan_fit(ZeroPrecision("32-true", max_consecutive_skips=0), steps=15, nan_from=2)
    assert trainer.global_step == 15 and trainer.precision_plugin.skipped_steps == 13
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match=r"`max_consecutive_skips=-1` must be a whole number >= 0"):
        ZeroPrecision("32-true", max_consecutive_skips=-1)


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_fp16_skips_the_same_steps_and_scales_bitwise(runs: Path, stage: int) -> None:
    """zero2_offload / zero3_offload (host step with the same kernel, fused=False) against the device runs."""
    for rank in (0, 1):
        off, dev = load(runs, f"fp16_zero{stage}_offload", rank), load(runs, f"fp16_zero{stage}", rank)
        assert [i for i, r in enumerate(off["rows"]) if r["skipped"]] == SKIPPED
        assert [i for i, r in enumerate(off["rows"]) if r["unchanged"]] == SKIPPED
        assert [r["scale"] for r in off["rows"]] == SCALES
        assert [r["loss"] for r in off["rows"]] == [r["loss"] for r in dev["rows"]]
        for name, value in dev["params"].items():
            assert torch.equal(off["params"][name], value), name
