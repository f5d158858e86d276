"""How one pretrained weight becomes bitsandbytes' packed codes, a flat range at a time: the quantization that
``from_pretrained`` under zero3 runs as each rank reads its shard ([Note: quantize on read] in
lzero/hf/quantize_on_read.py), and that a checkpoint written without its frozen base runs again to read the codes
back from the pretrained files ([Note: a checkpoint without its frozen base] in lzero/checkpoint/base_files.py).
A range's codes depend only on the blocks (rows) that hold it, so any reader of any range gets the bytes a
whole-tensor quantization gives."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from lzero.engine import packed_weights
from lzero.engine.frozen_base import byte_view, digest_tensor

CHUNK_WEIGHTS = 1 << 15
"""Weights read and quantized at once (64 KB in bf16): the temporaries stay small, so the allocator reuses them
rather than holding freed megabytes between the shards a rank keeps."""

ReadWeights = Callable[[int, int, Tensor], None]
"""``read(a, b, out)``: elements [a, b) of the unquantized tensor, flattened, into ``out``."""


@dataclass
class QuantizedRead:
    """How one pretrained weight becomes packed codes as a rank reads its shard of it."""

    method: str  # packed_weights.FOUR_BIT or packed_weights.EIGHT_BIT
    shape: tuple[int, int]  # (out_features, in_features), unquantized
    dtype: torch.dtype  # the dtype the weights are quantized from (the model's)
    blocksize: int = 64  # 4-bit: weights per absmax
    quant_type: str = "nf4"
    storage: torch.dtype = torch.uint8  # 4-bit: quant_storage
    nested: bool = False  # 4-bit: double quantization of the absmax
    # fp32: absmax per block (4-bit) or scale per row (8-bit), zero where this rank read nothing; a slice of
    # ``buffer``, which holds the scales of every quantized weight of the model, all-reduced at once by ``finish``
    scales: Optional[Tensor] = field(default=None, init=False)
    buffer: Optional[Tensor] = field(default=None, init=False)
    # 4-bit: the dtype of the code table the codes were bucketed with (see [Note: the process's 4-bit code table]);
    # set by the first quantization, or by the record for a read again that must give the same codes
    table: Optional[torch.dtype] = field(default=None, init=False)
    # 4-bit: how the host computes the whole quantization state again (``keep_state_record``); None: it cannot
    state_record: Optional[dict[str, Any]] = field(default=None, init=False)

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def group(self) -> int:
        """Weights quantized together: a block (4-bit) or a row (8-bit)."""
        return self.blocksize if self.method == packed_weights.FOUR_BIT else self.shape[1]

    @property
    def groups(self) -> int:
        return math.ceil(self.numel / self.group)

    @property
    def per_element(self) -> int:
        """Weights one packed element encodes: two per byte at 4 bits, one int8 per weight at 8."""
        return 2 * self.storage.itemsize if self.method == packed_weights.FOUR_BIT else 1

    def packed_shape(self) -> tuple[int, int]:
        if self.method == packed_weights.EIGHT_BIT:
            return self.shape
        return ((self.numel + 1) // 2 // self.storage.itemsize, 1)  # the codes' bytes, in storage elements

    def packed_dtype(self) -> torch.dtype:
        return self.storage if self.method == packed_weights.FOUR_BIT else torch.int8

    @torch.no_grad()
    def read(self, read_weights: ReadWeights, start: int, end: int, out: Tensor) -> None:
        """Packed elements [start, end) into ``out``: the blocks (rows) that hold them read and quantized, a chunk of
        at most ``CHUNK_WEIGHTS`` weights at a time (see [Note: quantize on read])."""
        k, g = self.per_element, self.group
        first, last = start * k // g, min(math.ceil(end * k / g), self.groups)  # the groups to quantize
        step = max(1, CHUNK_WEIGHTS // g)
        for lo in range(first, last, step):
            hi = min(lo + step, last)
            codes = self._quantize(read_weights, lo, hi)  # the codes of groups [lo, hi)
            a, b = max(start, lo * g // k), min(end, min(hi * g, self.numel) // k)  # packed elements they hold
            out[a - start : b - start].copy_(codes[a - lo * g // k : b - lo * g // k])

    def _quantize(self, read_weights: ReadWeights, lo: int, hi: int) -> Tensor:
        """Groups [lo, hi) read and quantized; their scales kept. Returns their codes, flat."""
        import bitsandbytes.functional as F

        a, b = lo * self.group, min(hi * self.group, self.numel)
        values = torch.empty(b - a, dtype=self.dtype, device="cpu")
        read_weights(a, b, values)
        if self.method == packed_weights.FOUR_BIT:
            with code_table(self.quant_type, self.table):
                codes, absmax = torch.ops.bitsandbytes.quantize_4bit.default(values, self.blocksize, self.quant_type,
                                                                            self.storage)
            self.table = self.table or table_dtype(self.quant_type)
            self.scales[lo:hi] = absmax.float()
        else:
            codes, scales, _ = F.int8_vectorwise_quant(values.view(-1, self.shape[1]).to(torch.float16))
            self.scales[lo:hi] = scales.float()
        return codes.reshape(-1)

    def record(self) -> dict[str, Any]:
        """What fixes the codes, as JSON: enough to quantize any range again (:meth:`from_record`)."""
        return {"method": self.method, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "blocksize": self.blocksize, "quant_type": self.quant_type,
                "storage": str(self.storage).removeprefix("torch."), "nested": self.nested,
                **({"table": str(self.table).removeprefix("torch.")} if self.table is not None else {}),
                **({"state": self.state_record} if self.state_record is not None else {})}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "QuantizedRead":
        read = cls(record["method"], tuple(record["shape"]), getattr(torch, record["dtype"]), record["blocksize"],
                   record["quant_type"], getattr(torch, record["storage"]), record["nested"])
        read.scales = read.buffer = torch.zeros(read.groups, dtype=torch.float32)  # written by each read, unused
        read.table = getattr(torch, record["table"]) if "table" in record else None
        read.state_record = record.get("state")
        return read

    def state(self, device: torch.device, offset: Optional[float] = None) -> Any:
        """The whole quantization state, once the scales are whole: what bitsandbytes' own quantization keeps.
        ``offset``: double quantization's (recorded; by default the mean of the absmax, as bitsandbytes takes it)."""
        import bitsandbytes.functional as F

        if self.method == packed_weights.EIGHT_BIT:
            return self.scales.to(device)
        absmax = self.scales.to(device)
        common = dict(shape=torch.Size(self.shape), dtype=self.dtype, blocksize=self.blocksize,
                      code=F.get_4bit_type(self.quant_type, device=device), quant_type=self.quant_type)
        if not self.nested:
            return F.QuantState(absmax=absmax, **common)
        offset = absmax.mean() if offset is None else torch.tensor(offset, dtype=absmax.dtype, device=device)
        nested, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
        return F.QuantState(absmax=nested, offset=offset, state2=state2, **common)

    def keep_state_record(self, state: Any) -> None:
        """After :meth:`state` on the rank's device: whether the host, from the scales and the offset alone,
        computes the same state (then ``state_record`` says how, and each tensor's hash and layout, so that a
        checkpoint may leave the state out and read it back: [Note: a checkpoint without its frozen base])."""
        self.state_record = None
        if self.method != packed_weights.FOUR_BIT:
            return
        offset = float(state.offset) if self.nested else None
        again = state_tensors(self.state(torch.device("cpu"), offset))
        done = state_tensors(state)
        if again.keys() != done.keys() or not all(
                again[k].dtype == done[k].dtype and torch.equal(byte_view(again[k]), byte_view(done[k].cpu()))
                for k in done):
            return
        self.state_record = {"offset": offset, "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
                             "tensors": {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                             "sha256": digest_tensor(t)} for k, t in again.items()}}

    def state_again(self, read_weights: ReadWeights) -> dict[str, Tensor]:
        """The state ``state_record`` describes, computed again on the host: every group read and quantized for its
        scale, then the state from them and the recorded offset, under the recorded default dtype (the code book's).
        Keyed as bitsandbytes' state dict keys them under the weight (``absmax``, ``quant_map``...)."""
        record = self.state_record
        codes = torch.empty(self.packed_shape()[0] * self.packed_shape()[1], dtype=self.packed_dtype())
        default = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, record["default_dtype"]))
        try:
            self.read(read_weights, 0, codes.numel(), codes)
            return state_tensors(self.state(torch.device("cpu"), record["offset"]))
        finally:
            torch.set_default_dtype(default)


