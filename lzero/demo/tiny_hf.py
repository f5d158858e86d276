"""Write a small randomly initialized Llama with ``save_pretrained`` (3 safetensors files), to try
``configs/finetune_hf.yaml`` without a download:

    python -m lzero.demo.tiny_hf runs/tiny-llama
    lzero fit --config configs/finetune_hf.yaml --model.path runs/tiny-llama
"""

from __future__ import annotations

import sys


def main(out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # every size a multiple of 64: bitsandbytes' CPU 4-bit kernels need it (configs/qlora_hf.yaml)
    config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="1MB")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-llama")
