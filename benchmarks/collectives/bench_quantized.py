"""The quantized collectives (qwZ, qgZ) against DDP: the demo GPT on the bundled corpus at world size 4, each layout
trained by its own Fabric in one launch, on CPU (gloo).

    torchrun --nproc_per_node 4 benchmarks/bench_quantized.py OUT.pt [--steps 200] [--lr 1e-3] [--micro 8]

Rank 0 writes OUT.pt: per run the losses (averaged over ranks) and the bytes handed to reduce-scatters and received
from all-gathers per step (lzero's runs), and prints the table of benchmarks/results/quantized.md.
"""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F

from lzero.demo.data import VOCAB_SIZE, RandomWindows, load_corpus
from lzero.demo.model import GPT, GPTConfig
from lzero.engine import collectives
from lzero.fabric import ZeroFabricStrategy

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
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    windows = RandomWindows(load_corpus(), BLOCK, args.steps * args.micro * int(os.environ.get("WORLD_SIZE", 4)))
    result = {name: train(name, windows, args.steps, args.micro, args.lr) for name in args.runs.split(",")}
    if torch.distributed.get_rank() == 0:
        torch.save(result, args.out)
        ddp = result.get("ddp")
        tail = max(1, args.steps // 4)
        for name, run in result.items():
            last = sum(run["losses"][-tail:]) / tail
            vs = f"{last / (sum(ddp['losses'][-tail:]) / tail) - 1:+.2%}" if ddp else "-"
            print(f"| {name} | {run['losses'][0]:.4f} | {last:.4f} | {vs} | {run['bytes_per_step']['all_gather']:,.0f} |"
                  f" {run['bytes_per_step']['reduce']:,.0f} |")


if __name__ == "__main__":
    main()
