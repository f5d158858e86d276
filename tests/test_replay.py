"""A model built on the meta device under zero3 starts from the weights the same code gives eagerly under DDP, with the
same seed, and trains as DDP does: [Note: replayed construction] in lzero/engine/replay.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import run_script

DDP = ["mlp:ddp:32-true", "llama:ddp:32-true", "gpt2:ddp:32-true", "t5:ddp:32-true", "lora:ddp:32-true"]
LZERO = ["mlp:zero3:32-true", "mlp:zero3_offload:32-true", "mlp:zero3_offload_nvme:32-true",
         "mlp:zero3:32-true:init_module", "mlp:zero3:bf16-mixed", "llama:zero3:32-true", "llama:zero3_offload:bf16-mixed",
         "gpt2:zero3:32-true", "gpt2:zero3_offload_nvme:32-true", "t5:zero3:32-true", "lora:zero3:32-true",
         "lora:zero3_offload:32-true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replay_runs")
    run_script("replay_runs.py", str(out), *DDP, *LZERO, ranks=2, timeout=900)
    return out


def _load(runs: Path, run: str) -> dict[str, Any]:
    return torch.load(runs / f"{run.replace(':', '-')}.pt", weights_only=True)


@pytest.mark.parametrize("run", LZERO)
def test_initial_state_is_the_eager_models_and_training_is_ddps(runs: Path, run: str) -> None:
    kind, _, precision, *_ = run.split(":")
    got, want = _load(runs, run), _load(runs, f"{kind}:ddp:32-true")
    assert got["initial"].keys() == want["initial"].keys()
    for name, value in want["initial"].items():
        mine = got["initial"][name]
        # bf16-mixed: the gathered parameters are the masters' bf16 rounding
        assert torch.equal(mine, value.to(mine.dtype)), name
    assert any(value.std() > 0 for value in want["initial"].values())  # random draws, not constants alone
    assert torch.equal(got["rng"], want["rng"])  # the global RNG continues where eager construction left it
    if precision == "32-true":
        assert got["losses"] == want["losses"] and len(got["losses"]) == 10
