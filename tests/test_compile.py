"""Blocks compiled with torch.compile (inductor) at world size 2: zero2 and zero3 against DDP.

See tests/scripts/compile_runs.py: three LayerNorm+Linear blocks compiled in ``configure_model``
(``torch.compile(block)``, ``block.compile()``, or the whole ``nn.Sequential``), 4 steps of AdamW
and a validation pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compile_runs")
    run_script("compile_runs.py", str(out), "inductor")
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("run", ["zero2_blocks", "zero3_blocks", "zero3_container"])
def test_compiled_blocks_equal_ddp_bitwise(runs: Path, run: str) -> None:
    ours, ref = load(runs, run), load(runs, f"ddp_{run.split('_')[1]}")
    assert ref["global_step"] == ours["global_step"] == 4
    assert ours["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        assert torch.equal(ours["params"][k], v), f"{k}: max |diff| {(ours['params'][k] - v).abs().max()}"
    assert ours["losses"] == ref["losses"]
    assert ours["val_loss"] == ref["val_loss"]
    assert ours["summary_params"] == sum(p.numel() for p in ref["params"].values())


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_compiled_blocks_trace_the_same_graphs_as_ddp(runs: Path, stage: str) -> None:
    # lzero's gather hooks run outside the compiled blocks: no graph break, no recompilation
    ours, ref = load(runs, f"{stage}_blocks")["dynamo"], load(runs, "ddp_blocks")["dynamo"]
    assert ours["stats"]["unique_graphs"] == ref["stats"]["unique_graphs"] > 0
    assert ours["graph_break"] == ref["graph_break"] == {}
    assert ours["recompiles"] == ref["recompiles"] == {}
