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

from _launch import run_script
from _pretrained_models import save_quantizable

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (`pip install lzero[qlora]`)")

DDP = ["llama:nf4:ddp:init:eval", "llama:fp4:ddp:init", "llama:int8:ddp:init:eval", "qwen2:nf4:ddp:init",
       "qwen2:int8:ddp:init", "llama:nf4:ddp:configure:peft", "llama:int8:ddp:configure:peft"]
LZERO = ["llama:nf4:zero3:configure:eval", "llama:nf4:zero3:init", "llama:nf4:zero2:init", "llama:nf4:zero2:configure",
         "llama:nf4:zero3_offload:configure:ckpt", "llama:fp4:zero3:configure", "llama:int8:zero3:configure:eval",
         "llama:int8:zero3_offload:init", "qwen2:nf4:zero3:configure", "qwen2:nf4:zero3_offload:init",
         "qwen2:int8:zero3:configure", "qwen2:int8:zero2:init", "llama:nf4:zero3_offload_nvme:configure",
         "llama:int8:zero2:configure", "qwen2:int8:zero3:init", "qwen2:int8:zero3_offload:configure",
         # as users write it: the adapters as peft draws them, in `configure_model` (each rank reads its shard)
         "llama:nf4:zero3:configure:peft", "llama:nf4:zero3_offload:configure:peft", "llama:int8:zero3:configure:peft"]


# each as the first run of a fresh process (bitsandbytes' 4-bit tables made in bf16, the default dtype of bf16-true's
# `configure_model`): last in the launch, since later runs would keep their tables
FRESH = ["llama:nf4:ddp:configure:peft:fresh", "llama:nf4:zero3:configure:peft:fresh",
         "llama:nf4:zero3_offload:configure:peft:fresh"]

RESUMED = "llama:nf4:zero3_offload:configure:resume"  # one rank, from the step-5 checkpoint of ...:ckpt


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qlora_models")
    save_quantizable(root)
    return root


