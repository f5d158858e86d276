"""``lzero export-hf --merge``: peft LoRA adapters folded into their base as peft's ``merge_and_unload()`` folds them,
written one tensor at a time. See [Note: a merged export] in lzero/hf/merge.py. The trained cases (a Llama under
zero3_offload and DDP, a 4-bit QLoRA base) are in test_pretrained.py and test_qlora.py, on their runs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _pretrained_models import configs

pytest.importorskip("peft")

PROBE = torch.arange(10).reshape(1, 10)


def _lora(model: nn.Module, seed: int = 3, **options: Any) -> nn.Module:
    """``model`` with peft LoRA adapters, B drawn too (peft starts it at zero, which merges to nothing), and the
    copies of the modules trained whole (``modules_to_save``) moved off the originals."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(lora_dropout=0.0, **options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name or ".modules_to_save." in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return peft


def _lightning_file(model: nn.Module, path: Path) -> Path:
    """What a DDP checkpoint holds: the LightningModule's state dict, the model under ``model.``."""
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1}, path)
    return path


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("merge") / "gpt2"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(configs()["gpt2"]).save_pretrained(folder)
    return folder


def _gpt2_lora(gpt2: Path, **options: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return _lora(AutoModelForCausalLM.from_pretrained(gpt2, dtype=torch.float32), r=4, lora_alpha=8,
                 target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, **options)


@pytest.mark.parametrize("options", [dict(rank_pattern={"h.1.attn.c_attn": 2}, alpha_pattern={"c_fc": 3}),
                                     dict(use_rslora=True)], ids=["patterns", "rslora"])
def test_gpt2_conv1d_merges_as_peft_does(gpt2: Path, tmp_path: Path, options: dict) -> None:
    """GPT-2's ``Conv1D`` stores its weight as (in, out) (``fan_in_fan_out``): the delta is transposed; per-module
    ranks and alphas (``rank_pattern``/``alpha_pattern``) and ``use_rslora`` scale it as peft does. From a plain
    Lightning file, equal to ``merge_and_unload()`` bitwise, every key the base model's."""
    from lzero.hf import export_hf

    peft = _gpt2_lora(gpt2, **options)
    assert {m.r["default"] for m in peft.modules() if hasattr(m, "lora_A")} == ({2, 4} if "rank_pattern" in options
                                                                               else {4})
    peft.peft_config["default"].save_pretrained(tmp_path / "adapter")
    ckpt = _lightning_file(peft, tmp_path / "last.ckpt")
    done = export_hf(ckpt, tmp_path / "merged", config=gpt2, adapter_config=tmp_path / "adapter", merge=True)
    assert done["merged"] == 8 and done["dequantized"] == 0 and done["prefix"] == "model."
    reference = {k: v for k, v in peft.merge_and_unload().state_dict().items() if k != "lm_head.weight"}  # tied
    exported = _safetensors(tmp_path / "merged")
    assert exported.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key


def test_modules_to_save_the_live_peft_config_and_a_peft_model_saved_on_its_own(gpt2: Path, tmp_path: Path) -> None:
    """A module trained whole (``modules_to_save``) replaces the original, as ``merge_and_unload()`` unwraps it;
    ``adapter_config`` may be the live ``LoraConfig`` (what ``ExportHF(merge=True)`` passes); a state dict of the
    peft model itself (keys ``base_model.model.*``, no LightningModule prefix) merges the same."""
    from lzero.hf import export_hf

    peft = _gpt2_lora(gpt2, modules_to_save=["ln_f"])
    assert any(".modules_to_save." in k for k in peft.state_dict())
    torch.save(peft.state_dict(), tmp_path / "peft.pt")
    export_hf(tmp_path / "peft.pt", tmp_path / "merged", adapter_config=peft.peft_config["default"], merge=True)
    reference = peft.merge_and_unload().state_dict()
    exported = _safetensors(tmp_path / "merged")
    assert exported.keys() == reference.keys() - {"lm_head.weight"}
    assert all(torch.equal(v, reference[k]) for k, v in exported.items())


def test_merge_refusals_name_the_fix(gpt2: Path, tmp_path: Path) -> None:
    from lzero.checkpoint import CheckpointError
    from lzero.cli import main as lzero_command
    from lzero.hf import export_hf

    peft = _gpt2_lora(gpt2)
    ckpt = _lightning_file(peft, tmp_path / "last.ckpt")
    config = peft.peft_config["default"]
    out = tmp_path / "out"
    cases = [
        (dict(merge=True, adapters_only=True, config=gpt2), r"--merge and --adapters-only.*HINT: pass one"),
        (dict(merge=True, config=gpt2), r"LoRA adapters but no adapter configuration.*HINT: pass --adapter-config"),
        (dict(merge=True, adapter_config=gpt2), r"`.*gpt2` holds no adapter_config.json.*HINT"),
        (dict(merge=True, adapter_config={**config.to_dict(), "use_dora": True}), r"`use_dora=True`.*HINT"),
        (dict(merge=True, adapter_config={**config.to_dict(), "peft_type": "IA3"}), r"IA3 adapter.*LoRA.*HINT"),
        (dict(merge=True, adapter_config={**config.to_dict(), "r": 8}), r"rank 8.*HINT"),
        (dict(merge=True, adapter_config={**config.to_dict(), "fan_in_fan_out": False}),
         r"delta of `.*h.0.attn.c_attn.base_layer.weight` has shape \[96, 32\], the weight \[32, 96\].*fan_in_fan_out"),
        (dict(config=gpt2), r"holds peft LoRA adapters.*HINT: pass --merge"),
    ]
    for kwargs, message in cases:
        with pytest.raises(CheckpointError, match=f"(?s){message}"):
            export_hf(ckpt, out, **kwargs)
        assert not out.exists()
    assert lzero_command(["export-hf", "--merge", "--adapters-only", str(ckpt), str(out)]) == 1


def test_merge_without_adapters_exports_the_model_as_it_is(gpt2: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """A plain model's checkpoint under --merge: nothing to fold, the export a plain export writes, and a note."""
    from transformers import AutoModelForCausalLM

    from lzero.cli import main as lzero_command

    ckpt = _lightning_file(AutoModelForCausalLM.from_pretrained(gpt2, dtype=torch.float32), tmp_path / "last.ckpt")
    assert lzero_command(["export-hf", "--merge", "--config", str(gpt2), str(ckpt), str(tmp_path / "merged")]) == 0
    assert "--merge found no LoRA adapters and no quantized weight" in capsys.readouterr().out
    assert lzero_command(["export-hf", "--config", str(gpt2), str(ckpt), str(tmp_path / "plain")]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "merged").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "plain").iterdir()}


