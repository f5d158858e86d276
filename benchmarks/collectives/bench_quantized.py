"""The quantized collectives (qwZ, qgZ) against DDP: the demo GPT on the bundled corpus at world size 4, each layout
trained by its own Fabric in one launch, on CPU (gloo).

    torchrun --nproc_per_node 4 -m benchmarks.collectives.bench_quantized OUT.pt [--steps 200] [--lr 1e-3] [--micro 8]

Rank 0 writes OUT.pt: per run the losses (averaged over ranks) and the bytes handed to reduce-scatters and received
from all-gathers per step (lzero's runs), and the table as markdown to ``--out`` (default
``results/collectives/quantized.<machine>.<date>.md``). tests/engine/test_quantized.py runs this file by its path with
``--out none``, so nothing but lzero is imported then.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F

from lzero.demo.data import VOCAB_SIZE, RandomWindows, load_corpus
from lzero.demo.model import GPT, GPTConfig
from lzero import ZeroFabricStrategy
from lzero.engine import collectives

BLOCK = 32
RUNS = {
    "ddp": "ddp",
    "zero3": lambda: ZeroFabricStrategy(stage=3),
    "zero3_qwz_qgz8": lambda: ZeroFabricStrategy(stage=3, quantized_weights=True, quantized_gradients=8),
    "zero3_qwz_qgz4": lambda: ZeroFabricStrategy(stage=3, quantized_weights=True, quantized_gradients=4),
    "zero3_hybrid_qwz_qgz8": lambda: ZeroFabricStrategy(stage=3, shard_group_size=2, quantized_weights=True,
                                                        quantized_gradients=8),
    "zero3_hybrid_qwz_qgz4": lambda: ZeroFabricStrategy(stage=3, shard_group_size=2, quantized_weights=True,
                                                        quantized_gradients=4),
    "qwz": lambda: ZeroFabricStrategy(stage=3, quantized_weights=True),
    "qgz8": lambda: ZeroFabricStrategy(stage=3, quantized_gradients=8),
    "qgz4": lambda: ZeroFabricStrategy(stage=3, quantized_gradients=4),
}


def train(name: str, windows: RandomWindows, steps: int, micro: int, lr: float) -> dict:
    strategy = RUNS[name]
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", 4)), strategy=strategy if isinstance(strategy, str) else strategy())
    fabric.launch()
    fabric.seed_everything(0)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=lr))
    losses, before = [], dict(collectives.TRAFFIC)
    world, rank = fabric.world_size, fabric.global_rank
    for step in range(steps):
        idx = [step * micro * world + rank * micro + i for i in range(micro)]
        x = torch.stack([windows[i][0] for i in idx])
        y = torch.stack([windows[i][1] for i in idx])
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB_SIZE), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    per_step = {k: (collectives.TRAFFIC[k] - before[k]) / steps for k in before}
    return {"losses": losses, "bytes_per_step": per_step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pt", help="the losses and bytes of every run, as a torch file")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/collectives/quantized.<machine>.<date>.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    windows = RandomWindows(load_corpus(), BLOCK, args.steps * args.micro * int(os.environ.get("WORLD_SIZE", 4)))
    result = {name: train(name, windows, args.steps, args.micro, args.lr) for name in args.runs.split(",")}
    if torch.distributed.get_rank() == 0:
        torch.save(result, args.pt)
        table = format_table(result, args)
        print(table)
        if args.out != "none":
            from benchmarks.common import out_path, run_header, write_report

            write_report(out_path(args.out, "collectives", "quantized"),
                         "# Quantized collectives (ZeRO++'s qwZ and qgZ) against DDP\n\n" + run_header() + "\n\n"
                         + f"`torchrun --nproc_per_node {torch.distributed.get_world_size()}"
                         " -m benchmarks.collectives.bench_quantized"
                         f" OUT.pt --steps {args.steps} --micro {args.micro} --lr {args.lr} --runs {args.runs}`\n\n"
                         + table)


def format_table(result: dict, args: argparse.Namespace) -> str:
    """Per run: the loss over the last quarter of the steps, against DDP's, and the bytes per step."""
    world = torch.distributed.get_world_size()
    tail = max(1, args.steps // 4)
    ddp = result.get("ddp")
    lines = [f"The demo GPT (2 layers, 64 wide, vocabulary of {VOCAB_SIZE} bytes) on the bundled"
             f" corpus, world size {world}, {args.micro} windows of {BLOCK} tokens per rank and step, AdamW lr"
             f" {args.lr}, {args.steps} steps, fp32. The loss is averaged over the ranks; *last {tail}* is the mean of"
             f" the last {tail} steps. Bytes per step: what one rank hands to reductions and receives from all-gathers"
             " (lzero's counters; DDP's own all-reduce is not counted).", "",
             f"| run | first loss | last {tail} | vs DDP | mean of all vs DDP | worst single step vs DDP |"
             " all-gather bytes/step | reduction bytes/step |", "|---|---|---|---|---|---|---|---|"]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for name, run in result.items():
        losses, sent = run["losses"], run["bytes_per_step"]
        last = mean(losses[-tail:])
        if ddp and run is not ddp:
            vs = f"{last / mean(ddp['losses'][-tail:]) - 1:+.2%}"
            vs_all = f"{mean(losses) / mean(ddp['losses']) - 1:+.2%}"
            worst = f"{max(abs(a / b - 1) for a, b in zip(losses, ddp['losses'])):.2%}"
        else:
            vs = vs_all = worst = "-"
        lines.append(f"| {name} | {losses[0]:.4f} | {last:.4f} | {vs} | {vs_all} | {worst} |"
                     f" {sent['all_gather']:,.0f} | {sent['reduce']:,.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
