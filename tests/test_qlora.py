"""QLoRA under ZeRO: a bitsandbytes-quantized base (4-bit nf4/fp4, 8-bit) with peft LoRA adapters trains like DDP,
bitwise, at zero2, zero3 and zero3_offload, built in ``__init__`` or in ``configure_model`` (where zero3 reads and
quantizes each rank's shard). See [Note: packed parameters] and [Note: quantize on read]."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import SCRIPTS, run_script
from _pretrained_models import save_quantizable

sys.path.insert(0, str(SCRIPTS))  # qlora_runs: the quantization configurations and the probe
pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (`pip install lzero[qlora]`)")

DDP = ["llama:nf4:ddp:init:eval", "llama:fp4:ddp:init", "llama:int8:ddp:init:eval", "qwen2:nf4:ddp:init",
       "qwen2:int8:ddp:init"]
LZERO = ["llama:nf4:zero3:configure:eval", "llama:nf4:zero3:init", "llama:nf4:zero2:init", "llama:nf4:zero2:configure",
         "llama:nf4:zero3_offload:configure:ckpt", "llama:fp4:zero3:configure", "llama:int8:zero3:configure:eval",
         "llama:int8:zero3_offload:init", "qwen2:nf4:zero3:configure", "qwen2:nf4:zero3_offload:init",
         "qwen2:int8:zero3:configure", "qwen2:int8:zero2:init", "llama:nf4:zero3_offload_nvme:configure"]


RESUMED = "llama:nf4:zero3_offload:configure:resume"  # one rank, from the step-5 checkpoint of ...:ckpt


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qlora_models")
    save_quantizable(root)
    return root


@pytest.fixture(scope="module")
def runs(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qlora_runs")
    run_script("qlora_runs.py", str(models), str(out), *DDP, *LZERO, ranks=2, timeout=900)
    run_script("qlora_runs.py", str(models), str(out), RESUMED, ranks=1, timeout=300)
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


def test_adapters_exported_from_a_checkpoint_reopen_on_the_4bit_base(runs: Path, models: Path, tmp_path: Path) -> None:
    """``lzero export-hf --adapters-only`` of the zero3_offload checkpoint, reopened by peft on the base quantized by
    transformers itself: the trained module's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qlora_runs import PROBE, quantization

    out = tmp_path / "adapters"
    run = runs / "llama-nf4-zero3_offload-configure-ckpt"
    subprocess.run([sys.executable, "-m", "lzero.cli", "export-hf", "--adapters-only", "--config",
                    f"{run}-adapter-config", f"{run}-ckpt/last.ckpt", str(out)], check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(models / "llama", quantization_config=quantization("nf4"),
                                                dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, out).to(torch.bfloat16)  # peft loads adapters in fp32; trained: bf16-true
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training script
    try:
        with torch.no_grad():
            logits = model(input_ids=PROBE).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, _load(runs, "llama:nf4:zero3_offload:configure:ckpt")["logits"])


def test_resumed_at_world_size_1_continues_the_run(runs: Path) -> None:
    """The step-5 checkpoint of 2 ranks resumed on 1 rank (its shards re-sliced, the 4-bit base re-read and quantized
    by the one rank) with the same global batch: the uninterrupted run's losses (the mean of the 2 ranks' losses),
    equal up to the order of bf16 sums over the batch."""
    whole = _load(runs, "llama:nf4:zero3_offload:configure:ckpt")["mean_losses"]
    resumed = _load(runs, RESUMED)["losses"]
    assert len(resumed) == 5
    assert resumed == pytest.approx(whole[5:], rel=2e-3)
