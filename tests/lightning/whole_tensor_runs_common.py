"""The models and optimizers of the matrix-optimizer runs (whole_tensor_runs.py, whole_tensor_trainer_runs.py): the
demo GPT or a Hugging Face Llama from a tiny config, built with seed 0; Muon on the hidden matrices with AdamW on the
rest (embeddings, head, vectors), or Adafactor alone."""

import argparse

import torch

VOCAB = 64


def run_arguments() -> argparse.ArgumentParser:
    """The arguments both run scripts take: STRATEGY MODEL OPTIM OUT, --devices, --save-at, --resume, --clip."""
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("model", choices=["gpt", "llama"])
    parser.add_argument("optim", choices=["muon", "adafactor"])
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--clip", type=float, default=0.5)
    return parser


def build(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "gpt":
        from lzero.demo.model import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))
    return llama()


def optimizers(model: torch.nn.Module, optim: str, unfused: bool = False) -> list[torch.optim.Optimizer]:
    """``unfused``: AdamW(fused=False), so an offloaded host step runs DDP's kernel."""
    if optim == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.dim() == 2 and not any(k in n for k in ("emb", "wte", "wpe", "lm_head"))]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1, fused=False if unfused else None)]


def llama(**overrides) -> torch.nn.Module:
    """The Llama of these runs, by keyword arguments (what ``lzero estimate --model`` calls, on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))