def state_tensors(state: Any) -> dict[str, Tensor]:
    """A 4-bit QuantState as bitsandbytes' state dict writes it under the weight (``weight.<key>``)."""
    return state.as_dict(packed=True)


# [Note: the process's 4-bit code table]
# bitsandbytes' CPU quantization buckets each weight by the midpoints of its code table (16 values), which it makes
# once per process and quantization type, in the default dtype of the process's first 4-bit quantization
# (``get_4bit_type`` under bf16-true's ``configure_model`` gives a bf16 table, elsewhere an fp32 one); the midpoints
# of a bf16 table bucket some weights into other codes than fp32's. Codes quantized again later (a checkpoint that
# reads its QLoRA base back from the pretrained files: [Note: a checkpoint without its frozen base] in
# lzero/checkpoint/base_files.py), in another process, must be bucketed by the table the run used: the first
# quantization records the table's dtype (``table_dtype``), and a read from the record quantizes under a table of
# that dtype (``code_table``), the process's own put back afterwards. Both read bitsandbytes' cache of tables, where
# its CPU kernel looks the table up; a version without that cache gives None, and the weight is then written into
# checkpoints rather than read back.


def _table_cache() -> Optional[dict]:
    try:
        from bitsandbytes.backends import utils
    except ImportError:
        return None
    cache = getattr(utils, "_code_4bit_cache", None)
    return cache if isinstance(cache, dict) else None


