"""ZeRO++'s quantized collectives (lzero/engine/quantized_collectives.py): the blockwise codes against the exact
values, the collectives on 2 gloo ranks against the exact ones, and a short run of the demo GPT at world size 4 against
DDP (benchmarks/collectives/bench_quantized.py; its 200-step table: benchmarks/results/collectives/quantized.*.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _launch import run_script
from lzero.engine import collectives, quantized_collectives
from lzero.engine.quantized_collectives import BLOCK, dequantize, packed_bytes, quantize


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_round_trip_within_half_a_step_of_each_blocks_scale(bits: int) -> None:
    x = torch.randn(1000) * torch.logspace(-3, 1, 1000)  # blocks of very different magnitudes
    packed = quantize(x, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(1000, bits)
    back = dequantize(packed, 1000, bits)
    levels = quantized_collectives.LEVELS[bits]
    padded = torch.cat([x, torch.zeros(-1000 % BLOCK)]).view(-1, BLOCK)
    step = (padded.abs().amax(dim=1, keepdim=True) / levels).expand(-1, BLOCK).reshape(-1)[:1000]
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()  # to nearest: at most half a step
    assert torch.equal(dequantize(quantize(torch.zeros(300), bits), 300, bits), torch.zeros(300))
    nonfinite = torch.ones(300)
    nonfinite[70] = float("inf")  # fp16 overflow must stay visible: its block dequantizes to NaN/inf
    assert not torch.isfinite(dequantize(quantize(nonfinite, bits), 300, bits)[BLOCK:2 * BLOCK]).any()
    assert torch.isfinite(dequantize(quantize(nonfinite, bits), 300, bits)[:BLOCK]).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_and_within_one_step(bits: int) -> None:
    x = torch.full((BLOCK,), 0.3)
    x[0] = 1.0  # the block's scale: 1 / levels per step; 0.3 falls between two codes
    draws = torch.stack([dequantize(quantize(x, bits, torch.Generator().manual_seed(s)), BLOCK, bits)
                         for s in range(200)])
    levels = quantized_collectives.LEVELS[bits]
    step = 1.0 / levels
    assert ((draws - x).abs() <= step * (1 + 1e-6)).all()
    assert abs(draws[:, 1:].mean().item() - 0.3) < 0.02 * step * levels / 10  # mean over 50,400


def _collectives(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(300, generator=gen)
    exact, ours = torch.empty(300 * world), torch.empty(300 * world)
    collectives.all_gather(exact, shard)
    quantized_collectives.all_gather(ours, shard).wait()
    flat = torch.randn(300 * world, generator=gen)
    summed = flat.clone()
    dist.all_reduce(summed)
    out = {"gather_error": (ours - exact).abs().max().item(), "gathered": ours,
           "gather_bound": exact.abs().max().item() / 127 / 2, "reduce_exact": summed.view(world, -1)[rank]}
    for bits in (8, 4):
        mine = torch.empty(300)
        quantized_collectives.reduce_scatter(mine, flat.clone(), bits=bits,
                                             generator=torch.Generator().manual_seed(rank))
        out[f"reduce_{bits}"] = mine
        out[f"reduce_bound_{bits}"] = world * flat.abs().max().item() / quantized_collectives.LEVELS[bits]
    shard = flat[:301].clone()  # hybrid's replica all-reduce: an odd length, padded to the ranks
    exact = shard.clone()
    dist.all_reduce(exact)
    out["all_reduce"] = quantized_collectives.all_reduce(shard, bits=4, generator=torch.Generator().manual_seed(rank))
    out["all_reduce_exact"] = exact
    out["all_reduce_bound"] = world * flat.abs().max().item() / 7 + exact.abs().max().item() / 127 / 2
    return out


def test_quantized_collectives_on_two_ranks_against_the_exact_ones() -> None:
    results = run_ranks(_collectives, 2)
    assert torch.equal(results[0]["gathered"], results[1]["gathered"])  # every rank computes with the same weights
    for r in results:
        assert 0 < r["gather_error"] <= r["gather_bound"] * (1 + 1e-6)
        for bits in (8, 4):  # each of the 2 terms off by at most one step of its block
            error = (r[f"reduce_{bits}"] - r["reduce_exact"]).abs().max().item()
            assert 0 < error <= r[f"reduce_bound_{bits}"], (bits, error)
        # the all-reduce: a step per int4 term, then half an int8 step of the sum; every rank the same values
        error = (r["all_reduce"] - r["all_reduce_exact"]).abs().max().item()
        assert 0 < error <= r["all_reduce_bound"], error
    assert torch.equal(results[0]["all_reduce"], results[1]["all_reduce"])


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("quantized") / "runs.pt"
    run_script("benchmarks/collectives/bench_quantized.py", str(out), "--steps", "40", "--runs",
               "ddp,zero3,zero3_qwz_qgz8,zero3_qwz_qgz4", "--out", "none", ranks=2)
    return torch.load(out)


def test_quantized_runs_track_ddp_and_send_fewer_bytes(short_runs: dict) -> None:
    """40 steps of the demo GPT at world size 2 (the 200-step table at world size 4: benchmarks/results/collectives/):
    the exact zero3 run is DDP's; qwZ with int8 or int4 gradients stays within 1% of DDP's loss over the last 10 steps,
    while its
    all-gathers carry >= 3.5x fewer bytes than fp32, and its reductions 3.5x (int8) and 7x (int4) fewer."""
    ddp, exact = short_runs["ddp"], short_runs["zero3"]
    assert max(abs(a - b) / b for a, b in zip(exact["losses"], ddp["losses"])) < 1e-5
    reference = sum(ddp["losses"][-10:]) / 10
    for name, reduce_ratio in (("zero3_qwz_qgz8", 3.5), ("zero3_qwz_qgz4", 7.0)):
        run = short_runs[name]
        last = sum(run["losses"][-10:]) / 10
        gather = exact["bytes_per_step"]["all_gather"] / run["bytes_per_step"]["all_gather"]
        reduce = exact["bytes_per_step"]["reduce"] / run["bytes_per_step"]["reduce"]
        print(f"{name}: loss {last:.4f} vs DDP {reference:.4f} ({last / reference - 1:+.2%}); all-gather bytes"
              f" {gather:.2f}x fewer, reduction bytes {reduce:.2f}x fewer")
        assert abs(last / reference - 1) < 0.01
        assert gather >= 3.5 and reduce >= reduce_ratio
