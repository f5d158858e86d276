"""Loading a QLoRA base (4-bit NF4) at world size 2 under lzero zero3: memory, bytes read and bytes held per rank.

    python -m benchmarks.loading.bench_qlora_load [--layers 24] [--folder /tmp/lzero-bench-llama-349m] [--out PATH]
    # default: results/loading/qlora_load.<machine>.<date>.md

A Llama of about 349M parameters (24 x 1024, MLP 2816, 16 heads / 8 KV heads, vocabulary 32000, lm_head untied),
random weights from a fixed seed, is written once in bf16 with ``save_pretrained`` in 200 MB files (kept in
``--folder``, so a rerun skips it). Each way of loading it with ``BitsAndBytesConfig(load_in_4bit=True, nf4,
double quantization, bf16 compute and quant storage)``:

- ``lzero zero3``: ``Trainer(strategy="zero3", devices=2)`` on 2 gloo ranks, ``configure_model`` calling
  ``from_pretrained(..., quantization_config=...)`` and peft's ``get_peft_model`` (LoRA r=8 on q_proj, v_proj);
  each rank reads and quantizes its own shard ([Note: quantize on read] in lzero/hf/quantize_on_read.py); one step runs;
- ``transformers 4-bit``: transformers' own quantized load of the whole model in one process: what each DDP rank
  of a QLoRA run holds (DDP QLoRA and transformers' quantized load are the same measurement);
- ``transformers bf16``: the unquantized load, for scale.

Per process (one thread each): peak resident-memory growth during the load (``VmHWM`` reset through
``/proc/self/clear_refs`` just before, minus ``VmRSS`` then; for lzero from the end of ``configure_model`` to
``on_fit_start``, i.e. the strategy's setup that builds the engine), the bytes lzero's reader asked for
(``OpenFiles.read_flat_into`` counted) beside ``/proc/self/io`` ``rchar``, and the bytes held by the frozen base
(the engine's units: packed shards, replicated quantization state, bf16 shards). Every way runs twice: with glibc's
default allocator, and with ``MALLOC_MMAP_THRESHOLD_=65536`` (RSS then follows the live tensors, not the freed
memory the heap keeps). The lzero ranks run in a child process (``--rank-run``), where Lightning launches rank 1 by
re-running this module with the same arguments.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (FIXED, THRESHOLD, WORLD_SIZE, count_checkpoint_reads, module_command, module_env,
                               out_path, proc_bytes, proc_io, reset_peak, run_header, run_spawned, write_report)

SEED = 1234


def quantization_config() -> object:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)


def checkpoint_tensors(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor of the checkpoint: its dtype and shape, from the file headers (lzero's reader; nothing read)."""
    from lzero.hf.weights import find_files

    return {k: (t.dtype, t.shape) for k, t in find_files(folder).tensors.items()}


def make_model(folder: Path, layers: int) -> None:
    """The bf16 Llama written with ``save_pretrained`` in 200 MB files, once."""
    if (folder / "model.safetensors.index.json").exists():
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")


# --- lzero zero3: the ranks Lightning launches ------------------------------------------------------------------

def held_by_engine(engine: object) -> dict[str, int]:
    """Bytes of this rank's shards by kind: packed codes, their replicated quantization state, the other frozen
    shards (bf16), the trainable ones (LoRA)."""
    held = {"packed": 0, "state": 0, "frozen": 0, "trainable": 0}
    for unit in engine.units:
        shard = unit.spec.shard_numel * unit.flat_param.element_size()
        if unit.spec.storage:
            held["packed"] += shard
            held["state"] += sum(b.nbytes for b in unit.bindings or ())
        else:
            held["frozen" if unit.spec.frozen else "trainable"] += shard
    return held


