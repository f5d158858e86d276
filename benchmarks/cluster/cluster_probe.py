"""One rank of the simulated cluster's probe (started like cluster_step, as ``-m benchmarks.cluster.cluster_probe``,
by bench_cluster --probe): what the two-level model in two_level is fitted on, every measurement taken with all 4
ranks running at once, as in a step.

- ``intra``: lzero's all-gathers and reduce-scatters (collectives.py: pairwise on gloo) and gloo's all-reduces within
  each "node" (ranks 0-1, 2-3; both nodes at once) at three sizes;
- ``inter``: all-reduces between the two nodes (pairs 0-2 and 1-3 at once: the shaped link carries both) at two
  sizes, and lzero's all-gather over all 4 ranks (``flat_all_gather``: four pairwise flows each way on the link);
- ``small_world_collective``: an 8-byte all-gather over all 4 ranks (lzero's unit-order check before each stage-3
  gather, and the end-of-backward flag exchange, are such);
- ``compute``: forward + backward of cluster_step's model (no collective); ``adam``: AdamW's step per element;
  ``quantize``: int8 quantize + dequantize per element (lzero.engine.quantized_collectives), rounded to nearest (qwZ) and
  stochastically (qgZ); ``stage{2,3}_overhead``: what lzero's engine adds to a plain step at world size 1 (its
  hooks, gathers and reductions as copies, packing).
Rank 0 writes OUT (JSON). Times are medians of 15 after 1 of warm-up.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lzero.engine import collectives, quantized_collectives

parser = argparse.ArgumentParser()
parser.add_argument("layout")  # unused: bench_cluster passes its arguments to both scripts alike
parser.add_argument("out")
parser.add_argument("--link")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--blocks", type=int, default=4)
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
node, pair = nodes[rank // 2], pairs[rank % 2]


def timed(fn, reps: int = 15) -> float:
    times = []
    for i in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


SIZES = [2**18, 2**20, 2**22]  # fp32 elements: 1, 4, 16 MB
result = {"intra_all_gather": [], "intra_reduce_scatter": [], "intra_all_reduce": [], "inter_all_reduce": []}
for numel in SIZES:
    out, shard, buf = torch.empty(numel), torch.randn(numel // 2), torch.randn(numel)
    result["intra_all_gather"].append((4 * numel, timed(lambda: collectives.all_gather(out, shard, group=node))))
    result["intra_reduce_scatter"].append(
        (4 * numel, timed(lambda: collectives.reduce_scatter(shard, buf, group=node))))
    result["intra_all_reduce"].append((4 * numel, timed(lambda: dist.all_reduce(buf, group=node))))
    if numel <= 2**21:  # the shaped link: 8 MB at most
        result["inter_all_reduce"].append((4 * numel, timed(lambda: dist.all_reduce(buf, group=pair))))
        # lzero's all-gather over all 4 ranks (pairwise: each rank sends its shard to the 3 others, 2 of them across)
        whole, quarter = torch.empty(numel), torch.randn(numel // 4)
        result.setdefault("flat_all_gather", []).append(
            (4 * numel, timed(lambda: collectives.all_gather(whole, quarter))))

tiny_in, tiny_out = torch.zeros(2), torch.zeros(8)  # lzero's unit-order check: a tiny all-gather over every rank
result["small_world_collective"] = timed(lambda: dist.all_gather_into_tensor(tiny_out, tiny_in), reps=20)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


model = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
x = torch.randn(args.batch, args.width)
result["compute"] = timed(lambda: model(x).pow(2).mean().backward())
params = sum(p.numel() for p in model.parameters())
for p in model.parameters():
    p.grad = torch.randn_like(p)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
optimizer.step()
result["adam_per_element"] = timed(optimizer.step) / params
# lzero's stage-3 engine at world size 1 (its gathers and reductions are copies): what it adds to a plain step
solo = None
for r in range(dist.get_world_size()):  # every rank makes every group
    group = dist.new_group([r])
    solo = group if r == rank else solo
from lzero import ZeroConfig  # noqa: E402 - after the process groups, as a script
from lzero.engine.engine import ZeroEngine  # noqa: E402
from lzero.optimizer import ZeroOptimizer  # noqa: E402

def plain_step() -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


plain = timed(plain_step)
for stage in (2, 3):
    sharded = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
    inner = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    engine = ZeroEngine(sharded, [inner], ZeroConfig(stage=stage, unit_modules=("Block",)), group=solo)
    zopt = ZeroOptimizer(inner, engine, 0)

    def engine_step() -> None:
        engine.gather_root()
        sharded(x).pow(2).mean().backward()
        zopt.step()
        zopt.zero_grad()

    result[f"stage{stage}_overhead"] = max(0.0, timed(engine_step) - plain)
    engine.remove()
flat = torch.randn(params // 4)
rounding = torch.Generator().manual_seed(rank)
result["stochastic_quantize_per_element"] = timed(
    lambda: quantized_collectives.dequantize(quantized_collectives.quantize(flat, 8, rounding), flat.numel(), 8)) / flat.numel()
result["quantize_per_element"] = timed(
    lambda: quantized_collectives.dequantize(quantized_collectives.quantize(flat, 8), flat.numel(), 8)) / flat.numel()
result["params"] = params
if rank == 0:
    Path(args.out).write_text(json.dumps(result))
dist.destroy_process_group()
