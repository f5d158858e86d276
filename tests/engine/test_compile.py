"""Blocks compiled with torch.compile (inductor) at world size 2: zero2 and zero3 against DDP.

See tests/engine/compile_runs.py: three LayerNorm+Linear blocks compiled in ``configure_model``
(``torch.compile(block)``, ``block.compile()``, or the whole ``nn.Sequential``), 4 steps of AdamW
and a validation pass.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import pytest
import torch

from _launch import run_script


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compile_runs")
    # inductor's on-disk cache does not key its kernels by ATen's CPU capability: kernels cached by a run with the
    # default kernels, reused under ATEN_CPU_CAPABILITY=avx2, gave DDP NaN weights (torch 2.13); one cache per capability
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    cache = Path(tempfile.gettempdir()) / f"lzero-tests-inductor-{getpass.getuser()}-{capability}"
    run_script("compile_runs.py", str(out), "inductor", ranks=2, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
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


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc(h)


def test_zero3_refuses_one_full_graph_around_several_units(in_process_fit) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lzero import ZeroStrategy
    from lzero.engine.engine import ZeroEngineError

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.Sequential(_Block(), _Block())
            self.blocks = torch.compile(self.blocks, backend="eager", fullgraph=True)

        def training_step(self, batch, batch_idx):
            raise AssertionError("refused before the first step")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=1, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ZeroEngineError, match=r"`blocks` is compiled with fullgraph=True around the zero3 units"
                                              r" \['blocks._orig_mod.0', 'blocks._orig_mod.1'\].*HINT: compile each"):
        trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
