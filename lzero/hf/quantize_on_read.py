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

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lzero.engine import packed_weights
from lzero.engine.quantized_read import QuantizedRead
from lzero.errors import ZeroEngineError
from lzero.hf.weights import PretrainedLoadError

__all__ = ["QuantizedRead", "finish", "lay_out", "quantizer_for"]


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
            read.keep_state_record(state)
        else:
            p.SCB = state
        read.scales = read.buffer = None  # the state keeps what it needs of them
