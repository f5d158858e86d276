"""One rank of the simulated-cluster benchmark (started by torchrun in a network namespace; see bench_cluster.py):
a model of wide linear blocks trained for a few steps under a layout, rank 0 timing the steps and reading the bytes
its namespace's link to the other "node" carried meanwhile.

    layouts: ddp, zero3 (flat over the 4 ranks), zero3_hybrid (shard groups of 2 = one node each), zero2, zero2_hybrid
"""

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("layout")
parser.add_argument("out")
parser.add_argument("--link", required=True, help="the veth device of this namespace (rank 0 reads its counters)")
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--blocks", type=int, default=4)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--warmup", type=int, default=2)
args = parser.parse_args()

strategy = args.layout
if strategy.endswith("_hybrid") or strategy in ("zero2", "zero3"):
    from lzero.fabric import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=int(args.layout[4]),
                                  **({"shard_group_size": "node"} if args.layout.endswith("_hybrid") else {}))
fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
fabric.launch()
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


model = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
model = fabric.setup_module(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
x = torch.randn(8, args.width)


def counters() -> int:
    folder = Path("/sys/class/net") / args.link / "statistics"
    return int((folder / "tx_bytes").read_text()) + int((folder / "rx_bytes").read_text())


times, bytes_at, losses = [], None, []
for step in range(args.warmup + args.steps):
    if step == args.warmup:
        fabric.barrier()
        bytes_at = counters()
    start = time.perf_counter()
    loss = model(x).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    fabric.barrier()
    if step >= args.warmup:
        times.append(time.perf_counter() - start)
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
link_bytes = counters() - bytes_at
if fabric.global_rank == 0:
    params = sum(p.numel() for p in nn.Sequential(*[Block(args.width) for _ in range(args.blocks)]).parameters())
    Path(args.out).write_text(json.dumps({"layout": args.layout, "step_s": sorted(times)[len(times) // 2],
                                          "link_bytes_per_step": link_bytes / args.steps, "params": params,
                                          "losses": losses}))
