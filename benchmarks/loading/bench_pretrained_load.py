"""Loading a pretrained Hugging Face model at world size 2: memory, bytes read and time per rank.

    python -m benchmarks.loading.bench_pretrained_load [--layers 24 --width 1024] [--out PATH]
        [--deepspeed-python /path/to/deepspeed-venv/bin/python]
    # default: results/loading/pretrained_load.<machine>.<date>.md

A GPT-2 of about 355M parameters (24 x 1024, vocabulary 50257; fp32, 1.42 GB) is written once with
``save_pretrained`` in 500 MB files. Each way of loading runs on 2 gloo ranks (one process each, one thread):

- ``lzero zero3``: ``from_pretrained`` inside lzero's meta context, then the zero3 engine reads each rank's
  shards ([Note: reading a pretrained checkpoint into shards] in lzero/hf/weights.py);
- ``lzero zero3 + LoRA``: the same, as in ``configure_model`` (``lzero.lightning.wiring.meta_device``: the construction
  recorded), with peft's LoRA adapters (r 8 on ``c_attn``, drawn after ``torch.manual_seed(1)``) added before the
  engine reads the shards and replays the adapters' draws;
- ``plain from_pretrained``: transformers' own, every rank holding the whole model (what a model built in
  ``__init__`` costs, and what zero1/zero2 do);
- ``safetensors load_file``: the library reading every file whole, one process (the throughput reference);
- with ``--deepspeed-python``: DeepSpeed's ``zero.Init`` + ``from_pretrained`` in that environment
  (benchmarks.peers.peer_deepspeed_load; DeepSpeed is never a dependency of lzero).

Per rank: peak resident-memory growth during the load (``VmHWM`` reset through ``/proc/self/clear_refs``), bytes
read from the disk (``/proc/self/io`` ``read_bytes``, page cache dropped first where allowed; else the bytes the
reader asked for), and wall time. The page cache is dropped before each way where the machine allows it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import (count_checkpoint_reads, module_command, module_env, out_path, proc_bytes, proc_io,
                               reset_peak, run_header, write_report)


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return True
    except OSError:
        return False


def make_model(folder: Path, layers: int, width: int) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel

    if (folder / "model.safetensors.index.json").exists():
        return sum(1 for _ in folder.glob("model*.safetensors"))
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=50257, n_positions=1024)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.tie_weights()
    model.save_pretrained(folder, max_shard_size="500MB")
    return sum(1 for _ in folder.glob("model*.safetensors"))


def _rank(rank: int, world: int, port: int, way: str, folder: str, queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import GPT2LMHeadModel

    import lzero  # noqa: F401
    from lzero import ZeroConfig, ZeroEngine
    from lzero.hf.pretrained import PretrainedWeights, intercept

    asked = count_checkpoint_reads()
    dist.barrier()
    reset_peak()
    rss0, disk0 = proc_bytes("VmRSS"), proc_io("read_bytes")
    start = time.perf_counter()
    if way == "lzero zero3":
        with torch.device("meta"), intercept():
            model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
        engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.0)], ZeroConfig(stage=3),
                            weights=PretrainedWeights(model))
        held = sum(u.spec.shard_numel for u in engine.units) * 4
        largest = max(math.prod(s.shape) for u in engine.units for s in u.spec.params) * 4
    elif way == "lzero zero3 + LoRA":  # as in configure_model: lzero's meta context, adapters drawn by peft
        from peft import LoraConfig, get_peft_model

        from lzero.lightning.wiring import meta_device, pretrained_weights

        with meta_device():
            model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
            torch.manual_seed(1)
            model = get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn"], init_lora_weights="gaussian"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine = ZeroEngine(model, [torch.optim.SGD(trainable, lr=0.0)], ZeroConfig(stage=3),
                            weights=pretrained_weights(model))
        held = sum(u.spec.shard_numel for u in engine.units) * 4
        largest = max(math.prod(s.shape) for u in engine.units for s in u.spec.params) * 4
    else:
        model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
        held = sum(p.numel() for p in model.parameters()) * 4
        largest = max(p.numel() for p in model.parameters()) * 4
        asked[0] = held
    seconds = time.perf_counter() - start
    at_load = proc_bytes("VmHWM") - rss0
    if not way.startswith("lzero"):  # transformers' parameters map the files: they become this rank's memory when written
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
    dist.barrier()
    result = {"way": way, "rank": rank, "seconds": seconds, "peak_growth": at_load,
              "owned_growth": proc_bytes("VmHWM") - rss0,
              "disk_read": proc_io("read_bytes") - disk0, "asked": asked[0], "held": held, "largest": largest}
    queue.put(result)
    dist.destroy_process_group()


def run_way(way: str, folder: Path) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, way, str(folder), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return results


def load_file_reference(folder: Path, owned: bool) -> dict:
    """safetensors' ``load_file`` of every file, in this process; ``owned``: each tensor then copied into this
    process's own memory (what a trainable parameter needs)."""
    from safetensors.torch import load_file

    reset_peak()
    rss0, disk0 = proc_bytes("VmRSS"), proc_io("read_bytes")
    start = time.perf_counter()
    total, kept = 0, []
    for file in sorted(folder.glob("model*.safetensors")):
        tensors = load_file(file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        if owned:
            kept.extend(t.clone() for t in tensors.values())
        del tensors
    seconds = time.perf_counter() - start
    growth = proc_bytes("VmHWM") - rss0
    del kept
    return {"way": "safetensors load_file" + (" + copy to owned memory" if owned else " (mapped)"), "rank": "-",
            "seconds": seconds, "peak_growth": growth, "owned_growth": growth,
            "disk_read": proc_io("read_bytes") - disk0,
            "asked": total, "held": total if owned else 0, "largest": 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--folder", default="/tmp/lzero-bench-gpt2-355m")
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/loading/pretrained_load.<machine>.<date>.md)")
    parser.add_argument("--deepspeed-python", help="a Python with DeepSpeed (and torch, transformers) installed")
    args = parser.parse_args()
    out = out_path(args.out, "loading", "pretrained_load")
    folder = Path(args.folder)
    files = make_model(folder, args.layers, args.width)
    size = sum(f.stat().st_size for f in folder.glob("model*.safetensors"))
    rows = []
    dropped = drop_caches()
    rows.append(load_file_reference(folder, owned=False))
    drop_caches()
    rows.append(load_file_reference(folder, owned=True))
    for way in ("lzero zero3", "lzero zero3 + LoRA", "plain from_pretrained"):
        drop_caches()
        rows.extend(run_way(way, folder))
    if args.deepspeed_python:
        drop_caches()
        peer = subprocess.run(module_command("benchmarks.peers.peer_deepspeed_load", folder,
                                             python=args.deepspeed_python),
                              capture_output=True, text=True, env=module_env(DS_ACCELERATOR="cpu"), check=True)
        rows.extend(json.loads(line) for line in peer.stdout.splitlines() if line.startswith("{"))
    text = report(rows, args.layers, args.width, files, size, dropped, bool(args.deepspeed_python))
    print(text, end="")
    if out is not None:
        write_report(out, text)


README = "[benchmarks/loading/README.md](../../loading/README.md)"  # how each figure is measured, from results/loading
mb = lambda b: "-" if b is None else f"{b / 1e6:,.0f}"  # noqa: E731


def _table_lines(rows: list[dict], size: int) -> list[str]:
    lines = ["| way | rank | time s | peak RSS growth at load MB | once owned MB | disk read MB | bytes read MB |"
             " parameters held MB | largest tensor MB | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['rank']} | {r['seconds']:.2f} | {mb(r['peak_growth'])} |"
                     f" {mb(r['owned_growth'])} | {mb(r['disk_read'])} |"
                     f" {mb(r['asked'])} | {mb(r['held'])} | {mb(r['largest'])} | {_rate(r, size) / 1e9:.2f} |")
    return lines


def _rate(row: dict, size: int) -> float:
    """Bytes per second: what the way read, or the whole model where the reader did not count."""
    return (row["asked"] if row["asked"] is not None else size) / row["seconds"]


def _figure_lines(rows: list[dict], size: int, deepspeed: bool) -> list[str]:
    z3 = [r for r in rows if r["way"] == "lzero zero3"]
    lora = [r for r in rows if r["way"] == "lzero zero3 + LoRA"]
    mapped, owned = _rate(rows[0], size), _rate(rows[1], size)
    lz_rate = sum(r["asked"] for r in z3) / max(r["seconds"] for r in z3)
    files = sum(r["asked"] for r in z3)  # both ranks together read the files once
    ratios = lambda rs, base: ", ".join(f"{r['asked'] / base(r):.3f}" for r in rs)  # noqa: E731
    return ["- lzero zero3, peak RSS growth / (shard + largest tensor), per rank: "
            + ", ".join(f"{r['peak_growth'] / (r['held'] + r['largest']):.2f}" for r in z3) + " (target <= 1.10)",
            f"- lzero zero3, bytes read / shard (padding included), per rank: {ratios(z3, lambda r: r['held'])}"
            " (target <= 1.10)",
            "- lzero zero3 + LoRA, bytes read / the rank's share of the files, per rank:"
            f" {ratios(lora, lambda r: files / len(lora))} (target <= 1.10)",
            f"- throughput, lzero zero3, both ranks: {lz_rate / 1e9:.2f} GB/s",
            f"- throughput, load_file into owned memory: {owned / 1e9:.2f} GB/s (lzero {lz_rate / owned:.2f}x)",
            f"- throughput, load_file mapped: {mapped / 1e9:.2f} GB/s (lzero {lz_rate / mapped:.2f}x)",
            f"- DeepSpeed zero.Init + from_pretrained: {'run' if deepspeed else 'not run (no --deepspeed-python)'}"]


def report(rows: list[dict], layers: int, width: int, files: int, size: int, dropped: bool, deepspeed: bool) -> str:
    """The markdown report: the run, the setup, the table, the figures."""
    lines = ["# Loading a pretrained model at world size 2 (benchmarks.loading.bench_pretrained_load)", "",
             run_header("transformers", "safetensors", "peft"), "", "## Setup", "",
             f"- model: GPT-2, {layers} x {width}, vocabulary 50257, fp32",
             f"- parameters: {size / 4e6:,.0f}M in {files} safetensors files, {size / 1e6:,.0f} MB",
             "- ranks: 2 gloo, one thread each",
             f"- page cache: {'dropped before each way' if dropped else 'warm (dropping it is not allowed here)'}",
             "", "## Results", "", f"How each figure is measured: {README}.", "",
             *_table_lines(rows, size), "", "## Figures", "", *_figure_lines(rows, size, deepspeed)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
