"""Stage 3 from the meta device initializes a model as building it eagerly does.

See [Note: meta-device initialization] in lzero/engine/materialize.py. Reference: the same model built eagerly
and initialized the Hugging Face way (each module's constructor, then an ``_init_weights``-style function
applied children before parents), with LoRA adapters attached afterwards. Compared per parameter:
the standard deviation (random values) or the values themselves (constants).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch import nn

from _dist import run_ranks
from _lora import LoRA

LAYERS, WIDTH, VOCAB, RANK = 4, 64, 256, 16


def lora(base: nn.Linear) -> LoRA:
    return LoRA(base, base.in_features, base.out_features, RANK)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        weights = torch.softmax(x @ x.transpose(1, 2) / math.sqrt(WIDTH), dim=-1)  # (B, T, T)
        return self.c_proj(weights @ self.c_attn(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(torch.tanh(self.c_fc(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    """GPT-2's layout: tied embedding/head, residual projections named ``c_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def hf_like_init(module: nn.Module, n_layer: int = LAYERS) -> None:
    """GPT-2's ``_init_weights``: 0.02 normal everywhere, ``c_proj`` scaled by depth when visiting its
    parent (by name), LayerNorm ones/zeros; modules it does not know are left alone."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    if isinstance(module, (Attention, MLP)):
        nn.init.normal_(module.c_proj.weight, std=0.02 / math.sqrt(2 * n_layer))


def with_lora(model: TinyLM) -> TinyLM:
    for layer in model.layers:
        layer.attn.c_attn = lora(layer.attn.c_attn)
        layer.mlp.c_fc = lora(layer.mlp.c_fc)
    return model


def eager_model() -> TinyLM:
    model = TinyLM()
    model.apply(hf_like_init)  # as Hugging Face's post_init
    return with_lora(model)


def summary(model: nn.Module) -> dict[str, tuple[float, float, int, list]]:
    """name -> (std, mean, numel, the values if they are all equal else [])."""
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        out[n] = (t.std().item(), t.mean().item(), t.numel(), t.reshape(-1).tolist() if bool((t == t.reshape(-1)[0]).all()) else [])
    return out


def meta_init_case(rank: int, world_size: int) -> dict:
    from lzero import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    eager = summary(eager_model())
    with torch.device("meta"):
        model = with_lora(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3), init_fn=partial(hf_like_init, n_layer=LAYERS))
    blocks = sorted({b.name for b in engine.gatherer.blocks.values()})
    engine.unshard()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = flat.clone()
    torch.distributed.broadcast(rank0, src=0)
    result = {"eager": eager, "meta": summary(model), "same_as_rank0": torch.equal(flat, rank0), "blocks": blocks,
              "tied": model.head.weight is model.wte.weight}
    engine.remove()
    return result


def compare(eager: dict, meta: dict) -> tuple[str, float]:
    """Assert every parameter matches the eager reference; return the worst std ratio (meta / eager)."""
    assert eager.keys() == meta.keys()
    worst = ("", 1.0)
    for name, (std, mean, numel, constant) in eager.items():
        m_std, m_mean, _, m_constant = meta[name]
        if constant:  # zero bias, LayerNorm weight, LoRA B: the same values
            assert m_constant == constant, (name, m_mean, mean)
            continue
        ratio = m_std / std
        if abs(ratio - 1) > abs(worst[1] - 1):
            worst = (name, ratio)
        assert abs(ratio - 1) < 0.10, (name, m_std, std)
        assert abs(m_mean) < 4 * std / math.sqrt(numel), (name, m_mean)
    return worst


@pytest.fixture(scope="module")
def meta_init() -> list[dict]:
    return run_ranks(meta_init_case, 2)


def test_meta_init_matches_eager_hf_style_init(meta_init: list[dict]) -> None:
    """Depth-scaled ``c_proj`` (written by the parent's init), LoRA adapters by their own ``reset_parameters``
    although an ``init_fn`` is given, and every other parameter as built eagerly."""
    for rank, res in enumerate(meta_init):
        assert res["blocks"] == ["", "layers.0", "layers.1", "layers.2", "layers.3"]
        assert res["tied"] and res["same_as_rank0"], rank
        name, ratio = compare(res["eager"], res["meta"])
        meta = res["meta"]
        print(f"rank {rank}: worst std ratio {ratio:.3f} ({name}); layers.0.attn.c_proj.weight std"
              f" {meta['layers.0.attn.c_proj.weight'][0]:.4f} (eager {res['eager']['layers.0.attn.c_proj.weight'][0]:.4f});"
              f" lora_a std {meta['layers.0.attn.c_attn.lora_a'][0]:.4f}")
        expected = 0.02 / math.sqrt(2 * LAYERS)
        for layer in range(LAYERS):
            for proj in ("attn", "mlp"):
                assert abs(meta[f"layers.{layer}.{proj}.c_proj.weight"][0] / expected - 1) < 0.1
            assert abs(meta[f"layers.{layer}.attn.c_attn.lora_a"][0] * math.sqrt(3 * WIDTH) - 1) < 0.1  # kaiming
            assert set(meta[f"layers.{layer}.mlp.c_fc.lora_b"][3]) == {0.0}