def run_rank(folder: str, results: Path) -> None:
    """This rank's part of ``Trainer(strategy="zero3").fit``: one JSON line of measures in ``results``."""
    import lightning as L
    from lightning.pytorch import Callback
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import lzero  # noqa: F401  registers zero3
    from lzero.hf.pretrained import source_of

    torch.set_num_threads(1)
    way = "lzero zero3" + (f" ({THRESHOLD}={os.environ[THRESHOLD]})" if THRESHOLD in os.environ else "")
    hf_logging.disable_progress_bar()
    asked = count_checkpoint_reads()
    before: dict[str, float] = {}

    class QLoRA(L.LightningModule):
        def configure_model(self) -> None:
            model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization_config(),
                                                         dtype=torch.bfloat16)
            self.model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
            before.update(configure_peak=proc_bytes("VmHWM"))
            reset_peak()  # the engine's setup starts next (strategy.setup)
            before.update(rss=proc_bytes("VmRSS"), rchar=proc_io("rchar"), disk=proc_io("read_bytes"), asked=asked[0],
                          start=time.perf_counter())

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Measure(Callback):
        def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
            reset_peak()  # configure_model (the model laid out on the meta device) runs next
            before.update(setup_rss=proc_bytes("VmRSS"))

        def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seconds = time.perf_counter() - before["start"]
            hwm = proc_bytes("VmHWM")
            engine = trainer.strategy.engine
            source = source_of(module.model.get_base_model())
            module.result = {
                "way": way, "rank": trainer.global_rank, "seconds": seconds, "peak_growth": hwm - before["rss"],
                "owned_growth": hwm - before["rss"], "end_growth": proc_bytes("VmRSS") - before["rss"],
                "from_setup": max(hwm, before["configure_peak"]) - before["setup_rss"],
                "asked": asked[0] - before["asked"], "rchar": proc_io("rchar") - before["rchar"],
                "disk": proc_io("read_bytes") - before["disk"], **held_by_engine(engine),
                "largest_unit": max(u.spec.shard_numel * u.flat_param.element_size() for u in engine.units),
                "kept_scales": sum(r.scales.numel() * r.scales.element_size() for r in source.quantized.values()
                                   if r.scales is not None)}

    module = QLoRA()
    module.losses = []
    data = DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 32000, (4, 32),
                                                                   generator=torch.Generator().manual_seed(SEED))))
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="zero3", precision="bf16-true", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Measure()])
    trainer.fit(module, data)
    (results / f"rank{trainer.global_rank}.json").write_text(json.dumps({**module.result, "loss": module.losses}))


def run_lzero(folder: Path, results: Path, env: dict[str, str]) -> list[dict]:
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    done = subprocess.run(module_command(__spec__.name, "--folder", folder, "--rank-run", results),
                          capture_output=True, text=True, timeout=600, env=module_env(**env))
    if done.returncode != 0:
        sys.exit(f"lzero zero3 ranks failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


# --- transformers: one process holding the whole model -----------------------------------------------------------

def _reference(way: str, folder: str, queue: object) -> None:
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    reset_peak()
    rss0, rchar0, disk0 = proc_bytes("VmRSS"), proc_io("rchar"), proc_io("read_bytes")
    start = time.perf_counter()
    quantization = {"quantization_config": quantization_config()} if way == "transformers 4-bit" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **quantization)
    seconds = time.perf_counter() - start
    at_load = proc_bytes("VmHWM") - rss0
    held = {"packed": 0, "state": 0, "frozen": 0, "trainable": 0, "quantized_params": 0}
    for p in model.parameters():
        if isinstance(p, bnb.nn.Params4bit):
            held["packed"] += p.numel() * p.element_size()
            held["state"] += _state_nbytes(p.quant_state)
            held["quantized_params"] += math.prod(p.quant_state.shape)
        else:
            held["frozen"] += p.numel() * p.element_size()
    with torch.no_grad():  # unquantized parameters map the files: they become this process's memory once written
        for p in model.parameters():
            if not isinstance(p, bnb.nn.Params4bit):
                p.data = p.data.clone()
    queue.put({"way": way, "rank": "-", "seconds": seconds, "peak_growth": at_load,
               "owned_growth": proc_bytes("VmHWM") - rss0, "end_growth": proc_bytes("VmRSS") - rss0,
               "asked": sum(math.prod(s) * d.itemsize for d, s in checkpoint_tensors(Path(folder)).values()),
               "rchar": proc_io("rchar") - rchar0, "disk": proc_io("read_bytes") - disk0, **held})


