"""``lzero export-hf --merge``: a peft LoRA model's checkpoint read as the plain model ``merge_and_unload()`` gives.

[Note: a merged export]
A peft model's checkpoint holds, under ``base_model.model.``, the base's tensors (a wrapped layer's as
``X.base_layer.weight``) and beside them the adapters (``X.lora_A.<adapter>.weight``, ``X.lora_B.<adapter>.weight``).
:class:`MergedSource` reads it as the state dict of the base with the adapters folded in, key by key, so that the
export's streaming writer ([Note: exporting to a Hugging Face folder] in export.py) writes it as it writes any model:
a tensor is computed when its file is written, from the base weight and its two adapter matrices alone.
- The arithmetic is peft's (``LoraLayer.merge`` and ``get_delta_weight``, peft 0.21): ``delta = (B @ A) * scaling``,
  transposed for ``fan_in_fan_out`` layers (GPT-2's ``Conv1D``) and always for embeddings; bf16/fp16 adapters are
  multiplied in fp32 and the product cast back, as peft's plain layers do on the CPU (its bnb layers multiply them
  in their own dtype, and so does the merge of a quantized weight); then ``weight += delta`` in the dtype of the
  export. ``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), per module through
  ``rank_pattern``/``alpha_pattern`` as peft matches them. A module trained whole (``modules_to_save``) is written
  in place of the original, as ``merge_and_unload()`` unwraps it. The adapters stay in the dtype they were saved in
  (the fp32 masters, or bf16 under bf16-true), as peft holds them: the export equals ``merge_and_unload()`` of the
  same adapters on the base loaded in the export's dtype.
- A quantized base (bitsandbytes: 4-bit codes with ``weight.absmax``, ``weight.quant_map``, ``weight.nested_*`` and
  ``weight.quant_state.bitsandbytes__nf4|fp4`` beside them; 8-bit int8 codes with ``SCB``) is dequantized as peft
  dequantizes a bnb layer before merging (``dequantize_4bit`` with the saved quantization state,
  ``int8_vectorwise_dequant``), cast to the export's dtype (bf16 by default) and merged there, as peft's
  ``Linear4bit.merge`` / ``Linear8bitLt.merge`` compute the merged weight before quantizing it again; the state keys
  are not written, and config.json loses its ``quantization_config``: the folder holds a plain model.
- The adapter's hyperparameters come from its configuration (peft's ``adapter_config.json`` or the live model's
  ``peft_config``), never guessed; a LoRA variant whose merge differs (DoRA, ``lora_bias``, ...) or another kind of
  adapter is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from lzero.checkpoint import CheckpointError

PEFT_PREFIX = "base_model.model."
"""Where a ``PeftModel`` holds the base model it wraps."""

_LORA = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.(?P<adapter>[^.]+)"
                   r"(\.weight)?$")
_FOUR_BIT_STATE = re.compile(r"^(?P<weight>.+\.weight)\.(absmax|quant_map|nested_absmax|nested_quant_map"
                             r"|quant_state\.bitsandbytes__(nf4|fp4))$")
_EIGHT_BIT_STATE = re.compile(r"^(?P<module>.+)\.(SCB|weight_format)$")
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
"""A module trained whole (``modules_to_save``): its copy replaces the original (``X.original_module.*``)."""
_REFUSED_KEYS = {".lora_magnitude_vector.": "DoRA (`use_dora=True`)", ".trainable_tokens_": "`trainable_token_indices`"}
_REFUSED_OPTIONS = ("use_dora", "lora_bias", "layer_replication", "target_parameters", "trainable_token_indices",
                    "use_qalora", "alora_invocation_tokens", "velora_config", "monteclora_config", "modules_to_tie",
                    "target_modules_to_tie")
"""LoraConfig fields whose merge is not ``weight += scaling * B @ A`` (or that tie trained copies together)."""


@dataclass(frozen=True)
class LoraSettings:
    """What peft's merge reads of a LoRA adapter's configuration (``LoraConfig``)."""

    r: int
    """The rank, unless ``rank_pattern`` names the module."""
    lora_alpha: float
    """The scale's numerator, unless ``alpha_pattern`` names the module."""
    use_rslora: bool = False
    """``scaling = lora_alpha / sqrt(r)`` instead of ``lora_alpha / r``."""
    fan_in_fan_out: bool = False
    """The base layers store their weight as (in, out) (GPT-2's ``Conv1D``): the delta is transposed."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Module name pattern -> rank, matched as peft matches it (``(.*\\.)?PATTERN$``, the first that matches)."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Module name pattern -> lora_alpha, matched the same way."""

    @classmethod
    def of(cls, config: Any, where: str) -> "LoraSettings":
        """From ``adapter_config.json``'s contents or a peft ``LoraConfig``; ``where`` names it in errors. A kind of
        adapter or a LoRA option whose merge is not ``weight += scaling * B @ A`` is refused by name."""
        values = dict(config) if isinstance(config, dict) else dict(vars(config))
        kind = str(getattr(values.get("peft_type"), "value", values.get("peft_type")))
        if kind != "LORA":
            raise CheckpointError(f"{where} configures a {kind} adapter; --merge folds LoRA adapters only. HINT: export"
                                  " the adapters with --adapters-only and merge them with peft's `merge_and_unload()`.")
        for option in _REFUSED_OPTIONS:
            if values.get(option):
                raise CheckpointError(f"{where} sets `{option}={values[option]!r}`, whose merge is not"
                                      " `weight += scaling * B @ A`: not built. HINT: export the adapters with"
                                      " --adapters-only and merge them with peft's `merge_and_unload()`.")
        return cls(int(values["r"]), float(values["lora_alpha"]), bool(values.get("use_rslora")),
                   bool(values.get("fan_in_fan_out")), dict(values.get("rank_pattern") or {}),
                   dict(values.get("alpha_pattern") or {}))

    @classmethod
    def read(cls, folder: Any) -> "LoraSettings":
        path = Path(folder) / "adapter_config.json"
        try:
            return cls.of(json.loads(path.read_text()), f"`{path}`")
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"`{path}` is not a peft adapter configuration ({err!r}). HINT: pass the folder"
                                  " peft's `save_pretrained` (or `ExportHF(adapters_only=True)`) wrote.") from None

    def scaling(self, module: str) -> tuple[int, float]:
        """(rank, scaling) of the module named ``module`` in the base model (``model.layers.0.self_attn.q_proj``)."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return r, alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _folded(key: str, states: dict[str, "Quantized"]) -> bool:
    """Whether the merged model has no tensor of its own for ``key``: an adapter's, a quantization state's, or that
    of the original of a module trained whole."""
    eight = _EIGHT_BIT_STATE.match(key)
    return bool(".original_module." in key or _LORA.match(key) or _FOUR_BIT_STATE.match(key)
                or (eight and f"{eight['module']}.weight" in states))


def _pattern_key(patterns: dict[str, Any], module: str) -> Optional[str]:
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", module)), None)


class Adapter(NamedTuple):
    """One base weight's LoRA pair: ``delta = transpose(B @ A) * scaling``."""

    a: str  # the checkpoint's key of A: (r, in)
    b: str  # of B: (out, r)
    scaling: float
    transposed: bool  # fan_in_fan_out, or an embedding's pair (A: (r, num_embeddings))
    upcast: bool  # half-precision adapters multiplied in fp32 (peft's plain layers on the CPU; not its bnb layers)


