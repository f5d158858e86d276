"""Quantized collectives (ZeRO++'s qwZ and qgZ, arXiv 2306.10209), in plain torch.

[Note: quantized collectives]
Both are opt-in and change results (the acceptance is convergence, not equality):
- **qwZ** (``ZeroConfig.quantized_weights``): stage 3's parameter all-gathers send every shard as blockwise int8
  codes (blocks of ``BLOCK`` elements, one fp32 absmax scale per block), rounded to nearest, and every rank, its own
  shard included, dequantizes all of them, so every rank computes with the same full weights. About 1.06 bytes per
  element on the wire instead of 4 (fp32) or 2 (bf16). The fp32 masters and the shards are untouched: only what
  forward and backward read is rounded, as in ZeRO++. A write-back through ``gathered()`` gathers exactly.
- **qgZ** (``ZeroConfig.quantized_gradients`` = 8 or 4): a gradient reduce-scatter becomes an all-to-all of
  quantized chunks. The rank-by-rank bucket is cut into its N chunks, each chunk quantized blockwise (int8, or int4
  packed two to a byte), chunk k sent to rank k, and each rank dequantizes what it received and sums it in fp32.
  Each gradient is rounded once, by its sender, stochastically (up with the probability of its remainder, so the
  rounding is unbiased and a gradient much smaller than its block's largest still moves the weights on average);
  the sums are exact fp32. About 1.06 (int8) or 0.56 (int4) bytes per element instead of 4. The rounding draws come
  from a generator per rank seeded by its rank: reproducible run to run, but not part of a checkpoint, so a resumed
  run draws other noise than the uninterrupted one. Under hybrid sharding the all-reduce of the shard across the
  replicas is quantized too (:func:`all_reduce`: a quantized reduce-scatter, then an all-gather of int8 sums), so
  the links between nodes carry codes as well; each gradient is then rounded twice.
Codes are symmetric about zero, so a block of zeros stays zero. A non-finite value makes its
block's scale non-finite and its dequantized values NaN or inf, so fp16 overflow is still seen by every rank. A
world of one sends nothing and quantizes nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lzero.engine import collectives

BLOCK = 64  # elements per scale: 4 scale bytes per 64 codes (benchmarks, collectives: 256 lost 1.7% at int4)
LEVELS = {8: 127, 4: 7}  # the largest code of each width (symmetric: -L..L)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes one quantized chunk of ``numel`` elements takes: codes, then one fp32 scale per block."""
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK * bits // 8 + 4 * blocks