def _state_nbytes(state: object) -> int:
    """Bytes of a bitsandbytes QuantState's tensors (absmax, code book, offset, and the nested state's)."""
    total = sum(v.numel() * v.element_size() for v in (state.absmax, state.code, state.offset)
                if isinstance(v, torch.Tensor))
    return total + (_state_nbytes(state.state2) if getattr(state, "state2", None) is not None else 0)


def run_reference(way: str, folder: Path, env: dict[str, str]) -> dict:
    result = run_spawned(_reference, (way, str(folder)), env)
    if env:
        result["way"] += "".join(f" ({k}={v})" for k, v in env.items())
    return result


# --- the table ---------------------------------------------------------------------------------------------------

README = "[benchmarks/loading/README.md](../../loading/README.md)"  # how each figure is measured, from results/loading
mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f}"  # noqa: E731


def model_bytes(rows: list[dict], folder: Path) -> dict[str, float]:
    """The checkpoint's sizes and the per-rank bases of the targets: ``share`` (file bytes / N), ``packed_share``
    (the whole quantized model / N) and ``rss_base`` (packed_share + the largest tensor)."""
    tensors = checkpoint_tensors(folder)
    files = sorted(folder.glob("model*.safetensors"))
    params = sum(math.prod(s) for _, s in tensors.values())
    q4 = next(r for r in rows if r["way"] == "transformers 4-bit")
    quantized, state = q4["quantized_params"], q4["state"]
    packed = quantized // 2 + 2 * (params - quantized) + state
    largest = max(math.prod(s) * d.itemsize for d, s in tensors.values())
    file_bytes = sum(f.stat().st_size for f in files)
    return {"params": params, "files": len(files), "file_bytes": file_bytes, "quantized": quantized, "state": state,
            "packed": packed, "largest": largest, "share": file_bytes / WORLD_SIZE,
            "packed_share": packed / WORLD_SIZE, "rss_base": packed / WORLD_SIZE + largest}


def _setup_lines(size: dict[str, float], layers: int) -> list[str]:
    return [f"- model: Llama {layers} x 1024, MLP 2816, 16 heads / 8 KV heads, vocabulary 32000, lm_head untied,"
            f" random weights (seed {SEED}), bf16",
            f"- parameters: {size['params'] / 1e6:,.1f}M in {size['files']} safetensors files,"
            f" {mb(size['file_bytes'])} MB",
            "- 4-bit: NF4, double quantization, bf16 compute and quant storage",
            f"- lzero: zero3, {WORLD_SIZE} gloo ranks, one thread each, precision bf16-true, LoRA r=8 on q_proj and"
            " v_proj, AdamW, one step",
            f"- allocator: glibc default; {THRESHOLD}={FIXED}", "- page cache: warm",
            f"- packed model: {size['quantized'] / 1e6:,.1f}M quantized weights x 0.5 B"
            f" + {(size['params'] - size['quantized']) / 1e6:,.1f}M other x 2 B + {mb(size['state'])} MB quant state"
            f" = {mb(size['packed'])} MB; / N = {mb(size['packed_share'])} MB",
            f"- largest unquantized tensor (embed_tokens, lm_head): {mb(size['largest'])} MB",
            f"- target, bytes read per lzero rank: <= 1.1 x files/N {mb(size['share'])} = {mb(1.1 * size['share'])} MB",
            f"- target, frozen base held: <= 1.1 x packed/N {mb(size['packed_share'])}"
            f" = {mb(1.1 * size['packed_share'])} MB",
            f"- target, peak RSS growth: <= 1.1 x ({mb(size['packed_share'])} + {mb(size['largest'])})"
            f" = {mb(1.1 * size['rss_base'])} MB"]


def _check(value: float, base: float, row: dict) -> str:
    """value / base, and against the target 1.1 for lzero's ranks only."""
    ratio = f"{value / base:.2f}"
    if not row["way"].startswith("lzero"):
        return ratio
    return f"{ratio} {'pass' if value <= 1.1 * base else '**FAIL**'}"