@pytest.fixture(scope="module")
def runs(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qlora_runs")
    run_script("qlora_runs.py", str(models), str(out), *DDP, *LZERO, *FRESH, ranks=2, timeout=900)
    run_script("qlora_runs.py", str(models), str(out), RESUMED, ranks=1, timeout=300)
    return out


def _load(runs: Path, run: str) -> dict[str, Any]:
    return torch.load(runs / f"{run.replace(':', '-')}.pt", weights_only=True)


def _reference(run: str) -> str:
    model, quant, *_ = run.split(":")
    peft = run.endswith(":peft")
    return next(r for r in DDP if r.startswith(f"{model}:{quant}:") and r.endswith(":peft") == peft)


@pytest.mark.parametrize("run", LZERO)
def test_qlora_trains_like_ddp(runs: Path, run: str) -> None:
    got, want = _load(runs, run), _load(runs, _reference(run))
    assert len(got["losses"]) == 10
    assert got["losses"] == want["losses"]  # bitwise: the same bf16 computation on the same codes
    assert got["adapters"].keys() == want["adapters"].keys() and len(got["adapters"]) == 8
    for name, value in want["adapters"].items():
        assert torch.equal(got["adapters"][name], value), name
        assert not torch.equal(value, got["start"][name]), name  # trained: every adapter moved
        if run.endswith(":peft"):  # drawn by peft, in `configure_model`, as eager DDP drew them
            assert torch.equal(got["start"][name], want["start"][name]), name
            assert got["start"][name].std() > 0 or "lora_B" in name, name  # B starts at zero


@pytest.mark.parametrize("run", FRESH[1:])
def test_qlora_built_in_configure_model_under_bf16_true_in_a_fresh_process(runs: Path, run: str) -> None:
    """[Note: the construction's default dtype] in engine/recording.py: the base read and quantized at setup, and the
    replay, run under bf16 as DDP's `configure_model` does, so bitsandbytes' first (per-process) tables are DDP's.
    Measured before: first loss 4.87612 against DDP's 4.876325, adapters 8.4% apart after 10 steps."""
    got, want = _load(runs, run), _load(runs, FRESH[0])
    # the case is real: DDP itself computes otherwise with the fp32 tables of a process whose first run was eager
    assert want["losses"][0] != _load(runs, "llama:nf4:ddp:configure:peft")["losses"][0]
    assert len(got["losses"]) == 10 and got["losses"] == want["losses"]
    assert got["adapters"].keys() == want["adapters"].keys() and len(got["adapters"]) == 8
    for name, value in want["adapters"].items():
        assert torch.equal(got["start"][name], want["start"][name]), name
        assert torch.equal(got["adapters"][name], value), name


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
    from lzero.cli import main as lzero_command

    run = runs / "llama-nf4-zero3_offload-configure-ckpt"
    assert lzero_command(["export-hf", "--adapters-only", "--config", f"{run}-adapter-config",
                          f"{run}-ckpt/last.ckpt", str(out)]) == 0
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


def _merged_by_peft(peft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What peft's bnb layers compute when they merge, before quantizing the sum again: the weight dequantized
    (``dequantize_bnb_weight``), in the adapters' dtype, plus ``get_delta_weight``; key -> merged weight."""
    from peft.tuners.lora.bnb import Linear4bit, Linear8bitLt
    from peft.utils.integrations import dequantize_bnb_weight

    merged = {}
    for name, module in peft.named_modules():
        if isinstance(module, (Linear4bit, Linear8bitLt)):
            weight = module.get_base_layer().weight
            state = weight.quant_state if isinstance(module, Linear4bit) else module.get_base_layer().state
            delta = module.get_delta_weight("default")
            merged[f"{name.removeprefix('base_model.model.')}.weight"] = \
                dequantize_bnb_weight(weight, state=state).to(delta.dtype) + delta
    return merged


def test_merged_export_of_the_4bit_checkpoint_is_peft_s_merge_in_bf16(runs: Path, models: Path,
                                                                      tmp_path: Path) -> None:
    """``lzero export-hf --merge`` of the zero3_offload checkpoint: each 4-bit weight dequantized from its codes and
    saved quantization state, the adapters folded in, in bf16, a plain model. The reference is peft on the codes the
    run trained on (put into the layers transformers builds: bitsandbytes' code tables depend on the process, see
    qlora_runs.py): bitwise what its bnb layers compute when they merge (before they quantize the sum again);
    ``merge_and_unload()`` on that base dequantized (plain bf16 layers) gives the same base weights bitwise, and
    merged weights within one bf16 rounding (its plain layers multiply bf16 adapters in fp32, its bnb layers in bf16).
    config.json has no ``quantization_config``: transformers loads plain bf16 ``nn.Linear`` layers."""
    import json

    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from peft import PeftModel
    from peft.utils.integrations import dequantize_bnb_weight
    from transformers import AutoModelForCausalLM

    from lzero.checkpoint.reader import ShardedCheckpoint
    from lzero.cli import main as lzero_command
    from qlora_runs import quantization

    run = runs / "llama-nf4-zero3_offload-configure-ckpt"
    out, adapters = tmp_path / "merged", tmp_path / "adapters"
    assert lzero_command(["export-hf", "--merge", "--config", str(models / "llama"), "--adapter-config",
                          f"{run}-adapter-config", f"{run}-ckpt/last.ckpt", str(out)]) == 0
    assert lzero_command(["export-hf", "--adapters-only", "--config", f"{run}-adapter-config", f"{run}-ckpt/last.ckpt",
                          str(adapters)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    exported = _safetensors(out)
    assert len(exported) == 21 and {v.dtype for v in exported.values()} == {torch.bfloat16}
    base = AutoModelForCausalLM.from_pretrained(models / "llama", quantization_config=quantization("nf4"),
                                                dtype=torch.bfloat16)
    peft = PeftModel.from_pretrained(base, adapters).to(torch.bfloat16)  # the adapters as trained: bf16
    reader = ShardedCheckpoint(f"{run}-ckpt/last.ckpt")
    dequantized = {}
    for name, module in peft.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = f"model.{name}.weight"
            module.weight.data = reader.state_tensor(key)
            module.weight.quant_state = F.QuantState.from_dict(
                {k[len(key) + 1:]: reader.state_tensor(k) for k in reader.manifest["state_dict_keys"]
                 if k.startswith(f"{key}.")}, device=torch.device("cpu"))
            plain_key = name.removeprefix("base_model.model.").removesuffix(".base_layer") + ".weight"
            dequantized[plain_key] = dequantize_bnb_weight(module.weight, state=module.weight.quant_state)
    by_peft = _merged_by_peft(peft)
    assert len(dequantized) == 14 and len(by_peft) == 4
    assert all(torch.equal(exported[k], v) for k, v in by_peft.items())
    plain = AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.bfloat16)
    plain.load_state_dict(dequantized, strict=False)
    reference = PeftModel.from_pretrained(plain, adapters).to(torch.bfloat16).merge_and_unload().state_dict()
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], v) for k, v in reference.items() if k not in by_peft)
    for key in by_peft:  # measured: equal on this run; the two products may round one ulp apart
        assert torch.allclose(exported[key], reference[key], rtol=2**-7, atol=0), key
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())
    # a process that cannot import peft (nor needs bitsandbytes' layers) opens it as that model
    from test_pretrained import _logits_without_peft

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            here = model(input_ids=torch.arange(10).reshape(1, 10)).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_logits_without_peft(out), here)


