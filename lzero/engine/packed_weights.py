"""Packed parameters: the frozen, quantized weights of a QLoRA base, whose bytes only ever move raw.

[Note: packed parameters]
A quantized base (bitsandbytes' ``Params4bit`` and ``Int8Params``) holds codes, not numbers of its dtype: two
4-bit codes per byte, viewed as ``quant_storage`` (uint8, or bfloat16 as transformers' ``bnb_4bit_quant_storage``
sets it), or one int8 code per weight. Beside them a quantization state scales the codes back: ``quant_state``
(absmax per 64-weight block, the code book, the nested state of double quantization) or the int8 row scales
``SCB``. lzero shards such a parameter as frozen unit content, and what differs from other frozen content is
decided in one place, the unit (flat_unit.py), with the pieces it needs here:
- A packed parameter's unit holds one storage dtype and nothing else (``ParamSpec.storage``), and is never cast:
  no compute dtype and no master apply to it, and precision policies skip it (a bfloat16 view of 4-bit codes
  cast to fp16 would be garbage). Coalesced all-gathers move every unit as bytes (``fill_from_gathered``), so
  no collective ever reads a code as a number (bitsandbytes#1945: FSDP2 rewrote codes that look like NaNs).
- The quantization state is replicated: every rank keeps it whole. It is small beside the codes (4-bit: one fp32
  absmax per 64 weights, 1/16 byte per weight against the codes' 1/2; with double quantization one byte per 64
  weights, 1/64; 8-bit: one fp32 per row), the forward needs it whole at once, and gathering it per block would
  add a collective per block for a few percent of the bytes.
- A gather binds the state back to the gathered codes (``Binding.attach``), from a snapshot taken when the unit
  took the parameter. bitsandbytes' forward may rewrite both: its CPU kernels repack a 4-bit weight in eval mode
  without gradients (``weight.data`` replaced, ``quant_state`` rewritten in place for the new layout), and its
  8-bit layer keeps the codes it computes with on the module (``state.CB``). Under zero3 the repacked data is
  dropped at the release while the rewritten state stayed, so the next gather paired the canonical codes with
  the repacked layout's state and trained on wrong weights from the second step on. Each gather now hands the
  forward a fresh copy of the canonical state, and what a forward makes of it lives until the release.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import nn

from lzero.engine.parameters import own_class
from lzero.errors import ZeroEngineError

FOUR_BIT = "bitsandbytes 4-bit"
EIGHT_BIT = "bitsandbytes 8-bit"


def method(p: torch.Tensor) -> Optional[str]:
    """The quantization a parameter carries (by its class, so bitsandbytes is never imported here), or None."""
    for cls in own_class(p).__mro__:
        if cls.__module__.startswith("bitsandbytes"):
            if cls.__name__ == "Params4bit":
                return FOUR_BIT
            if cls.__name__ == "Int8Params":
                return EIGHT_BIT
    return None


def is_packed(p: torch.Tensor) -> bool:
    """Content ZeRO must move as raw bytes: a quantized weight, or any frozen parameter that holds no floats."""
    return method(p) is not None or not (p.is_floating_point() or p.is_complex())


def check_frozen(name: str, p: torch.Tensor) -> None:
    """A packed parameter cannot train: its gradient would be a gradient of codes."""
    if p.requires_grad and is_packed(p):
        what = method(p) or f"{p.dtype} (not floating point)"
        raise ZeroEngineError(
            f"Parameter `{name}` is a {what} weight with requires_grad=True. Its elements are packed codes: a"
            " gradient of them means nothing, and ZeRO cannot average or step them. HINT: freeze the quantized"
            " base (`p.requires_grad_(False)`; peft's `get_peft_model` does) and train adapters beside it (LoRA).")


def refuse_method(method: Any) -> None:
    """Only bitsandbytes' codes are known here: another quantization method is refused by name."""
    method = getattr(method, "value", method)
    if str(method) != "bitsandbytes":
        raise ZeroEngineError(
            f"The model is quantized with {method}: lzero shards bitsandbytes 4-bit and 8-bit bases only, whose codes"
            " and quantization state it knows how to move and bind (GPTQ, AWQ and other methods keep their codes in"
            " buffers and kernels of their own). HINT: load the unquantized weights with"
            " `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` (QLoRA), or the bf16/fp32 model.")


def check_model(module: nn.Module) -> None:
    """A model quantized by a method other than bitsandbytes (transformers' ``hf_quantizer``) is refused."""
    for m in module.modules():
        quantizer = getattr(m, "hf_quantizer", None)
        config = getattr(quantizer, "quantization_config", None)
        if config is not None:
            refuse_method(getattr(config, "quant_method", type(config).__name__))


def check_still_frozen(named: Sequence[tuple[str, nn.Parameter]]) -> None:
    """Packed parameters unfrozen after setup (``requires_grad_(True)`` on the base) are refused at the next forward."""
    with torch._C.DisableTorchFunctionSubclass():  # released parameters: a metadata read, without the guard
        unfrozen = [name for name, p in named if p.requires_grad]
    if unfrozen:
        raise ZeroEngineError(
            f"The quantized weight `{unfrozen[0]}` was set to requires_grad=True after setup"
            f"{f' (and {len(unfrozen) - 1} more)' if len(unfrozen) > 1 else ''}. Its elements are packed codes: a"
            " gradient of them means nothing, and ZeRO cannot average or step them. HINT: keep the quantized base"
            " frozen; to train more, add adapters to more modules (LoRA `target_modules`), or load the base"
            " unquantized.")


def owners(module: nn.Module) -> dict[int, nn.Module]:
    """id(parameter) -> the module that holds it directly, for the packed parameters of ``module``."""
    return {id(p): m for m in module.modules() for p in m._parameters.values() if p is not None and is_packed(p)}


