"""QLoRA under ZeRO: a bitsandbytes-quantized base (4-bit nf4/fp4, 8-bit) with peft LoRA adapters trains like DDP,
bitwise, at zero2, zero3 and zero3_offload, built in ``__init__`` or in ``configure_model`` (where zero3 reads and
quantizes each rank's shard). See [Note: packed parameters] and [Note: quantize on read]."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import run_script
from _pretrained_models import save_quantizable

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (`pip install lzero[qlora]`)")

DDP = ["llama:nf4:ddp:init:eval", "llama:fp4:ddp:init", "llama:int8:ddp:init:eval", "qwen2:nf4:ddp:init",
       "qwen2:int8:ddp:init"]
LZERO = ["llama:nf4:zero3:configure:eval", "llama:nf4:zero3:init", "llama:nf4:zero2:init", "llama:nf4:zero2:configure",
         "llama:nf4:zero3_offload:configure", "llama:fp4:zero3:configure", "llama:int8:zero3:configure:eval",
         "llama:int8:zero3_offload:init", "qwen2:nf4:zero3:configure", "qwen2:nf4:zero3_offload:init",
         "qwen2:int8:zero3:configure", "qwen2:int8:zero2:init"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qlora_models")
    save_quantizable(root)
    return root


@pytest.fixture(scope="module")
def runs(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qlora_runs")
    run_script("qlora_runs.py", str(models), str(out), *DDP, *LZERO, ranks=2, timeout=900)
    return out


def _load(runs: Path, run: str) -> dict[str, Any]:
    return torch.load(runs / f"{run.replace(':', '-')}.pt", weights_only=True)


def _reference(run: str) -> str:
    model, quant, *_ = run.split(":")
    return next(r for r in DDP if r.startswith(f"{model}:{quant}:"))


@pytest.mark.parametrize("run", LZERO)
def test_qlora_trains_like_ddp(runs: Path, run: str) -> None:
    got, want = _load(runs, run), _load(runs, _reference(run))
    assert len(got["losses"]) == 10
    assert got["losses"] == want["losses"]  # bitwise: the same bf16 computation on the same codes
    assert got["adapters"].keys() == want["adapters"].keys() and len(got["adapters"]) == 8
    for name, value in want["adapters"].items():
        assert torch.equal(got["adapters"][name], value), name
        assert not torch.equal(value, got["start"][name]), name  # trained: every adapter moved


@pytest.mark.parametrize("run", [r for r in LZERO if r.endswith(":eval")])
def test_validation_and_generation_on_the_quantized_shards(runs: Path, run: str) -> None:
    got, want = _load(runs, run), _load(runs, _reference(run))
    assert got["val_loss"] == want["val_loss"]
    assert torch.equal(got["generated"], want["generated"]) and got["generated"].shape == (1, 9)
