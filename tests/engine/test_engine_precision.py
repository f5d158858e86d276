"""bf16 modes of the engine against DDP at world size 2, 20 AdamW steps each, stages 1-3
(tests/_engine_cases.py ``bf16_against_ddp``; the Trainer-level runs are in test_trainer_equivalence.py)."""

from __future__ import annotations

import pytest

from _dist import run_ranks
import _engine_cases as cases


@pytest.fixture(scope="module")
def bf16() -> dict:
    return run_ranks(cases.bf16_against_ddp, 2, timeout=300)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_precision_modes_against_ddp(bf16: dict, stage: int) -> None:
    for mode in ("mixed", "kept", "autocast", "true"):
        print(f"stage {stage} {mode}: {bf16[(stage, mode)]}")
    mixed, kept, autocast, true = (bf16[(stage, m)] for m in ("mixed", "kept", "autocast", "true"))
    assert mixed["masters"] == ["torch.float32"] and mixed["params"] == ["torch.bfloat16"]
    # bf16 working weights vs DDP's fp32 weights under autocast: bf16 forward rounding (loss ~13)
    assert mixed["worst_loss_diff"] < 3e-2 and mixed["max_rel"] < 1e-2
    # Embedding and LayerNorm kept fp32: the residual stream and the norms compute as under autocast
    assert kept["params"] == ["torch.bfloat16", "torch.float32"] and kept["worst_loss_diff"] < 1e-2
    assert autocast["worst_loss_diff"] == 0.0 and autocast["max_rel"] == 0.0  # Lightning's semantics
    assert true["masters"] == true["params"] == ["torch.bfloat16"]
    assert true["worst_loss_diff"] == 0.0 and true["max_rel"] == 0.0