MEMORY = """
import json, sys, torch
import lzero.hf.merge, lzero.checkpoint.reader, lzero.checkpoint.consolidate, safetensors.torch
from lzero.hf import export_hf

def kib(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

torch.ones(64, 64) @ torch.ones(64, 64)  # the matmul kernels' pages, before the baseline
baseline = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from VmRSS
done = export_hf(sys.argv[1], sys.argv[2], merge=True, adapter_config=sys.argv[3], max_shard_size="2MB")
print(json.dumps({"baseline": baseline * 1024, "peak": kib("VmHWM") * 1024, "files": len(done["files"])}))
"""


def test_merge_streams_one_tensor_at_a_time(tmp_path: Path) -> None:
    """Peak memory of ``export_hf(merge=True)`` in a fresh process (VmHWM, reset once the imports are done) on a
    sharded zero3 checkpoint of a 16-layer Llama with LoRA on every projection: 68.2 MB of fp32 weights, the largest
    tensor 1.05 MB, 49 files of at most 2 MB. Measured: 10.1-10.2 MB above the baseline (the file being filled and
    safetensors' serialized copy of it, one weight read, its delta and the sum, and the freed blocks glibc keeps of
    tensors this small), 15% of the model; the bound is a third."""
    from peft import LoraConfig  # noqa: F401 (peft present: the reference is built here, not in the measured process)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lzero import ZeroConfig, ZeroEngine
    from lzero.checkpoint.sharded import save_sharded
    from lzero.checkpoint.state_dict import sharded_state_dict

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False)
    peft = _lora(AutoModelForCausalLM.from_config(config), r=8, lora_alpha=16,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft.peft_config["default"].save_pretrained(tmp_path / "adapter")
    reference = copy.deepcopy(peft).merge_and_unload().state_dict()
    total = sum(v.numel() * v.element_size() for v in reference.values())
    holder = nn.Module()
    holder.model = peft  # as a LightningModule holds it: keys under model.
    engine = ZeroEngine(holder, [torch.optim.SGD([p for p in holder.parameters() if p.requires_grad], lr=0.1)],
                        ZeroConfig(stage=3))
    try:
        checkpoint = {"state_dict": sharded_state_dict(engine, holder), "global_step": 0, "epoch": 0,
                      "pytorch-lightning_version": "test"}
        save_sharded(tmp_path / "last.ckpt", engine, [], checkpoint, None, stage=3, precision="32-true")
    finally:
        engine.remove()
    done = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path / "last.ckpt"), str(tmp_path / "merged"),
                           str(tmp_path / "adapter")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    exported = _safetensors(tmp_path / "merged")
    assert exported.keys() == reference.keys() and all(torch.equal(exported[k], v) for k, v in reference.items())
    assert measured["files"] >= 15 and total > 30e6
    assert measured["peak"] - measured["baseline"] < total / 3, (measured, total)
