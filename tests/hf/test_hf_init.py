"""A Hugging Face GPT-2 built in ``configure_model`` under zero3 initializes as it does built eagerly.

No ``init_fn``: lzero finds the ``PreTrainedModel`` and replays its ``_init_weights`` (see [Note:
meta-device initialization] in lzero/engine/materialize.py). Reference: DDP with the model built eagerly.
tests/engine/test_meta_init.py covers the same logic without transformers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from _launch import run_script

pytest.importorskip("transformers")


def test_gpt2_with_lora_built_in_configure_model_matches_eager(tmp_path: Path) -> None:
    run_script("hf_runs.py", str(tmp_path), timeout=300, ranks=2)
    eager = torch.load(tmp_path / "ddp_eager.pt", weights_only=True)
    meta = torch.load(tmp_path / "zero3_meta.pt", weights_only=True)
    assert eager["stats"].keys() == meta["stats"].keys()
    worst = ("", 1.0)
    for name, (std, mean, constant) in eager["stats"].items():
        m_std, m_mean, m_constant = meta["stats"][name]
        if not math.isnan(constant):  # zero biases, LayerNorm weights, LoRA B
            assert m_constant == constant, (name, m_std, m_mean, constant)
            continue
        ratio = m_std / std
        worst = max(worst, (name, ratio), key=lambda w: abs(w[1] - 1))
        assert abs(ratio - 1) < 0.10, (name, m_std, std)
    c_proj = meta["stats"]["transformer.h.0.attn.c_proj.weight"][0]
    lora_a = meta["stats"]["transformer.h.0.attn.c_attn.lora_a"][0]
    first_eager, first_meta = eager["losses"][0], meta["losses"][0]
    print(f"worst std ratio {worst[1]:.3f} ({worst[0]}); h.0.attn.c_proj std {c_proj:.4f}"
          f" (eager {eager['stats']['transformer.h.0.attn.c_proj.weight'][0]:.4f}); lora_a std {lora_a:.4f};"
          f" first loss zero3 {first_meta:.4f} vs DDP {first_eager:.4f}")
    assert abs(c_proj / (0.02 / math.sqrt(2 * 4)) - 1) < 0.1  # GPT-2's depth-scaled residual projections
    assert abs(lora_a * math.sqrt(3 * 64) - 1) < 0.1  # the adapter's own kaiming init
    assert abs(first_meta / first_eager - 1) < 0.01
