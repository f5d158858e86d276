"""Tiny Hugging Face models saved with ``save_pretrained`` in several safetensors shards (no network), for the
pretrained-loading tests: GPT-2 (tied head), Llama with untied and tied embeddings, T5 (encoder-decoder)."""

from __future__ import annotations

from pathlib import Path

import torch

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64)


def configs() -> dict[str, object]:
    from transformers import GPT2Config, LlamaConfig, T5Config

    return {
        "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0, **NO_DROPOUT),
        "llama": LlamaConfig(**LLAMA, tie_word_embeddings=False),
        "llama_tied": LlamaConfig(**LLAMA, tie_word_embeddings=True),
        "t5": T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=128,
                       dropout_rate=0.0, decoder_start_token_id=0),
    }


def save_models(root: Path, names: list[str] | None = None, shard_size: str = "20KB") -> dict[str, Path]:
    """Each model built with seed 0 and saved in 3+ files; name -> folder."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    out = {}
    for name, config in configs().items():
        if names is not None and name not in names:
            continue
        torch.manual_seed(0)
        cls = AutoModelForSeq2SeqLM if name == "t5" else AutoModelForCausalLM
        model = cls.from_config(config)
        folder = root / name
        model.save_pretrained(folder, max_shard_size=shard_size)
        shards = list(folder.glob("model-*.safetensors"))
        assert len(shards) >= 3, (name, shards)
        out[name] = folder
    return out


QUANTIZABLE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
"""Shapes bitsandbytes' CPU kernels take (its 4-bit inference layout needs output sizes divisible by 32)."""


def save_quantizable(root: Path, names: tuple[str, ...] = ("llama", "qwen2")) -> dict[str, Path]:
    """A tiny Llama and Qwen2 (seed 0) saved in bfloat16 in 3+ safetensors files, the QLoRA bases; name -> folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(classes[name](**QUANTIZABLE)).to(torch.bfloat16)
        folder = root / name
        model.save_pretrained(folder, max_shard_size="40KB")
        assert len(list(folder.glob("model-*.safetensors"))) >= 3, folder
        out[name] = folder
    return out
