"""lzero under Lightning Fabric: the names in Fabric's registry, a Fabric training script at every stage against the
same script under Fabric's DDP, resume at another stage, litgpt's ``finetune_full`` unchanged under ``LT_STRATEGY``,
and the calls refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launch import SCRIPTS, run_script

import _lzero_startup

STAGES = ("zero1", "zero2", "zero3", "zero3_offload")


def python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **(env or {})})


def test_names_in_fabric_registry_without_importing_lzero() -> None:
    out = python("import sys\nfrom lightning.fabric.strategies import STRATEGY_REGISTRY as r\n"
                 "print(sorted(k for k in r if k.startswith('zero')), 'lzero' in sys.modules)").stdout.strip()
    assert out == f"{sorted(_lzero_startup.PRESETS)} False"


def test_fabric_builds_the_strategy_by_name_and_suggests_the_nearest() -> None:
    out = python("import lightning as L\nf = L.Fabric(strategy='zero3_offload', accelerator='cpu', devices=1)\n"
                 "print(type(f.strategy).__name__, f.strategy.config.stage, f.strategy.config.offload_param.device)")
    assert out.stdout.strip() == "ZeroFabricStrategy 3 cpu", out.stderr[-2000:]
    bad = python("import lightning as L\nL.Fabric(strategy='zero_3', accelerator='cpu', devices=1)")
    assert "did you mean lzero's `strategy='zero3'`" in bad.stderr, bad.stderr[-2000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric")
    for strategy in ("ddp", *STAGES):
        run_script("fabric_runs.py", strategy, str(out / strategy))
    run_script("fabric_runs.py", "zero2", str(out / "resumed"), "--resume", str(out / "zero3.ckpt"))
    return out


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


@pytest.mark.parametrize("stage", STAGES)
def test_fabric_script_matches_ddp(runs: Path, stage: str) -> None:
    """Meta build + init after it, set up alone, AdamW from the set-up model, LambdaLR, 2 micro-batches under
    no_backward_sync, clip_gradients(max_norm), 4 steps, model.state_dict() on every rank."""
    ours, ref = torch.load(runs / stage), torch.load(runs / "ddp")
    assert ours["initial"].keys() == ref["initial"].keys()
    for key in ref["initial"]:  # eager weights under DDP; replayed (zero3) or built eagerly (zero1-2)
        assert torch.equal(ours["initial"][key], ref["initial"][key]), key
    assert ours["losses"][:2] == ref["losses"][:2]  # the first micro-batches see the same weights
    # reduced per micro-batch and summed (stages 2-3), and the norm summed over shards: rounding only
    rel = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"] + ours["norms"], ref["losses"] + ref["norms"]))
    assert rel < 1e-6, rel
    assert _max_rel(ours["final"], ref["final"]) < 1e-3
    assert ours["lr"] == ref["lr"]
    assert "built before `fabric.setup_module(model)`" in ours["refused"]["stale_optimizer"]


def test_resume_at_another_stage_continues_the_run(runs: Path) -> None:
    whole, resumed = torch.load(runs / "zero3"), torch.load(runs / "resumed")
    assert resumed["losses"] == whole["losses"][4:]
    assert resumed["lr"] == whole["lr"]
    for key, value in whole["final"].items():
        assert torch.equal(resumed["final"][key], value), key


def test_save_on_one_rank_fails_within_seconds(tmp_path: Path) -> None:
    out = tmp_path / "misuse.txt"
    run_script("fabric_misuse.py", str(out), "save", timeout=120)
    what, seconds, message = out.read_text().strip().split("\t")
    assert what == "save" and float(seconds) < 10
    assert "`fabric.save` is a collective" in message and "not inside `if fabric.global_rank == 0:`" in message


def _litgpt_run(ckpt: Path, out: Path, strategy: str) -> list[float]:
    cmd = [str(Path(sys.executable).parent / "litgpt"), "finetune_full", str(ckpt), "--devices", "2",
           "--precision", "32-true", "--data", "JSON", "--data.json_path", str(ckpt / "data.json"),
           "--data.val_split_fraction", "0.25", "--data.num_workers", "0", "--train.global_batch_size", "4",
           "--train.micro_batch_size", "2", "--train.max_steps", "3", "--train.save_interval", "3",
           "--train.log_interval", "1", "--train.lr_warmup_steps", "1", "--train.max_seq_length", "32",
           "--eval.interval", "100", "--eval.max_iters", "1", "--eval.initial_validation", "false",
           "--eval.final_validation", "false", "--logger_name", "csv", "--out_dir", str(out)]
    env = {**os.environ, "LT_STRATEGY": strategy, "LT_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (out / "logs" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("loss")
    return [float(r.split(",")[column]) for r in rows[1:] if r.split(",")[column]]


def test_litgpt_finetune_full_unchanged_under_zero3(tmp_path: Path) -> None:
    """litgpt 0.5.13's own script: the strategy comes from LT_STRATEGY only; its model is built with
    init_module(empty_init=True), set up alone, and loaded with model.load_state_dict after setup_optimizers."""
    ckpt = tmp_path / "ckpt"
    subprocess.run([sys.executable, str(SCRIPTS / "make_litgpt_checkpoint.py"), str(ckpt)], check=True)
    ddp = _litgpt_run(ckpt, tmp_path / "ddp", "ddp")
    zero3 = _litgpt_run(ckpt, tmp_path / "zero3", "zero3")
    assert len(ddp) == 3 and zero3 == ddp  # fp32, no accumulation: bitwise
    from lzero.checkpoint.reader import ShardedCheckpoint

    ours = ShardedCheckpoint(tmp_path / "zero3" / "final" / "lit_model.pth").full_state_dict()
    ref = torch.load(tmp_path / "ddp" / "final" / "lit_model.pth")["model"]
    assert ours.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(ours[key], value), key
