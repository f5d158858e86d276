"""``lzero.grad_norm(self, norm_type)`` in ``on_before_optimizer_step`` equals Lightning's ``grad_norm(self)`` under
DDP: the same keys (tied, frozen and BatchNorm parameters of TiedNet), values within 1e-6 relative, with one
all-reduce per call. Lightning's own function under zero3, which finds no ``p.grad``, warns once naming lzero's.
See [Note: per-parameter gradient norms] in lzero/grad_norms.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grad_norm_runs")
    run_script("grad_norm_runs.py", str(out), ranks=2)
    return out


def _load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("run,reference", [("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "ddp"),
                                           ("zero2_acc2", "ddp_acc2"), ("ddp_lzero", "ddp")])
def test_per_parameter_norms_equal_lightning_under_ddp(runs: Path, run: str, reference: str) -> None:
    ours, ref = _load(runs, run)["records"], _load(runs, reference)["records"]
    assert len(ours) == len(ref) == 3
    for step, (a, b) in enumerate(zip(ours, ref)):
        for norm in ("2", "inf"):
            assert a[norm].keys() == b[norm].keys(), (step, norm, set(a[norm]) ^ set(b[norm]))
            assert "grad_2.0_norm/embed.weight" in b["2"] and "grad_2.0_norm/frozen.weight" not in b["2"]
            for key, value in b[norm].items():
                assert abs(a[norm][key] - value) <= 1e-6 * abs(value) + 1e-12, (run, step, key, a[norm][key], value)
        if run != "ddp_lzero":
            assert a["all_reduces"] == 2  # one per call: the 2-norm and the inf-norm


def test_lightning_grad_norm_under_zero3_warns_once(runs: Path) -> None:
    got = _load(runs, "zero3_lightning")
    assert all(r["2"] == {} for r in got["records"])  # Lightning's function finds no p.grad under ZeRO ...
    warned = [w for w in got["warnings"] if "lzero.grad_norm(self" in w]
    assert len(warned) == 1 and "returns {}" in warned[0]  # ... and the user is told, once
    assert not any("lzero.grad_norm(self" in w for w in _load(runs, "zero3")["warnings"])