def _forget_bounds() -> None:
    """bitsandbytes' CPU kernel keeps the midpoints of the table it first used (``functools.cache``): forgotten, they
    are computed again from the table cached now."""
    try:
        from bitsandbytes.backends.default import ops
    except ImportError:
        return
    clear = getattr(getattr(ops, "_get_4bit_quantize_bounds", None), "cache_clear", None)
    if clear is not None:
        clear()


def table_dtype(quant_type: str) -> Optional[torch.dtype]:
    """The dtype of this process's 4-bit code table for ``quant_type`` on the CPU, None when unknown."""
    cache = _table_cache()
    table = cache.get((quant_type, torch.device("cpu"))) if cache is not None else None
    return table.dtype if isinstance(table, Tensor) else None


@contextlib.contextmanager
def code_table(quant_type: str, dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Inside the block, bitsandbytes' CPU 4-bit quantization uses a code table made in ``dtype`` (None: the
    process's own)."""
    cache = _table_cache()
    if dtype is None or cache is None or table_dtype(quant_type) == dtype:
        yield
        return
    from bitsandbytes.functional import get_4bit_type

    key, missing = (quant_type, torch.device("cpu")), object()
    before, default = cache.get(key, missing), torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as bitsandbytes makes it under that default dtype
    try:
        cache[key] = get_4bit_type(quant_type, device="cpu")
    finally:
        torch.set_default_dtype(default)
    _forget_bounds()
    try:
        yield
    finally:
        if before is missing:
            cache.pop(key, None)
        else:
            cache[key] = before
        _forget_bounds()