def _table_lines(rows: list[dict], size: dict[str, float]) -> list[str]:
    lines = ["| way | rank | time s | peak RSS growth MB | RSS growth after MB | peak incl. configure_model MB |"
             " bytes read MB | rchar MB | packed codes MB | quant state MB | bf16 frozen MB | frozen base held MB |"
             " LoRA MB | read / (files/N) | held / (packed/N) | peak RSS / (packed/N + largest) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = r["packed"] + r["state"] + r["frozen"]
        lines.append(
            f"| {r['way']} | {r['rank']} | {r['seconds']:.1f} | {mb(r['owned_growth'])} | {mb(r['end_growth'])} |"
            f" {mb(r.get('from_setup'))} | {mb(r['asked'])} | {mb(r['rchar'])} | {mb(r['packed'])} |"
            f" {mb(r['state'])} | {mb(r['frozen'])} | {mb(base)} | {mb(r['trainable'])} |"
            f" {_check(r['asked'], size['share'], r)} | {_check(base, size['packed_share'], r)} |"
            f" {_check(r['owned_growth'], size['rss_base'], r)} |")
    return lines


def _figure_lines(rows: list[dict], size: dict[str, float]) -> list[str]:
    """The targets met or not and the figures behind them, ranks 0/1."""
    lz = [r for r in rows if r["way"].startswith("lzero")]
    default, fixed = [r for r in lz if THRESHOLD not in r["way"]], [r for r in lz if THRESHOLD in r["way"]]
    each = lambda rs, key: "/".join(mb(r[key]) for r in rs)  # noqa: E731
    base = [r["packed"] + r["state"] + r["frozen"] for r in lz]
    met = lambda ok: "yes" if ok else "**no**"  # noqa: E731
    return [f"- bytes read target met: {met(all(r['asked'] <= 1.1 * size['share'] for r in lz))}",
            f"- frozen base held target met: {met(all(b <= 1.1 * size['packed_share'] for b in base))};"
            f" {max(base) / size['packed_share'] - 1:+.1%} against packed/N",
            f"- peak RSS growth target met: {met(all(r['owned_growth'] <= 1.1 * size['rss_base'] for r in lz))}",
            f"- peak RSS growth: {each(default, 'owned_growth')} MB; {THRESHOLD}={FIXED}"
            f" {each(fixed, 'owned_growth')} MB",
            f"- RSS growth after: {each(default, 'end_growth')} MB; {THRESHOLD}={FIXED} {each(fixed, 'end_growth')} MB",
            "- held per rank, LoRA included: "
            f"{mb(max(r['packed'] + r['state'] + r['frozen'] + r['trainable'] for r in lz))} MB",
            f"- largest unit shard per rank: {mb(max(r['largest_unit'] for r in lz))} MB",
            f"- fp32 absmax still held after the load: {mb(max(r['kept_scales'] for r in lz))} MB",
            "- loss, ranks 0/1: " + "/".join(format(r["loss"][0], ".4f") for r in default)]


def write_table(rows: list[dict], folder: Path, layers: int, out: Path | None) -> str:
    size = model_bytes(rows, folder)
    lines = ["# Loading a QLoRA base at world size 2 (benchmarks.loading.bench_qlora_load)", "",
             run_header("transformers", "bitsandbytes", "peft", "accelerate"), "",
             "- command: `python -m benchmarks.loading.bench_qlora_load`", "", "## Setup", "",
             *_setup_lines(size, layers), "", "## Results", "", f"How each figure is measured: {README}.", "",
             *_table_lines(rows, size), "", "## Figures", "", *_figure_lines(rows, size)]
    text = "\n".join(lines) + "\n"
    if out is not None:
        write_report(out, text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--folder", default="/tmp/lzero-bench-llama-349m")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/loading/qlora_load.<machine>.<date>.md)")
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)  # internal: the lzero ranks write their JSON here
    args = parser.parse_args()
    folder = Path(args.folder)
    if args.rank_run:
        run_rank(str(folder), Path(args.rank_run))
        return
    make_model(folder, args.layers)
    params = sum(math.prod(s) for _, s in checkpoint_tensors(folder).values())
    print(f"model: {params:,} parameters in {folder}", flush=True)
    rows = []
    for env in ({}, {THRESHOLD: FIXED}):
        rows += run_lzero(folder, folder.with_name(folder.name + "-results"), env)
        rows.append(run_reference("transformers 4-bit", folder, env))
    rows.append(run_reference("transformers bf16", folder, {}))
    print(write_table(rows, folder, args.layers, out_path(args.out, "loading", "qlora_load")))


if __name__ == "__main__":
    main()