@pytest.mark.parametrize("quant", ["fp4", "int8"])
def test_merged_export_of_fp4_and_8bit_bases_is_peft_s_merge(models: Path, quant: str, tmp_path: Path) -> None:
    """A 4-bit fp4 base (uint8 storage, no double quantization) and an LLM.int8 base (codes and ``SCB``) with drawn
    bf16 adapters, saved as a Lightning file: the merged export is what peft's bnb merge computes (the 8-bit weight
    dequantized in fp32, cast to the adapters' bf16, the delta added), bitwise; the quantized model's config.json
    loses its ``quantization_config``, so transformers opens the folder as a plain bf16 model."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lzero.hf import export_hf
    from qlora_runs import quantization

    base = AutoModelForCausalLM.from_pretrained(models / "llama", quantization_config=quantization(quant),
                                                dtype=torch.bfloat16)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.data = (torch.randn(p.shape, generator=generator) * 0.05).to(torch.bfloat16)
    state = {f"model.{k}": v.detach().as_subclass(torch.Tensor).clone() for k, v in peft.state_dict().items()}
    assert any(k.endswith(".SCB" if quant == "int8" else ".quant_state.bitsandbytes__fp4") for k in state)
    torch.save({"state_dict": state}, tmp_path / "last.ckpt")
    base.config.save_pretrained(tmp_path / "config")
    assert "quantization_config" in json.loads((tmp_path / "config" / "config.json").read_text())
    done = export_hf(tmp_path / "last.ckpt", tmp_path / "merged", merge=True, config=tmp_path / "config",
                     adapter_config=peft.peft_config["default"])
    assert done["merged"] == 4 and done["dequantized"] == 14
    exported = _safetensors(tmp_path / "merged")
    by_peft = _merged_by_peft(peft)
    assert len(by_peft) == 4 and all(torch.equal(exported[k], v) for k, v in by_peft.items())
    assert len(exported) == 21 and {v.dtype for v in exported.values()} == {torch.bfloat16}
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="auto")
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert all(torch.equal(model.state_dict()[k], v) for k, v in exported.items())


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_resumed_at_world_size_1_continues_the_run(runs: Path) -> None:
    """The step-5 checkpoint of 2 ranks resumed on 1 rank (its shards re-sliced, the 4-bit base re-read and quantized
    by the one rank) with the same global batch: the uninterrupted run's losses (the mean of the 2 ranks' losses),
    equal up to the order of bf16 sums over the batch."""
    whole = _load(runs, "llama:nf4:zero3_offload:configure:ckpt")["mean_losses"]
    resumed = _load(runs, RESUMED)["losses"]
    assert len(resumed) == 5
    assert resumed == pytest.approx(whole[5:], rel=1e-4)  # measured: 2.2e-5


def _hand_built(storage: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """bitsandbytes layers built by hand (quantized by ``.to("cpu")``) beside a trainable layer."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=storage),
        bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False),
        torch.nn.Linear(64, 32, dtype=torch.bfloat16),
    )
    model[0].to(torch.bfloat16)
    model[1].weight.data = model[1].weight.data.to(torch.bfloat16)
    return model.to("cpu")  # bitsandbytes quantizes here


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.uint8])
def test_hand_built_quantized_layers_shard_as_packed_units(storage: torch.dtype) -> None:
    """Stage 3, one process: the codes go into units of their own storage dtype, uncast; a gathered layer is the
    bitsandbytes parameter it was, with its quantization state, and computes what the unsharded model computes."""
    from lzero import ZeroConfig, ZeroEngine

    model = _hand_built(storage)
    x = torch.randn(4, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    codes = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    classes = {n: type(p) for n, p in model.named_parameters() if not p.requires_grad}  # Params4bit, Int8Params
    engine = ZeroEngine(model, [torch.optim.AdamW(model[2].parameters())], ZeroConfig(stage=3))
    try:
        assert sorted(u.spec.storage for u in engine.units) == sorted(["", "int8", str(storage).removeprefix("torch.")])
        with engine.gathered(model), torch.no_grad():
            assert {n: type(p) for n, p in model.named_parameters() if n in classes} == classes
            # byte for byte (codes viewed as bf16 may read as NaN, which torch.equal never equals)
            assert all(torch.equal(p.detach().view(torch.uint8), codes[n].view(torch.uint8))
                       for n, p in model.named_parameters() if n in codes)
            assert torch.equal(model(x), want)
    finally:
        engine.remove()


def test_a_trainable_quantized_weight_is_refused() -> None:
    from lzero import ZeroConfig, ZeroEngine, ZeroEngineError

    model = _hand_built()
    model[0].weight.requires_grad_(True)
    with pytest.raises(ZeroEngineError, match=r"(?s)`0.weight` is a bitsandbytes 4-bit weight with requires_grad=True.*HINT"):
        ZeroEngine(model, [torch.optim.AdamW(model[2].parameters())], ZeroConfig(stage=3))


@pytest.mark.parametrize("stage", [2, 3])
def test_unfreezing_a_quantized_weight_after_setup_is_refused(stage: int) -> None:
    from lzero import ZeroConfig, ZeroEngine, ZeroEngineError

    model = _hand_built()
    engine = ZeroEngine(model, [torch.optim.AdamW(model[2].parameters())], ZeroConfig(stage=stage))
    try:
        engine.before_forward()
        model[1].weight.requires_grad = False  # int8 cannot require gradients; the 4-bit bf16 view can
        with torch._C.DisableTorchFunctionSubclass():
            model[0].weight.requires_grad_(True)
        with pytest.raises(ZeroEngineError, match=r"(?s)`0.weight` was set to requires_grad=True after setup.*HINT"):
            engine.before_forward()
    finally:
        engine.remove()


def test_8bit_optimizers_are_refused_with_the_reason() -> None:
    import bitsandbytes as bnb

    from lzero.optimizer import ZeroOptimizerError, check_optimizer

    p = [torch.nn.Parameter(torch.zeros(8))]
    for cls in (bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit):
        with pytest.raises(ZeroOptimizerError, match=rf"(?s){cls.__name__}`.*blocks of 256.*HINT.*fused=True"):
            check_optimizer(cls(p), allow_untested=True)
    check_optimizer(bnb.optim.AdamW32bit(p), allow_untested=True)  # elementwise: the user's call


@pytest.mark.parametrize("stage", [2, 3])
def test_memory_counts_the_codes_at_their_packed_size_and_the_state_whole(stage: int) -> None:
    """The memory logs' accounting and the estimator: a 4-bit base holds half a byte per weight (its codes, sharded
    at stage 3, whole in the module at stage 2) and its quantization state whole; the estimator's 4bit-dq state is the
    absmax bytes, nested ones included (the code books, fixed per tensor, left out)."""
    import bitsandbytes as bnb

    from lzero import ZeroConfig, ZeroEngine
    from lzero.memory.accounting import model_state_bytes
    from lzero.memory.estimate import QUANTIZED_BYTES, ModelCount, model_states

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[bnb.nn.Linear4bit(256, 256, bias=False, quant_type="nf4",
                                                    quant_storage=torch.bfloat16).to(torch.bfloat16)
                                  for _ in range(2)], torch.nn.Linear(256, 8, bias=False, dtype=torch.bfloat16))
    model = model.to("cpu")
    engine = ZeroEngine(model, [torch.optim.SGD(model[2].parameters(), lr=0.1)], ZeroConfig(stage=stage))
    try:
        if stage == 3:
            bindings = [(b.kind, b.weights, b.tensors(), b.quant_state) for u in engine.units for b in u.bindings or ()]
        else:  # no unit holds the base: it stays whole in its modules
            bindings = [(w.kind, w.weights, w.state, p.quant_state) for p, w in engine.outside_units()]
        assert [b[:2] for b in bindings] == [("4bit-dq", 256 * 256)] * 2
        state = sum(t.numel() * t.element_size() for b in bindings for t in b[2])
        absmax = sum(b[3].absmax.numel() * b[3].absmax.element_size() for b in bindings)
        assert absmax == 2 * 256 * 256 // 64  # one byte per 64 weights under double quantization
        measured = model_state_bytes(engine)["device"]["parameters"]
        assert measured == 2 * 256 * 256 // 2 + state + 256 * 8 * 2  # codes + state + the bf16 trainable layer
        count = ModelCount(256 * 8, 2 * 256 * 256, quantized=2 * 256 * 256, quantization="4bit-dq")
        estimated = model_states(ZeroConfig(stage=stage), count, 1, "32-true")["device"]["parameters"]
        codes, per_weight = QUANTIZED_BYTES["4bit-dq"]
        assert estimated == round(codes * 2 * 256 * 256 + per_weight * 2 * 256 * 256 + 4 * 256 * 8)
        nested = sum(b[3].state2.absmax.numel() * 4 for b in bindings)  # one fp32 per 256 absmax bytes
        assert per_weight * 2 * 256 * 256 == absmax + nested
    finally:
        engine.remove()