class Quantized(NamedTuple):
    """A base weight stored as bitsandbytes codes, and the checkpoint's keys of its quantization state."""

    bits: int  # 4 or 8
    state: dict[str, str]  # name as bitsandbytes saves it (absmax, quant_map, ..., SCB) -> the checkpoint's key


class _Plan(NamedTuple):
    key: str  # the checkpoint's key of the base tensor
    quantized: Optional[Quantized]
    adapter: Optional[Adapter]


class MergedSource:
    """The state dict of the merged model, key by key (the keys the base model has: no ``base_model.model.``, no
    ``.base_layer``, no adapters, no quantization state), read from a checkpoint's state dict (``read``,
    ``dtype_shape``) one tensor at a time; see [Note: a merged export]. ``keys``: the checkpoint's keys to merge,
    each beginning with ``prefix``; ``settings``: the adapter's configuration (needed when the keys hold adapters);
    ``dtype``: the merge's and the output's dtype (None: each base tensor's own)."""

    def __init__(self, read: Callable[[str], torch.Tensor], dtype_shape: Callable[[str], tuple[torch.dtype, tuple]],
                 keys: list[str], prefix: str, settings: Optional[LoraSettings],
                 dtype: Optional[torch.dtype]) -> None:
        self._read, self._dtype_shape, self.dtype = read, dtype_shape, dtype
        peft = all(k[len(prefix):].startswith(PEFT_PREFIX) for k in keys)
        strip = len(prefix) + (len(PEFT_PREFIX) if peft else 0)
        relative = {k[strip:]: k for k in keys}
        for key in relative:
            for marker, what in _REFUSED_KEYS.items():
                if marker in f".{key}":
                    raise CheckpointError(f"`{relative[key]}` belongs to {what}, which --merge does not fold. HINT:"
                                          " export with --adapters-only and merge with peft's `merge_and_unload()`.")
        pairs, states = self._adapters(relative), self._quantization_states(relative)
        if pairs and settings is None:
            raise CheckpointError("The checkpoint holds LoRA adapters but no adapter configuration was given (its r,"
                                  " lora_alpha, fan_in_fan_out). HINT: pass --adapter-config with the folder holding"
                                  " the adapter's adapter_config.json (peft's `save_pretrained` or"
                                  " `ExportHF(adapters_only=True)` writes it).")
        self.merged = len(pairs)
        self.quantized = len(states)
        self._plans: dict[str, _Plan] = {}
        saved = {key for key in relative if _SAVED.match(key)}
        for key, full in relative.items():
            if _folded(key, states):
                continue
            module = key.rpartition(".")[0].removesuffix(".base_layer")
            adapter = None
            if key.endswith(".weight") and module in pairs:
                adapter = self._adapter(module, pairs.pop(module), settings, quantized=key in states)
            out = f"{_SAVED.match(key)['module']}.{_SAVED.match(key)['rest']}" if key in saved else key
            self._plans[out.replace(".base_layer.", ".")] = _Plan(full, states.get(key), adapter)
        if pairs:
            module = next(iter(pairs))
            raise CheckpointError(f"The adapters of `{module}` have no base weight `{module}.base_layer.weight` in the"
                                  " checkpoint. HINT: export with --adapters-only; the checkpoint is not a peft LoRA"
                                  " model's.")
        self.keys = list(self._plans)

    @staticmethod
    def _adapters(relative: dict[str, str]) -> dict[str, dict[str, str]]:
        """Module -> {lora_A: key, lora_B: key} (or the embedding's pair); one adapter name only."""
        pairs: dict[str, dict[str, str]] = {}
        names = set()
        for key, full in relative.items():
            match = _LORA.match(key)
            if match:
                pairs.setdefault(match["module"], {})[match["kind"].removeprefix("lora_embedding_").removeprefix(
                    "lora_")] = full
                names.add(match["adapter"])
        if len(names) > 1:
            raise CheckpointError(f"The checkpoint holds several LoRA adapters ({sorted(names)}); --merge folds one."
                                  " HINT: export with --adapters-only and merge the ones you want with peft.")
        return pairs

    @staticmethod
    def _quantization_states(relative: dict[str, str]) -> dict[str, Quantized]:
        """The checkpoint's relative key of each quantized base weight -> how it is quantized."""
        states: dict[str, Quantized] = {}
        for key, full in relative.items():
            four = _FOUR_BIT_STATE.match(key)
            if four and four["weight"] in relative:
                states.setdefault(four["weight"], Quantized(4, {}))[1][key[len(four["weight"]) + 1:]] = full
            eight = _EIGHT_BIT_STATE.match(key)
            if eight and key.endswith(".SCB") and f"{eight['module']}.weight" in relative:
                states[f"{eight['module']}.weight"] = Quantized(8, {"SCB": full})
        return states

    def _adapter(self, module: str, pair: dict[str, str], settings: LoraSettings, quantized: bool) -> Adapter:
        if set(pair) != {"A", "B"}:
            raise CheckpointError(f"`{module}` holds {sorted(pair)} of a LoRA pair, not both A and B. HINT: the"
                                  " checkpoint is damaged or not a peft LoRA model's.")
        (_, a_shape), (_, b_shape) = self._dtype_shape(pair["A"]), self._dtype_shape(pair["B"])
        r, scaling = settings.scaling(module)
        if len(a_shape) != 2 or a_shape[0] != r or b_shape[-1] != r:
            raise CheckpointError(f"`{pair['A']}` has shape {list(a_shape)} and `{pair['B']}` {list(b_shape)}; the"
                                  f" adapter configuration gives `{module}` rank {r} (2-D pairs only: a convolution's"
                                  " LoRA is not merged). HINT: pass the adapter_config.json of the run that wrote"
                                  " this checkpoint.")
        embedding = ".lora_embedding_" in pair["A"]
        return Adapter(pair["A"], pair["B"], scaling, embedding or settings.fan_in_fan_out, upcast=not quantized)

    def first_keys(self) -> list[str]:
        return self.keys

    def dtype_shape(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        plan = self._plans[key]
        if plan.quantized is None:
            dtype, shape = self._dtype_shape(plan.key)
            return (self.dtype or dtype) if dtype.is_floating_point else dtype, shape
        quant = _quant_state(self._read, plan.quantized) if plan.quantized.bits == 4 else None
        shape = tuple(quant.shape) if quant is not None else self._dtype_shape(plan.key)[1]
        return self.dtype or (quant.dtype if quant is not None else torch.float32), shape

    @torch.no_grad()
    def read(self, key: str) -> torch.Tensor:
        """The merged tensor: the base weight (dequantized) in the export's dtype, its adapters' delta added."""
        plan = self._plans[key]
        base = self._read(plan.key)
        if plan.quantized is not None:
            base = _dequantize(self._read, base, plan.quantized)
        if not base.is_floating_point():
            return base
        weight = base.to(self.dtype or base.dtype)
        if plan.adapter is None:
            return weight
        delta = _delta(self._read(plan.adapter.a), self._read(plan.adapter.b), plan.adapter)
        if delta.shape != weight.shape:
            raise CheckpointError(f"The LoRA delta of `{plan.key}` has shape {list(delta.shape)}, the weight"
                                  f" {list(weight.shape)}. HINT: check `fan_in_fan_out` in the adapter"
                                  " configuration (true for GPT-2's Conv1D layers).")
        # peft's `base_layer.weight.data += delta_weight`: the sum in the wider dtype, rounded once to the weight's
        # (out of place, so that the checkpoint's own memory, a plain file's mmap, is never written)
        return torch.add(weight, delta).to(weight.dtype)


def _delta(a: torch.Tensor, b: torch.Tensor, adapter: Adapter) -> torch.Tensor:
    """peft's ``get_delta_weight``: its plain layers multiply half-precision adapters in fp32 on the CPU and cast the
    product back; its bnb layers multiply them in their own dtype."""
    dtype = a.dtype if ".lora_embedding_" in adapter.a else b.dtype  # as peft's Embedding and Linear read it
    low = adapter.upcast and dtype in (torch.float16, torch.bfloat16)
    if low:
        a, b = a.float(), b.float()
    delta = (b @ a).mul_(adapter.scaling)  # peft: transpose(B @ A) * scaling, the same products
    delta = delta.T if adapter.transposed else delta
    return delta.to(dtype) if low else delta


def _quant_state(read: Callable[[str], torch.Tensor], quantized: Quantized) -> Any:
    import bitsandbytes.functional as F

    state = {name: read(key) for name, key in quantized.state.items()}
    return F.QuantState.from_dict(state, device=torch.device("cpu"))


def _dequantize(read: Callable[[str], torch.Tensor], codes: torch.Tensor, quantized: Quantized) -> torch.Tensor:
    """The weights the codes stand for, as peft's ``dequantize_bnb_weight`` computes them before a merge."""
    import bitsandbytes.functional as F

    if quantized.bits == 8:
        return F.int8_vectorwise_dequant(codes, read(quantized.state["SCB"]))  # fp32
    return F.dequantize_4bit(codes, _quant_state(read, quantized))  # the state's dtype
