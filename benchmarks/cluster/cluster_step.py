"""One rank of the simulated-cluster benchmark (started by torchrun in a network namespace as
``-m benchmarks.cluster.cluster_step``; see benchmarks.cluster.bench_cluster):
a model of wide linear blocks trained for a few steps under a layout, rank 0 timing the steps (wall clock, and its
process's CPU time) and reading the bytes its namespace's link to the other "node" carried meanwhile.

    layouts: ddp, and those of LAYOUTS: zero2/zero3 flat over the 4 ranks, *_hybrid (shard groups of 2 = one node
    each), zero3_hpz (hpZ within the node), zero3_qwz (int8 weight all-gathers), *_qwz_qgz8 (and int8 reductions)
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
parser.add_argument("--batch", type=int, default=8, help="rows per rank and step")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--warmup", type=int, default=2)
args = parser.parse_args()

LAYOUTS = {  # name -> ZeroFabricStrategy options (ddp: Lightning's)
    "zero2": {"stage": 2}, "zero2_hybrid": {"stage": 2, "shard_group_size": "node"},
    "zero3": {"stage": 3}, "zero3_hybrid": {"stage": 3, "shard_group_size": "node"},
    # the memory-minimal schedule (lzero's default before schedule="auto"): every block gathered twice a step
    "zero3_min_memory": {"stage": 3, "schedule": "min_memory"},
    "zero3_hybrid_min_memory": {"stage": 3, "shard_group_size": "node", "schedule": "min_memory"},
    # the last 2 of the 4 blocks (1,049,600 elements each) stay gathered from their forward to their backward
    "zero3_hybrid_keep2": {"stage": 3, "shard_group_size": "node", "max_reuse_distance": 2_200_000,
                           "schedule": "min_memory"},
    # DeepSpeed's default stage3_max_reuse_distance (1e9 elements): every block stays gathered from its forward to its
    # backward (one all-gather per block and step), still sharded between steps
    "zero3_hybrid_reuse": {"stage": 3, "shard_group_size": "node", "max_reuse_distance": 1_000_000_000,
                           "schedule": "min_memory"},
    "zero3_hybrid_reuse_nocheck": {"stage": 3, "shard_group_size": "node", "max_reuse_distance": 1_000_000_000,
                                   "unit_order_timeout_s": 0, "schedule": "min_memory"},
    "zero3_hpz": {"stage": 3, "hpz_partition_size": 2},
    "zero3_qwz": {"stage": 3, "quantized_weights": True},
    "zero3_qwz_qgz8": {"stage": 3, "quantized_weights": True, "quantized_gradients": 8},
    "zero3_hybrid_qwz_qgz8": {"stage": 3, "shard_group_size": "node", "quantized_weights": True,
                              "quantized_gradients": 8},
}
strategy = args.layout
if strategy != "ddp":
    from lzero import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(**LAYOUTS[args.layout])
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
x = torch.randn(args.batch, args.width)


def counters() -> int:
    folder = Path("/sys/class/net") / args.link / "statistics"
    return int((folder / "tx_bytes").read_text()) + int((folder / "rx_bytes").read_text())


times, cpu, bytes_at, losses = [], [], None, []
for step in range(args.warmup + args.steps):
    if step == args.warmup:
        fabric.barrier()
        bytes_at = counters()
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = model(x).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    fabric.barrier()
    if step >= args.warmup:
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)  # this process's threads (gloo's too), user + system
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
link_bytes = counters() - bytes_at
if fabric.global_rank == 0:
    params = sum(p.numel() for p in nn.Sequential(*[Block(args.width) for _ in range(args.blocks)]).parameters())
    Path(args.out).write_text(json.dumps({"layout": args.layout, "step_s": sorted(times)[len(times) // 2],
                                          "cpu_s": sorted(cpu)[len(cpu) // 2],
                                          "link_bytes_per_step": link_bytes / args.steps, "params": params,
                                          "losses": losses, "batch": args.batch}))
