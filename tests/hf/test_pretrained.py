"""``from_pretrained`` inside a zero3 ``configure_model``: each rank reads its shards off the files.

References: transformers' own ``from_pretrained`` (the parameters, bitwise) and DDP loading the same files in
``__init__`` (losses and parameters after 10 steps). See [Note: from_pretrained under zero3] in
lzero/hf/pretrained.py and [Note: reading a pretrained checkpoint into shards] in lzero/hf/weights.py.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import run_ranks
from _launch import run_script
from _pretrained_models import save_models

pytest.importorskip("transformers")

PRESETS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_offload_nvme"]
RUNS = [f"{m}:{p}" for m in ("gpt2", "llama", "llama_tied", "t5") for p in ["ddp", *PRESETS]] + [
    "gpt2:zero3:bf16-mixed", "gpt2:zero3:bf16-mixed:eager", "llama:zero3_offload:32-true:ckpt",
    "llama:ddp:32-true:lora", "llama:zero3_offload:32-true:lora:ckpt", "llama:ddp:bf16-true", "llama:zero3:bf16-true",
    "llama:ddp:bf16-true:head:lazy", "llama:zero3:bf16-true:head"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_models(tmp_path_factory.mktemp("pretrained_models"))


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pretrained_runs")
    run_script("pretrained_runs.py", str(models["gpt2"].parent), str(out), *RUNS, timeout=600, ranks=2)
    return out


def _load(runs: Path, run: str) -> dict[str, Any]:
    return torch.load(runs / f"{run.replace(':', '-')}.pt", weights_only=True)


@pytest.mark.parametrize("run", [r for r in RUNS if r.count(":") == 1 and ":ddp" not in r])
def test_trains_like_ddp_loading_in_init(runs: Path, models: dict[str, Path], run: str) -> None:
    name, preset = run.split(":")
    ours, ddp = _load(runs, run), _load(runs, f"{name}:ddp")
    # the first loss only depends on the weights read: equal to the plain model's on the same batch
    plain = _plain(models[name], torch.float32)
    with torch.no_grad():
        first = plain(input_ids=ours["first_batch"], labels=ours["first_batch"]).loss.item()
    assert ours["losses"][0] == ddp["losses"][0] == first
    assert ours["params"].keys() == ddp["params"].keys()
    # fused AdamW everywhere: the kernel the offloaded presets step with on the host, so all are bitwise
    assert ours["losses"] == ddp["losses"]
    for key, value in ddp["params"].items():
        assert torch.equal(ours["params"][key], value), key


def test_bf16_mixed_equals_the_model_built_in_init(runs: Path) -> None:
    lazy, eager = _load(runs, "gpt2:zero3:bf16-mixed"), _load(runs, "gpt2:zero3:bf16-mixed:eager")
    assert lazy["losses"] == eager["losses"]
    for key, value in eager["params"].items():
        assert torch.equal(lazy["params"][key], value), key


@pytest.mark.parametrize("run", ["llama:zero3:bf16-true", "llama:zero3:bf16-true:head"])
def test_bf16_true_casts_the_loaded_weights_as_ddp(runs: Path, run: str) -> None:
    """bf16-true casts the fp32 model read in ``configure_model`` to bf16, as DDP casts the one it loaded: the cast
    tensors are read from the files ([Note: a cast of pretrained tensors] in lzero/hf/pretrained.py), with a fresh
    head drawn beside them (built in ``configure_model`` under DDP too: drawn in bf16 there as well)."""
    ours = _load(runs, run)
    ddp = _load(runs, run.replace("zero3", "ddp") + (":lazy" if run.endswith(":head") else ""))
    assert ours["losses"] == ddp["losses"]
    assert ours["params"].keys() == ddp["params"].keys()
    assert {v.dtype for v in ours["params"].values()} == {torch.bfloat16}
    for key, value in ddp["params"].items():
        assert torch.equal(ours["params"][key], value), key


def test_round_trip_through_export_hf(runs: Path, models: dict[str, Path], tmp_path: Path) -> None:
    """Pretrained -> 10 steps under zero3_offload -> ``lzero export-hf`` -> transformers' own ``from_pretrained``."""
    import subprocess
    import sys

    trained = _load(runs, "llama:zero3_offload:32-true:ckpt")
    ckpt = runs / "llama-zero3_offload-32-true-ckpt-ckpt" / "last.ckpt"
    out = tmp_path / "exported"
    lzero = [sys.executable, "-m", "lzero.cli"]
    done = subprocess.run([*lzero, "export-hf", str(ckpt), str(out), "--config", str(models["llama"]),
                           "--max-shard-size", "20KB"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "prefix 'model.' removed" in done.stdout
    assert len(list(out.glob("model-*.safetensors"))) >= 3 and (out / "model.safetensors.index.json").is_file()
    model, info = _plain(out, torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    for key, value in trained["params"].items():
        assert torch.equal(model.state_dict()[key], value), key
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training script: the same matmul reduction order
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=torch.arange(10).reshape(1, 10)).logits, trained["logits"])
    finally:
        torch.set_num_threads(threads)
    # a second export into the same folder is refused without --overwrite, and nothing there changes
    from lzero.checkpoint import CheckpointError
    from lzero.hf import export_hf

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match="is not empty.*--overwrite"):
        export_hf(ckpt, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    export_hf(ckpt, out, dtype="bf16", config=models["llama"], overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    model = _plain(out, "auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for key, value in trained["params"].items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16)), key


def test_lora_on_a_pretrained_base_trains_like_ddp_and_exports_its_adapters(runs: Path, models: dict[str, Path]) -> None:
    """peft's ``get_peft_model`` on the pretrained base in ``configure_model`` under zero3_offload: the base read into
    frozen shards, the adapters trained as under DDP (the same initial adapters), exported by
    ``ExportHF(adapters_only=True)`` and reopened by ``PeftModel.from_pretrained`` with the same logits; merged into
    the base (``lzero export-hf --merge``, ``ExportHF(merge=True)``) as peft's ``merge_and_unload()`` merges them."""
    from peft import PeftModel

    ours, ddp = _load(runs, "llama:zero3_offload:32-true:lora:ckpt"), _load(runs, "llama:ddp:32-true:lora")
    assert ours["losses"] == ddp["losses"]
    assert ours["params"].keys() == ddp["params"].keys()
    for key, value in ddp["params"].items():
        assert torch.equal(ours["params"][key], value), key
    plain = _plain(models["llama"], torch.float32).state_dict()
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in ours["params"].items()
            if "lora_" not in k}
    assert base.keys() == plain.keys() and all(torch.equal(base[k], plain[k]) for k in plain)  # frozen: the files
    lora = [k for k in ours["params"] if "lora_B" in k]
    assert lora and all(ours["params"][k].abs().sum() > 0 for k in lora)  # the adapters trained
    for run, trained in (("llama-zero3_offload-32-true-lora-ckpt", ours), ("llama-ddp-32-true-lora", ddp)):
        folder = runs / f"{run}-adapters"
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        model = PeftModel.from_pretrained(_plain(models["llama"], torch.float32), folder)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the training script: the same matmul reduction order
        try:
            with torch.no_grad():
                assert torch.equal(model(input_ids=torch.arange(10).reshape(1, 10)).logits, trained["logits"]), run
        finally:
            torch.set_num_threads(threads)
    # merged: `lzero export-hf --merge` of the zero3_offload checkpoint and `ExportHF(merge=True)` of both runs (a
    # sharded checkpoint, DDP's plain file) are peft's `merge_and_unload()` of DDP's adapters on the base, bitwise
    import subprocess
    import sys

    merged = runs / "llama-zero3_offload-32-true-lora-ckpt-exported-merged"
    done = subprocess.run([sys.executable, "-m", "lzero.cli", "export-hf", "--merge", "--config", str(models["llama"]),
                           "--adapter-config", str(runs / "llama-ddp-32-true-lora-adapters"),
                           str(runs / "llama-zero3_offload-32-true-lora-ckpt-ckpt" / "last.ckpt"), str(merged)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "merged the LoRA adapters of 4 weight(s)" in done.stdout
    peft = PeftModel.from_pretrained(_plain(models["llama"], torch.float32), runs / "llama-ddp-32-true-lora-adapters")
    reference = peft.merge_and_unload().state_dict()
    for folder in (merged, *(runs / f"{run}-merged" for run in ("llama-zero3_offload-32-true-lora-ckpt",
                                                                 "llama-ddp-32-true-lora"))):
        exported = _safetensors(folder)
        assert exported.keys() == reference.keys(), folder
        assert all(torch.equal(exported[k], reference[k]) for k in reference), folder
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("model")) == \
            ["config.json", "generation_config.json"]
    # opened by transformers in a process where peft cannot be imported: the trained peft model's logits, up to the
    # rounding of one fp32 matmul against two (measured: max |difference| 8.9e-8, the logits up to 0.43)
    logits = _logits_without_peft(merged)
    assert not torch.equal(logits, ours["logits"])  # a merged layer computes x @ (W + BA) in one product
    assert torch.allclose(logits, ours["logits"], rtol=0, atol=1e-6), (logits - ours["logits"]).abs().max()


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _logits_without_peft(folder: Path) -> torch.Tensor:
    """The logits on PROBE of ``AutoModelForCausalLM.from_pretrained(folder)`` in a fresh process that cannot import
    peft (one thread, as the training script)."""
    import subprocess
    import sys

    out = folder.parent / f"{folder.name}-logits.pt"
    script = ("import sys; sys.modules['peft'] = None\n"
              "import torch; torch.set_num_threads(1)\n"
              "from transformers import AutoModelForCausalLM\n"
              f"model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, dtype='auto')\n"
              "assert 'peft' not in type(model).__module__ and sys.modules['peft'] is None\n"
              "with torch.no_grad():\n"
              f"    torch.save(model(input_ids=torch.arange(10).reshape(1, 10)).logits, {str(out)!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _plain(folder: Path, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cls = AutoModelForSeq2SeqLM if folder.name.startswith("t5") else AutoModelForCausalLM
    return cls.from_pretrained(folder, dtype=dtype, **kwargs)


def _sharded(rank: int, world_size: int, folders: list[str]) -> bytes:
    """Each folder built under lzero's meta context and read into zero3 units (fp32); the full parameters gathered
    back, and the bytes this rank read against the bytes of its shards."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from lzero import ZeroConfig, ZeroEngine
    from lzero.hf import weights
    from lzero.hf.pretrained import PretrainedWeights, intercept

    read_bytes = [0]
    read_flat_into = weights.OpenFiles.read_flat_into

    def counted(self: Any, key: str, start: int, end: int, out: torch.Tensor) -> None:
        read_bytes[0] += (end - start) * self._files.tensors[key].dtype.itemsize
        read_flat_into(self, key, start, end, out)

    weights.OpenFiles.read_flat_into = counted
    results = {}
    for folder in folders:
        cls = AutoModelForSeq2SeqLM if Path(folder).name.startswith("t5") else AutoModelForCausalLM
        with torch.device("meta"), intercept():
            model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        read_bytes[0] = 0
        pretrained = PretrainedWeights(model)
        engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.0)], ZeroConfig(stage=3),
                            weights=pretrained)
        file_dtype = next(iter(pretrained.sources[0].files.tensors.values())).dtype
        shard_bytes = sum(u.spec.shard_numel for u in engine.units) * file_dtype.itemsize
        engine.unshard()
        engine.remove()
        results[folder] = {
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "read": read_bytes[0], "shard": shard_bytes, "info": info, "tied": _tied(model)}
    out = io.BytesIO()  # bytes, not tensors: a tensor put on the queue dies with this process
    torch.save(results, out)
    return out.getvalue()


def _tied(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False)
            if any(p is q for m, q in model.named_parameters() if m != n)]


def _edit_missing_and_unexpected(tensors: dict[str, torch.Tensor], file: str) -> dict[str, torch.Tensor]:
    tensors.pop("lm_head.weight", None)
    if file.startswith("model-00001"):
        tensors["extra.weight"] = torch.ones(3)
    return tensors


@pytest.fixture(scope="module")
def sharded(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case read into shards at world size 2 in one launch: name -> its folder and [rank 0's result, rank 1's]."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("pretrained_cases")
    folders = {name: models[name] for name in ("gpt2", "llama", "llama_tied", "t5")}
    # bf16 files, loaded as fp32
    AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.bfloat16).save_pretrained(
        root / "bf16", max_shard_size="20KB")
    folders["bf16"] = root / "bf16"
    # lm_head.weight missing, an unknown key added
    shutil.copytree(models["llama"], root / "missing")
    _rewrite(root / "missing", _edit_missing_and_unexpected)
    folders["missing"] = root / "missing"
    # one pytorch_model.bin (transformers 5 writes safetensors only: the older layout by hand)
    (root / "bin").mkdir()
    (root / "bin" / "config.json").write_text((models["gpt2"] / "config.json").read_text())
    torch.save(AutoModelForCausalLM.from_pretrained(models["gpt2"]).state_dict(), root / "bin" / "pytorch_model.bin")
    folders["bin"] = root / "bin"
    ranks = [torch.load(io.BytesIO(r), weights_only=False)
             for r in run_ranks(_sharded, 2, [str(f) for f in folders.values()], timeout=300)]
    return {name: {"folder": folder, "ranks": [r[str(folder)] for r in ranks]} for name, folder in folders.items()}


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_tied", "t5"])
def test_each_rank_reads_its_shard_and_gets_the_plain_weights(sharded: dict, models: dict[str, Path],
                                                              name: str) -> None:
    plain = _plain(models[name], torch.float32)
    expected = plain.state_dict()
    for rank, got in enumerate(sharded[name]["ranks"]):
        assert got["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(got["state"][key], value), (rank, key)
        for key, value in plain.named_buffers():  # computed ones (rotary inv_freq) too, never meta
            assert torch.equal(got["buffers"][key], value), (rank, key)
        assert got["info"]["missing_keys"] == set() and got["info"]["unexpected_keys"] == set()
        assert got["tied"] == _tied(plain)  # one copy, as the model ties them
        total = sum(v.numel() * v.element_size() for v in expected.values())
        print(f"{name} rank {rank}: read {got['read']} B, shard {got['shard']} B, model {total} B")
        assert got["read"] <= got["shard"]  # exactly the pieces: the shard without its padding


def test_bf16_files_into_fp32_parameters(sharded: dict) -> None:
    expected = _plain(sharded["bf16"]["folder"], torch.float32).state_dict()
    for got in sharded["bf16"]["ranks"]:
        assert {v.dtype for v in got["state"].values()} == {torch.float32}
        for key, value in expected.items():
            assert torch.equal(got["state"][key], value), key


def _rewrite(folder: Path, edit: Any) -> None:
    """Every safetensors file of ``folder`` rewritten with ``edit(dict of tensors, file name) -> dict``; the index
    follows."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(folder / file), file)
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))


def test_missing_and_unexpected_keys_reported_and_initialized(sharded: dict) -> None:
    plain, info = _plain(sharded["missing"]["folder"], torch.float32, output_loading_info=True)
    for got in sharded["missing"]["ranks"]:
        assert got["info"]["missing_keys"] == info["missing_keys"] == {"lm_head.weight"}
        assert got["info"]["unexpected_keys"] == info["unexpected_keys"] == {"extra.weight"}
        head = got["state"]["lm_head.weight"]  # initialized as transformers' _init_weights does
        assert abs(head.std().item() / plain.config.initializer_range - 1) < 0.1
        for key, value in plain.state_dict().items():
            if key != "lm_head.weight":
                assert torch.equal(got["state"][key], value), key
    ranks = sharded["missing"]["ranks"]
    assert torch.equal(ranks[0]["state"]["lm_head.weight"], ranks[1]["state"]["lm_head.weight"])


def test_bin_files_read_with_weights_only(sharded: dict, models: dict[str, Path]) -> None:
    for got in sharded["bin"]["ranks"]:
        for key, value in _plain(models["gpt2"], torch.float32).state_dict().items():
            assert torch.equal(got["state"][key], value), key


# ------------------------------------------------------------------------------------------------ bad input


def _from_pretrained_in_meta(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from lzero.hf.pretrained import intercept

    with torch.device("meta"), intercept():
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def _refused(folder: Path, *fragments: str, **kwargs: Any) -> str:
    from lzero.hf.weights import PretrainedLoadError

    with pytest.raises(PretrainedLoadError) as err:
        _from_pretrained_in_meta(folder, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert "HINT" in str(err.value)
    return str(err.value)


@pytest.fixture
def gpt2(tmp_path: Path) -> Path:
    return save_models(tmp_path, ["gpt2"])["gpt2"]


def test_a_folder_without_weights(gpt2: Path) -> None:
    for file in gpt2.glob("model*"):
        file.unlink()
    _refused(gpt2, "No model weights in", str(gpt2), "config.json")


def test_a_shape_mismatch_names_the_key_and_both_shapes(gpt2: Path) -> None:
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "n_positions": 40}))
    _refused(gpt2, "`transformer.wpe.weight`", "[32, 32]", "[40, 32]", "ignore_mismatched_sizes=True")
    model = _from_pretrained_in_meta(gpt2, ignore_mismatched_sizes=True)  # then initialized, as transformers does
    from lzero.hf.pretrained import source_of

    assert source_of(model).mismatched == ["transformer.wpe.weight"]


def test_a_truncated_safetensors_file(gpt2: Path) -> None:
    shard = sorted(gpt2.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _refused(gpt2, "truncated", shard.name, "fetch the file again")


def test_a_pickle_bin_that_needs_more_than_tensors(gpt2: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickle"
    folder.mkdir()
    (folder / "config.json").write_text((gpt2 / "config.json").read_text())
    torch.save({"transformer.wte.weight": torch.zeros(128, 32), "recipe": Path("x")}, folder / "pytorch_model.bin")
    _refused(folder, "weights_only=True", "never unpickles", "save_pretrained")


def test_a_base_quantized_in_its_files_is_refused_by_name(gpt2: Path) -> None:
    """lzero quantizes bitsandbytes bases as it reads unquantized files (tests/hf/test_qlora.py); files holding codes
    already, or another method's (GPTQ, AWQ), are refused naming the method and the fix."""
    config = json.loads((gpt2 / "config.json").read_text())
    for quant, fragments in (({"quant_method": "bitsandbytes", "load_in_4bit": True}, ("already quantized",)),
                             ({"quant_method": "gptq", "bits": 4}, ("quantized with gptq", "BitsAndBytesConfig")),
                             ({"quant_method": "awq", "bits": 4}, ("quantized with awq", "BitsAndBytesConfig"))):
        (gpt2 / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        _refused(gpt2, *fragments)


def test_loader_options_lzero_cannot_honour_are_refused(gpt2: Path) -> None:
    _refused(gpt2, "device_map", "lzero places every shard itself", device_map="auto")
    _refused(gpt2, "weights_only=False", weights_only=False)


def test_finetune_config_trains_and_exports_at_the_end_of_fit(tmp_path: Path) -> None:
    """The README's lines: a model written by ``lzero.demo.tiny_hf``, ``lzero fit --config configs/finetune_hf.yaml
    --model.path ...``; ``ExportHF`` writes the folder, equal to exporting the run's last checkpoint."""
    import subprocess
    import sys

    from lzero.hf import export_hf

    repo = Path(__file__).resolve().parents[2]
    run = lambda *cmd: subprocess.run([sys.executable, *cmd], cwd=tmp_path, capture_output=True, text=True)  # noqa
    assert run("-m", "lzero.demo.tiny_hf", "tiny").returncode == 0
    done = run("-m", "lzero.cli", "fit", "--config", str(repo / "configs" / "finetune_hf.yaml"), "--model.path", "tiny",
               "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false")
    assert done.returncode == 0, done.stderr[-3000:]
    exported = tmp_path / "runs" / "finetune" / "hf"
    last = next((tmp_path / "runs" / "finetune").glob("finetune/version_*/checkpoints/last.ckpt"))
    export_hf(last, tmp_path / "again", config=tmp_path / "tiny")
    model, info = _plain(exported, torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    again = _plain(tmp_path / "again", torch.float32).state_dict()
    start = _plain(tmp_path / "tiny", torch.float32).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, again[key]), key
    assert any(not torch.equal(value, start[key]) for key, value in again.items())  # it trained
