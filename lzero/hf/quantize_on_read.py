"""``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` under zero3: each rank quantizes what it reads.

[Note: quantize on read]
transformers' own quantizer lays the model out (``preprocess_model``: which ``nn.Linear`` become bitsandbytes
``Linear4bit`` / ``Linear8bitLt``, the attributes peft reads, ``is_loaded_in_4bit``), so the module tree is the one
a plain ``from_pretrained`` gives. Each quantized weight then becomes a meta parameter of its packed shape and
storage dtype, and the engine reads every rank's shard of it as of any pretrained tensor
([Note: reading a pretrained checkpoint into shards] in weights.py), except that a read of packed elements
[start, end) reads the unquantized weights they encode and quantizes them on the spot:
- 4-bit codes are blockwise (one absmax per ``blocksize`` weights, blocks never cross), so the read widens to the
  blocks that hold [start, end), quantizes them alone (the bytes a whole-tensor quantization gives, block by
  block), and keeps the codes of [start, end). A shard edge inside a block costs one extra block read on each
  side: at most 2 x 64 weights per tensor and rank.
- 8-bit codes are row-wise (one scale per output row), so the read widens to whole rows: at most two extra rows
  per tensor and rank.
The scales of the blocks (rows) a rank quantized are exact; those of the others are zero on that rank. One
all-reduce (MAX) over every quantized tensor's scales makes them whole on every rank, where the quantization state
is replicated ([Note: packed parameters] in engine/packed_weights.py); double quantization is then computed from the
whole absmax, as bitsandbytes computes it (its offset is the mean over the whole tensor). No rank ever holds more
than a few blocks or rows of a weight unquantized, nor reads a byte of another rank's shard beyond them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lzero.engine import packed_weights
from lzero.errors import ZeroEngineError
from lzero.hf.weights import PretrainedLoadError

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
            codes, absmax = torch.ops.bitsandbytes.quantize_4bit.default(values, self.blocksize, self.quant_type,
                                                                        self.storage)
            self.scales[lo:hi] = absmax.float()
        else:
            codes, scales, _ = F.int8_vectorwise_quant(values.view(-1, self.shape[1]).to(torch.float16))
            self.scales[lo:hi] = scales.float()
        return codes.reshape(-1)

    def state(self, device: torch.device) -> Any:
        """The whole quantization state, once the scales are whole: what bitsandbytes' own quantization keeps."""
        import bitsandbytes.functional as F

        if self.method == packed_weights.EIGHT_BIT:
            return self.scales.to(device)
        absmax = self.scales.to(device)
        common = dict(shape=torch.Size(self.shape), dtype=self.dtype, blocksize=self.blocksize,
                      code=F.get_4bit_type(self.quant_type, device=device), quant_type=self.quant_type)
        if not self.nested:
            return F.QuantState(absmax=absmax, **common)
        offset = absmax.mean()
        nested, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
        return F.QuantState(absmax=nested, offset=offset, state2=state2, **common)


def quantizer_for(config: Any, quantization_config: Any, dtype: torch.dtype) -> Optional[Any]:
    """transformers' quantizer for a bitsandbytes configuration (from the call or from ``config.json``); any other
    quantization method is refused by name."""
    quantization = quantization_config if quantization_config is not None else \
        getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", type(quantization).__name__)
    try:
        packed_weights.refuse_method(method)
    except ZeroEngineError as refused:
        raise PretrainedLoadError(str(refused)) from None
    from transformers.quantizers.auto import get_hf_quantizer

    if getattr(quantization, "llm_int8_enable_fp32_cpu_offload", False):
        raise PretrainedLoadError(
            "`llm_int8_enable_fp32_cpu_offload=True` inside a zero3 `configure_model`: lzero places every shard"
            " itself. HINT: remove it; use the zero3_offload strategy to keep shards in host memory.")
    quantizer, _, _ = get_hf_quantizer(config, quantization_config, None, True, {})
    if quantizer is not None and getattr(quantizer, "pre_quantized", False):
        raise PretrainedLoadError(
            "The checkpoint is already quantized by bitsandbytes (its files hold packed codes). lzero quantizes"
            " shard by shard as it reads unquantized weights. HINT: point `from_pretrained` at the unquantized"
            " (bf16/fp32) model and pass `quantization_config=BitsAndBytesConfig(...)`.")
    quantizer.update_dtype(dtype)
    return quantizer


def lay_out(model: nn.Module, quantizer: Any, dtype: torch.dtype) -> dict[int, QuantizedRead]:
    """The model's modules replaced as transformers' quantizer replaces them, each quantized weight a meta parameter
    of its packed shape; id(weight) -> how to read it. See [Note: quantize on read]."""
    import bitsandbytes as bnb

    quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    reads: dict[int, QuantizedRead] = {}
    for name, module in model.named_modules():
        source = getattr(module, "source_cls", nn.Linear)
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) and source is not nn.Linear:
            raise PretrainedLoadError(
                f"`{name}` is a {source.__name__} quantized by bitsandbytes: its weight is stored transposed, which"
                " lzero's row reads do not quantize. HINT: skip it with `llm_int8_skip_modules`, or use zero2.")
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            read = QuantizedRead(packed_weights.FOUR_BIT, tuple(w.shape), dtype, w.blocksize, w.quant_type,
                                 w.quant_storage, w.compress_statistics)
            module.weight = bnb.nn.Params4bit(
                torch.empty(read.packed_shape(), dtype=read.packed_dtype(), device="meta"), requires_grad=False,
                blocksize=w.blocksize, compress_statistics=w.compress_statistics, quant_type=w.quant_type,
                quant_storage=w.quant_storage, module=module, bnb_quantized=True)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            w = module.weight
            if w.has_fp16_weights:
                raise PretrainedLoadError(
                    "`llm_int8_has_fp16_weight=True` keeps 16-bit weights that train: not a frozen quantized base."
                    " HINT: remove it (QLoRA freezes the 8-bit base).")
            read = QuantizedRead(packed_weights.EIGHT_BIT, tuple(w.shape), dtype)
            module.weight = bnb.nn.Int8Params(torch.empty(read.shape, dtype=torch.int8, device="meta"),
                                              requires_grad=False, has_fp16_weights=False)
        else:
            continue
        reads[id(module.weight)] = read
    # fp32 scales (bitsandbytes requires them), whatever the default dtype (bf16-true builds in bf16)
    buffer = torch.zeros(sum(r.groups for r in reads.values()), dtype=torch.float32, device="cpu")
    offset = 0
    for read in reads.values():
        read.scales, read.buffer = buffer[offset : offset + read.groups], buffer
        offset += read.groups
    return reads


def finish(root: nn.Module, reads: dict[str, QuantizedRead], all_reduce_max: Callable[[Tensor], None],
           device: torch.device) -> None:
    """Every rank has quantized its shards of the weights ``reads`` names (in ``root``): the scales made whole (one
    all-reduce, MAX, in place: a scale is 0 where a rank did not read) and each weight given its quantization state.
    The fp32 scales are then dropped where the state holds others (double quantization)."""
    buffers = {id(r.buffer): r.buffer for _, r in sorted(reads.items())}  # one per model, one order on every rank
    for buffer in buffers.values():
        all_reduce_max(buffer)
    for name, read in sorted(reads.items()):
        module_name, _, param_name = name.rpartition(".")
        owner = root.get_submodule(module_name)
        p, state = owner._parameters[param_name], read.state(device)
        if read.method == packed_weights.FOUR_BIT:
            p.quant_state = owner.quant_state = state
        else:
            p.SCB = state
        read.scales = read.buffer = None  # the state keeps what it needs of them