def test_qlora_config_trains_and_exports_its_adapters(tmp_path: Path) -> None:
    """The README's lines: ``lzero fit --config configs/qlora_hf.yaml --model.path ...`` on the model
    ``lzero.demo.tiny_hf`` writes (fp32 files, quantized as read), with validation; ``ExportHF(adapters_only=True)``
    writes adapters that peft opens on the 4-bit base, and the adapters trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qlora_runs import quantization

    from lzero.demo.tiny_hf import main as tiny_hf

    repo = Path(__file__).resolve().parents[2]
    tiny_hf(str(tmp_path / "tiny"))  # what `python -m lzero.demo.tiny_hf tiny` writes
    done = subprocess.run([sys.executable, "-m", "lzero.cli", "fit", "--config", str(repo / "configs" / "qlora_hf.yaml"),
                           "--model.path", "tiny", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
                           "--trainer.enable_progress_bar", "false"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=quantization("nf4"),
                                                dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, tmp_path / "runs" / "qlora" / "adapters")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 8 and all(p.abs().sum() > 0 for p in lora_b)  # peft starts B at zero: it trained
    assert next((tmp_path / "runs" / "qlora").glob("qlora/version_*/checkpoints/last.ckpt")).is_dir()


@pytest.mark.parametrize("method,storage", [("4bit", torch.bfloat16), ("4bit", torch.uint8), ("8bit", None)])
def test_a_shard_quantized_on_its_own_is_the_whole_tensor_s_codes(method: str, storage: torch.dtype,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: quantize on read]: ranges of packed elements that cut blocks (rows), read in chunks of a few blocks,
    give the bytes and scales of bitsandbytes quantizing the whole tensor at once."""
    import bitsandbytes.functional as F

    from lzero.engine import packed_weights, quantized_read

    monkeypatch.setattr(quantized_read, "CHUNK_WEIGHTS", 3 * 64)  # several chunks per range
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    flat = weight.reshape(-1)
    if method == "4bit":
        read = quantized_read.QuantizedRead(packed_weights.FOUR_BIT, (96, 128), torch.bfloat16, 64, "nf4", storage,
                                             False)
        whole, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", quant_storage=storage,
                                       compress_statistics=False)
        whole_scales = state.absmax
    else:
        read = quantized_read.QuantizedRead(packed_weights.EIGHT_BIT, (96, 128), torch.bfloat16)
        whole, whole_scales, _ = F.int8_vectorwise_quant(weight.to(torch.float16))
    whole = whole.reshape(-1)
    read.scales = torch.zeros(read.groups)
    n = whole.numel()
    cuts = [0, 5, n // 3 + 1, n // 2, n - 7, n]  # every piece but the first and last starts and ends mid-block
    got = torch.empty_like(whole)
    for a, b in zip(cuts, cuts[1:]):
        read.read(lambda x, y, out: out.copy_(flat[x:y]), a, b, got[a:b])
    assert torch.equal(got.view(torch.uint8), whole.view(torch.uint8))
    assert torch.equal(read.scales, whole_scales.float())