class Binding:
    """What a packed parameter's module needs beside the gathered codes, snapshot once and bound at every gather.
    See [Note: packed parameters]."""

    def __init__(self, p: nn.Parameter, owner: Optional[nn.Module]) -> None:
        self.method = method(p)
        self.owner = owner
        self.quant_state = None  # 4-bit: the canonical QuantState
        self.scales: Optional[torch.Tensor] = None  # 8-bit: the canonical row scales (SCB)
        self.weights = p.numel()  # the weights the codes encode (4-bit: from the state's shape, below)
        if self.method == FOUR_BIT:
            state = p.quant_state if getattr(p, "quant_state", None) is not None else getattr(owner, "quant_state", None)
            if state is None:
                raise ZeroEngineError(
                    f"A 4-bit weight of shape {tuple(p.shape)} has no quantization state yet: it was never quantized."
                    " HINT: quantize the base before training (`from_pretrained(..., quantization_config=...)`, or"
                    " `model.to(device)` on bitsandbytes layers), then hand the model to the Trainer.")
            if getattr(state, "packing_format_for_cpu", False):
                raise ZeroEngineError(
                    "A 4-bit weight is in bitsandbytes' CPU inference layout (repacked by a forward in eval mode"
                    " without gradients) before setup. HINT: let lzero take the model before running it, or call"
                    " `model.state_dict()` once first, which restores bitsandbytes' canonical layout.")
            self.quant_state = _copy_state(state)
            self.weights = math.prod(state.shape)
        elif self.method == EIGHT_BIT:
            lt_state = getattr(owner, "state", None)
            scales = getattr(p, "SCB", None)
            if scales is None and lt_state is not None:
                scales = lt_state.SCB
            if scales is None:
                raise ZeroEngineError(
                    f"An 8-bit weight of shape {tuple(p.shape)} has no row scales (SCB): it was never quantized."
                    " HINT: quantize the base before training (`from_pretrained(..., quantization_config=...)`).")
            self.scales = scales
            p.CB = p.SCB = None  # the module's own references to the whole codes: the unit holds them now
            if lt_state is not None:
                lt_state.CB = None

    def attach(self, p: nn.Parameter) -> None:
        """``p.data`` is the gathered codes: give the forward its state."""
        if self.method == FOUR_BIT:
            p.quant_state = _copy_state(self.quant_state)
            if self.owner is not None and hasattr(self.owner, "quant_state"):
                self.owner.quant_state = p.quant_state
        elif self.method == EIGHT_BIT and self.owner is not None:
            self.owner.state.CB, self.owner.state.SCB = p.data, self.scales

    def release(self, p: nn.Parameter) -> None:
        """The codes are released: what the forward made of the state goes with them (a state dict taken now reads
        the canonical state: bitsandbytes would otherwise undo its repacking on the released placeholder)."""
        if self.method == FOUR_BIT:
            self.attach(p)
        elif self.method == EIGHT_BIT and self.owner is not None:
            self.owner.state.CB = None

    @property
    def kind(self) -> str:
        """The storage, as the estimator names it (lzero/memory/estimate.py, ``QUANTIZED_BYTES``)."""
        if self.method == EIGHT_BIT:
            return "int8"
        return "4bit-dq" if getattr(self.quant_state, "nested", False) else "4bit"

    def tensors(self) -> list[torch.Tensor]:
        """The replicated state every rank keeps (absmax, code book, nested state; 8-bit: the row scales)."""
        if self.scales is not None:
            return [self.scales]
        return _state_tensors(self.quant_state) if self.quant_state is not None else []

    @property
    def nbytes(self) -> int:
        """Bytes of the replicated state every rank keeps."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


class Whole(NamedTuple):
    """A packed parameter no unit holds (stages 1-2 leave a QLoRA base whole in its module), as memory counts it."""

    kind: Optional[str]  # the storage as the estimator names it (``QUANTIZED_BYTES``); None: not a quantized weight
    weights: int  # the weights its codes encode
    state: list[torch.Tensor]  # its quantization state (absmax, code book, nested state; 8-bit: the row scales)


def left_whole(p: nn.Parameter, owner: Optional[nn.Module]) -> Whole:
    """What a packed parameter left whole in ``owner`` holds beside its codes; reads only (unlike :class:`Binding`)."""
    if method(p) == FOUR_BIT:
        state = p.quant_state if getattr(p, "quant_state", None) is not None else getattr(owner, "quant_state", None)
        if state is None:
            return Whole("4bit", 2 * p.numel() * p.element_size(), [])
        return Whole("4bit-dq" if getattr(state, "nested", False) else "4bit", math.prod(state.shape),
                     _state_tensors(state))
    if method(p) == EIGHT_BIT:
        scales = getattr(p, "SCB", None)
        if scales is None:
            scales = getattr(getattr(owner, "state", None), "SCB", None)
        return Whole("int8", p.numel(), [scales] if isinstance(scales, torch.Tensor) else [])
    return Whole(None, p.numel(), [])


def _copy_state(state: Any) -> Any:
    """A QuantState whose attributes can be rewritten without touching ``state`` (tensors shared: read only)."""
    out = copy.copy(state)
    if getattr(state, "state2", None) is not None:
        out.state2 = copy.copy(state.state2)
    return out


def _state_tensors(state: Any) -> list[torch.Tensor]:
    found = [value for value in (getattr(state, "absmax", None), getattr(state, "code", None),
                                 getattr(state, "offset", None)) if isinstance(value, torch.Tensor)]
    if getattr(state, "state2", None) is not None:
        found += _state_tensors(state.state2)
    return found