@torch.no_grad()
def quantize(x: Tensor, bits: int = 8, generator: Optional[torch.Generator] = None) -> Tensor:
    """``x`` (1-D, any float dtype) as ``packed_bytes(x.numel(), bits)`` uint8: blockwise absmax codes, then scales.
    ``generator``: round stochastically (up with the probability of the remainder: unbiased), else to nearest."""
    blocks = -(-x.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    padded = padded.view(blocks, BLOCK)
    scale = padded.abs().amax(dim=1, keepdim=True) / LEVELS[bits]  # (blocks, 1)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # a block of zeros: codes 0, scale 0
    scaled = padded / safe
    if generator is not None:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device)
        scaled = torch.floor(scaled + noise)
    else:
        scaled = torch.round(scaled)
    codes = scaled.clamp_(-LEVELS[bits], LEVELS[bits]).to(torch.int8)  # (blocks, BLOCK)
    if bits == 4:  # two codes per byte, each shifted to 1..15
        nibbles = (codes + 8).to(torch.uint8).view(blocks, BLOCK // 2, 2)
        body = nibbles[..., 0] | (nibbles[..., 1] << 4)
    else:
        body = codes.view(torch.uint8)
    return torch.cat([body.reshape(-1), scale.reshape(-1).view(torch.uint8)])


@torch.no_grad()
def dequantize(packed: Tensor, numel: int, bits: int = 8) -> Tensor:
    """The fp32 values of one chunk :func:`quantize` made of ``numel`` elements."""
    blocks = -(-numel // BLOCK)
    split = blocks * BLOCK * bits // 8
    scale = packed[split : split + 4 * blocks].view(torch.float32).view(blocks, 1)
    if bits == 4:
        body = packed[:split].view(blocks, BLOCK // 2)
        codes = torch.stack([body & 15, body >> 4], dim=-1).view(blocks, BLOCK).to(torch.float32) - 8
    else:
        codes = packed[:split].view(torch.int8).view(blocks, BLOCK).to(torch.float32)
    return (codes * scale).view(-1)[:numel]


class _Dequantized:
    """Handle of a quantized collective: waiting lands the dequantized values in the output."""

    def __init__(self, work: collectives.Handle, finish: Callable[[], None]) -> None:
        self.work: Optional[collectives.Handle] = work  # the collective of the packed bytes
        self.finish: Optional[Callable[[], None]] = finish

    def wait(self) -> bool:
        if self.finish is not None:
            self.work.wait()
            self.finish()
            self.work = self.finish = None  # the packed buffers can go
        return True

    def is_completed(self) -> bool:
        return self.finish is None or self.work.is_completed()


@torch.no_grad()
def all_gather(flat: Tensor, shard: Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False) -> collectives.Handle:
    """qwZ: :func:`collectives.all_gather` with every shard sent as int8 codes and scales, then dequantized."""
    if collectives.local(group):
        return collectives.all_gather(flat, shard, group)
    if not shard.is_floating_point():  # a coalesced bucket's bytes (shard_bytes): its values are not numbers here
        raise TypeError(f"qwZ all-gathers floating-point shards, not {shard.dtype}: gather each unit on its own.")
    world = collectives.world_size(group)
    mine = quantize(shard, 8)
    every = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
    work = collectives.all_gather(every, mine, group, async_op=async_op)  # counts the int8 bytes in TRAFFIC
    numel = shard.numel()

    def finish() -> None:
        pieces = every.view(world, -1)
        for r in range(world):
            flat[r * numel : (r + 1) * numel].copy_(dequantize(pieces[r], numel, 8))

    handle = _Dequantized(work, finish)
    if not async_op:
        handle.wait()
    return handle


def param_all_gather(quantized_weights: bool) -> collectives.AllGather:
    """The parameter all-gather of a run (``ZeroConfig.quantized_weights``): qwZ's :func:`all_gather`, or the plain
    :func:`collectives.all_gather`. The one place the choice is made: the engine asks once, and its gathers (stages
    1-2's, and stage 3's ``Gatherer``) call what it got."""
    return all_gather if quantized_weights else _plain_all_gather


def _plain_all_gather(flat: Tensor, shard: Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> collectives.Handle:
    """:func:`collectives.all_gather`, looked up when called, as the engine's other gathers do (a wrapper put around
    it, such as a test's count of collectives, sees every gather)."""
    return collectives.all_gather(flat, shard, group, async_op=async_op)


@torch.no_grad()
def reduce_scatter(output: Tensor, flat: Tensor, group: Optional[dist.ProcessGroup] = None, async_op: bool = False,
                   bits: int = 8, generator: Optional[torch.Generator] = None) -> collectives.Handle:
    """qgZ: :func:`collectives.reduce_scatter` as an all-to-all of quantized chunks, summed in fp32 by the receiver."""
    if collectives.local(group):
        return collectives.reduce_scatter(output, flat, group)
    world, numel = collectives.world_size(group), output.numel()
    chunks = flat.view(world, numel)
    sent = torch.stack([quantize(chunks[r], bits, generator) for r in range(world)])  # (world, packed bytes)
    received = torch.empty_like(sent)
    work = collectives.all_to_all_single(received, sent, group, async_op=async_op)

    def finish() -> None:
        total = torch.zeros(numel, dtype=torch.float32, device=output.device)
        for r in range(world):  # rank order: every rank sums its shard the same way
            total += dequantize(received[r], numel, bits)
        output.copy_(total)

    handle = _Dequantized(work, finish)
    if not async_op:
        handle.wait()
    return handle


@torch.no_grad()
def all_reduce(tensor: Tensor, group: Optional[dist.ProcessGroup] = None, bits: int = 8,
               generator: Optional[torch.Generator] = None) -> Tensor:
    """qgZ across the replicas of hybrid sharding: ``tensor`` (1-D) summed over ``group`` in place, as a quantized
    reduce-scatter (:func:`reduce_scatter`) then an all-gather of the int8 sums. Every rank dequantizes the same codes,
    its own chunk's included, so the replicas hold equal values. Synchronous."""
    if collectives.local(group):
        return tensor
    world, numel = collectives.world_size(group), tensor.numel()
    chunk = -(-numel // world)
    padded = torch.zeros(world * chunk, dtype=torch.float32, device=tensor.device)
    padded[:numel] = tensor
    mine = torch.empty(chunk, dtype=torch.float32, device=tensor.device)
    reduce_scatter(mine, padded, group, bits=bits, generator=generator).wait()
    summed = torch.empty(world * chunk, dtype=torch.float32, device=tensor.device)
    all_gather(summed, mine, group).wait()
    tensor.copy_(summed[:numel])
    return tensor
