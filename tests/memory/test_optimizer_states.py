"""The state formulas of [Note: optimizer state by rank] (lzero/memory/optimizer_states.py) against what torch's
optimizers hold after a step, for matrices, stacked matrices and vectors."""

from __future__ import annotations

import pytest
import torch

from lzero.memory.optimizer_states import state_bytes_of

CASES = [
    ("Muon", {}, [(8, 4), (3, 16)]),
    ("Adafactor", {}, [(8, 4), (2, 3, 5), (7,)]),
    ("AdamW", {}, [(8, 4), (7,)]),
    ("Adam", {"amsgrad": True}, [(8, 4)]),
    ("SGD", {"momentum": 0.9}, [(8, 4)]),
    ("SGD", {}, [(8, 4)]),
    ("RMSprop", {"momentum": 0.9, "centered": True}, [(8, 4)]),
    ("Adagrad", {}, [(8, 4)]),
]


@pytest.mark.parametrize("name,kwargs,shapes", CASES)
def test_formula_is_what_the_optimizer_holds(name: str, kwargs: dict, shapes: list) -> None:
    formula = state_bytes_of(name, {**getattr(torch.optim, name)([torch.zeros(2, 2, requires_grad=True)]).defaults,
                                    **kwargs})
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape))
        p.grad = torch.randn(shape)
        opt = getattr(torch.optim, name)([p], **kwargs)
        opt.step()
        held = sum(v.numel() * v.element_size() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
        assert formula(shape) == held, (name, shape, {k: tuple(v.shape) for k, v in opt.state[p].items()})


def test_unknown_optimizer_has_no_formula() -> None:
    assert state_bytes_of("Lion") is None
