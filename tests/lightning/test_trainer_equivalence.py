"""Trainer-level runs at world size 2 (and resumes at 1) against DDP, one launched script each.

See tests/lightning/trainer_runs.py for the model (tied weights, BatchNorm, a frozen and an
optionally unused layer, two param groups, an LR scheduler) and the runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script

DDP = "ddp_find_unused_parameters_true"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trainer_runs")
    run_script("trainer_runs.py", "ws2", str(out), ranks=2)
    run_script("trainer_runs.py", "ws1", str(out), ranks=1)
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def assert_bitwise(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in b["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), f"{k}: max |diff| {(a['params'][k] - b['params'][k]).abs().max()}"
    assert a["losses"] == b["losses"]
    assert a["global_step"] == b["global_step"]


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_bitwise_equal_to_ddp_without_accumulation(runs: Path, stage: str) -> None:
    ours, ref = load(runs, f"{stage}_acc1"), load(runs, f"{DDP}_acc1")
    assert ref["global_step"] == 10
    assert_bitwise(ours, ref)
    for k in ref["buffers"]:  # BatchNorm statistics follow DDP's buffer broadcast
        assert torch.equal(ours["buffers"][k], ref["buffers"][k]), k
    assert ours["metrics"] == ref["metrics"]  # val_loss, torchmetrics accuracy, test after fit
    assert ours["summary_params"] == ref["summary_params"] == sum(p.numel() for p in ref["params"].values())


def test_zero1_accumulation_is_bitwise(runs: Path) -> None:
    assert_bitwise(load(runs, "zero1_acc3"), load(runs, f"{DDP}_acc3"))


@pytest.mark.parametrize("acc", [2, 3])
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_accumulation_within_1e6(runs: Path, stage: str, acc: int) -> None:
    ours, ref = load(runs, f"{stage}_acc{acc}"), load(runs, f"{DDP}_acc{acc}")
    rel = max_rel(ours["params"], ref["params"])
    print(f"{stage} accumulate_grad_batches={acc} max relative difference vs DDP: {rel:.2e}")
    assert rel < 1e-6


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_grad_norm_reported_and_clipping_matches_ddp(runs: Path, stage: str) -> None:
    ours, ref = load(runs, f"{stage}_clip"), load(runs, f"{DDP}_clip")
    assert max_rel(ours["params"], ref["params"]) < 1e-6
    for a, b in zip(ours["grad_norms"], ref["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-6 * b


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_manual_optimization_gan_with_toggle(runs: Path, stage: str) -> None:
    assert_bitwise(load(runs, f"{stage}_gan"), load(runs, f"{DDP}_gan"))


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_unused_parameter_gets_zero_gradient_within_its_unit(runs: Path, stage: str) -> None:
    # size-based units mix the skipped layer with used ones: it gets a zero gradient and AdamW
    # steps it; the reference multiplies the skipped layer by zero
    assert_bitwise(load(runs, f"{stage}_unused"), load(runs, f"{DDP}_unused"))


def test_unused_block_is_skipped_like_ddp_at_stage_3(runs: Path) -> None:
    # at stage 3 the skipped Linear is a unit of its own: no rank has a gradient for it, so its
    # shard keeps grad=None and AdamW skips it, exactly as DDP skips a globally unused parameter
    assert_bitwise(load(runs, "zero3_unused"), load(runs, f"{DDP}_unused_skipped"))


@pytest.mark.parametrize("source", [DDP, "zero2", "zero3"])
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_resume_full_checkpoint_at_world_size_2(runs: Path, source: str, stage: str) -> None:
    assert_bitwise(load(runs, f"resume_{source}_{stage}"), load(runs, f"resume_{source}_{DDP}"))


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_resume_zero2_checkpoint_at_world_size_1(runs: Path, stage: str) -> None:
    ours, ref = load(runs, f"ws1_resume_zero2_{stage}"), load(runs, "ws1_resume_zero2_ddp")
    assert ref["global_step"] == 20
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_checkpoint_has_ddp_format(runs: Path, stage: str) -> None:
    ours = torch.load(runs / f"{stage}_acc1.ckpt", weights_only=True)
    ref = torch.load(runs / f"{DDP}_acc1.ckpt", weights_only=True)
    assert ours["state_dict"].keys() == ref["state_dict"].keys()
    for key, value in ref["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    (opt,), (ref_opt,) = ours["optimizer_states"], ref["optimizer_states"]
    assert opt["param_groups"] == ref_opt["param_groups"]
    assert opt["state"].keys() == ref_opt["state"].keys()
    for i, state in ref_opt["state"].items():
        assert state.keys() == opt["state"][i].keys()
        for key, value in state.items():
            assert torch.equal(opt["state"][i][key], value), (i, key)



def test_zero3_configure_model_builds_on_meta_and_trains_as_ddp(runs: Path) -> None:
    """Built without memory and materialized by zero3; DDP trains an eager copy of the same initial weights (saved by
    rank 0 at the start of the zero3 run): 20 steps bitwise equal. Inside ``configure_model`` the weight reports the
    CPU, where the model computes, over no memory (a meta storage): [Note: a fake device] in recording.py."""
    res = load(runs, "zero3_configure_model")
    assert torch.load(runs / "zero3_configure_model_device.pt")["built_on"] == ("cpu", "meta")
    assert res["global_step"] == 20
    assert_bitwise(res, load(runs, f"{DDP}_configure_model"))


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_bf16_mixed_tracks_ddp_autocast(runs: Path, stage: str) -> None:
    ours, ref = load(runs, f"{stage}_bf16"), load(runs, f"{DDP}_bf16")
    assert ours["param_dtype"] == "torch.bfloat16" and ref["param_dtype"] == "torch.float32"
    worst = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"], strict=True))
    print(f"{stage} bf16-mixed: worst per-step loss difference vs DDP bf16-mixed {worst:.4f}")
    assert worst < 3e-2


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_bf16_mixed_with_fp32_embeddings_and_norms_tracks_ddp_autocast(runs: Path, stage: str) -> None:
    ours, ref = load(runs, f"{stage}_bf16keep"), load(runs, f"{DDP}_bf16")
    assert ours["param_dtype"] == "torch.bfloat16"  # the Linear layers compute from bf16 working weights
    worst = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"], strict=True))
    print(f"{stage} bf16-mixed, Embedding/LayerNorm kept fp32: worst per-step loss difference vs DDP {worst:.4f}")
    assert worst < 1e-2


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_bf16_mixed_checkpoint_holds_fp32_masters(runs: Path, stage: str) -> None:
    ours = torch.load(runs / f"{stage}_bf16.ckpt", weights_only=True)
    ref = torch.load(runs / f"{DDP}_bf16.ckpt", weights_only=True)
    assert ours["state_dict"].keys() == ref["state_dict"].keys()
    for key, value in ours["state_dict"].items():
        assert value.dtype == ref["state_dict"][key].dtype, key  # fp32 masters, like DDP's fp32 weights
    opt = ours["optimizer_states"][0]["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.values())


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_clipping_by_value_matches_ddp(runs: Path, stage: str) -> None:
    ours, ref = load(runs, f"{stage}_clipvalue"), load(runs, f"{DDP}_clipvalue")
    rel = max_rel(ours["params"], ref["params"])
    print(f"{stage} clip by value: max relative difference vs DDP {rel:.2e}")
    assert rel < 1e-6
