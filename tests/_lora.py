"""A low-rank adapter for the initialization tests (test_meta_init.py, scripts/hf_runs.py)."""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRA(nn.Module):
    """``base(x) + x A^T B^T`` with its own ``reset_parameters``: kaiming-uniform A, zero B."""

    def __init__(self, base: nn.Module, n_in: int, n_out: int, rank: int = 16) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, n_in))  # (r, in)
        self.lora_b = nn.Parameter(torch.empty(n_out, rank))  # (out, r)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()
