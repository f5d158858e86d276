"""DeepSpeed's own steps stored in tests/deepspeed_fixtures/ (computed on another machine), and how far a run
computed here may be from them: the measured bounds, the comparison, a plain-torch continuation of a fixture's step-3
state and the wrong mappings it is fed to show that the bounds tell them apart (tests/test_deepspeed_checkpoint.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

import torch

from lzero.checkpoint.reader import ShardedCheckpoint

FIXTURES = Path(__file__).parent / "deepspeed_fixtures"
KEY_BIAS = slice(15, 30)
"""The attention's key bias (``qkv.bias[15:30]``): softmax ignores it, so its true gradient is 0 and Adam turns the
rounding noise of its computed gradient into full-size steps; two runs that round differently move it differently."""


def expected(case: str, step: int) -> tuple[dict, dict]:
    return (torch.load(FIXTURES / case / f"expected_step{step}_fp32.pt", weights_only=True),
            torch.load(FIXTURES / case / f"expected_step{step}_moments.pt", weights_only=True))


def deepspeed_steps(case: str) -> list[dict]:
    return json.loads((FIXTURES / case / "expected.json").read_text())["steps_after_resume"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


ACROSS_CPUS = {"loss": 5e-6, "master": 3e-6, "key_bias": 1e-3, "exp_avg": 5e-6, "exp_avg_sq": 5e-6}
"""How far an fp32 continuation computed here may be from DeepSpeed's steps 4-6, which another machine computed (its
float kernels sum in another order): about 10x the largest difference measured here over three kernel paths, the
machine's own (AVX-512, an AMD EPYC) and ``ATEN_CPU_CAPABILITY=avx2`` and ``=default`` (no vectorization), every fp32
run of tests/checkpoint/deepspeed_resume_runs.py (2026-12-06; ``pytest -s`` prints each run's figures):

- ``loss``: a rank's loss, absolute: 4.8e-7 (one float32 ulp at 4.2; stage 3's losses were equal on every path);
- ``master``: a step-6 master, relative to DeepSpeed's tensor's norm, the key bias apart: 2.3e-7 (no vectorization;
  1.9e-7 AVX-512, 1.7e-7 avx2);
- ``key_bias``: the key bias (see KEY_BIAS), relative to the norm of the whole ``qkv.bias``: 1.3e-4 (avx2);
- ``exp_avg``, ``exp_avg_sq``: a step-6 moment, relative to DeepSpeed's tensor's norm: 4.7e-7 (AVX-512, stage 3),
  3.4e-7 (avx2).

A wrong mapping is orders of magnitude outside (test_a_wrong_mapping_is_far_outside_the_bound). Results that both
come from this machine (one layout against another, an imported checkpoint against its folder) stay bitwise."""


def deepspeed_off_by(case: str, losses: list[list[float]],
                     state: Optional[Callable[[str, str], torch.Tensor]] = None) -> dict[str, float]:
    """The largest differences (as ACROSS_CPUS measures them) of a continuation of ``case`` from DeepSpeed's steps
    4-6: ``losses[r]``, rank r's; ``state(name, key)``, a parameter's flat step-6 ``fp32``, ``exp_avg`` or
    ``exp_avg_sq`` (None: the losses only). A NaN counts as infinitely far (``max`` would pass over it)."""
    steps = deepspeed_steps(case)
    found: dict[str, list[float]] = {"loss": [abs(a - s["loss_per_rank"][rank]) for rank, ours in enumerate(losses)
                                              for a, s in zip(ours, steps, strict=True)]}
    for name, entry in expected(case, 6)[1]["params"].items() if state is not None else ():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            ours, theirs = state(name, key), entry[key].reshape(-1)
            if key == "fp32" and name.endswith("attn.qkv.bias"):
                found.setdefault("key_bias", []).append(
                    (ours[KEY_BIAS] - theirs[KEY_BIAS]).norm().item() / theirs.norm().item())
                ours, theirs = torch.cat([ours[:15], ours[30:]]), torch.cat([theirs[:15], theirs[30:]])
            found.setdefault("master" if key == "fp32" else key, []).append(relative(ours, theirs))
    return {quantity: max(math.inf if math.isnan(v) else v for v in values) for quantity, values in found.items()}


BF16_VS_DEEPSPEED = {"loss": 1e-3, "master": 3e-2, "exp_avg": 5e-2, "exp_avg_sq": 5e-2}
"""The same for bf16, where the arithmetic differs too (DeepSpeed runs its whole module in bf16, lzero's bf16-mixed
autocasts, normalizations in fp32; bf16 rounds 4.2 to steps of 0.016): about 3x the largest difference measured as
for ACROSS_CPUS: loss 3.5e-4, master 1.1e-2 (``blocks.1.ln_1.bias``, whose norm is 0.05), exp_avg 2.0e-2, exp_avg_sq
2.0e-2 (AVX-512 and no vectorization alike; avx2 at most 2.2e-4, 5.7e-3, 1.1e-2, 9.4e-3). The key bias is not bounded
(it moved by up to 0.34 of the whole bias's norm)."""


def assert_within(run: str, off: dict[str, float], bounds: dict[str, float] = ACROSS_CPUS) -> None:
    """Every quantity of ``bounds`` within its bound (``off`` printed whole: ``pytest -s`` shows the figures)."""
    print(f"{run} vs DeepSpeed: " + ", ".join(f"{k} {v:.1e}" for k, v in off.items()))
    for quantity, value in off.items():
        assert quantity not in bounds or value <= bounds[quantity], (run, quantity, value, bounds[quantity])


def saved_state(saved: ShardedCheckpoint, prefix: str) -> Callable[[str, str], torch.Tensor]:
    """A saved lzero checkpoint's flat step-6 tensors under DeepSpeed's names (``prefix``: what lzero's adds)."""
    def state(name: str, key: str) -> torch.Tensor:
        if key == "fp32":
            return saved.full_param(prefix + name).reshape(-1)
        return saved.read_range(f"optim/0/{prefix}{name}/{key}", 0, saved.manifest["params"][prefix + name]["numel"])
    return state


def continue_in_torch(case: str, state: dict[str, dict[str, torch.Tensor]]) -> tuple[list[list[float]], Callable]:
    """Steps 4-6 of the fixtures' run in plain torch at world size 1 from ``state[name]`` (flat step-3 ``fp32``,
    ``exp_avg``, ``exp_avg_sq``): the two ranks' batches averaged, clipped at 1.0, AdamW at DeepSpeed's lrs. Each
    rank's losses and the step-6 state as ``deepspeed_off_by`` reads it."""
    import torch.nn.functional as F

    from lzero.demo.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=3, n_embd=15, dropout=0.0, bias=True))
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name]["fp32"].view_as(p))
            optimizer.state[p] = {"step": torch.tensor(3.0), **{k: state[name][k].view_as(p).clone()
                                                                  for k in ("exp_avg", "exp_avg_sq")}}
    losses: list[list[float]] = [[], []]
    for step, entry in enumerate(deepspeed_steps(case), start=4):
        optimizer.param_groups[0]["lr"] = entry["lr"]
        for rank in (0, 1):
            t = torch.randint(0, 65, (2, 9), generator=torch.Generator().manual_seed(1000 * step + rank))
            loss = F.cross_entropy(model(t[:, :-1]).float().flatten(0, 1), t[:, 1:].flatten())
            (loss / 2).backward()
            losses[rank].append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return losses, lambda name, key: (params[name] if key == "fp32" else optimizer.state[params[name]][key]
                                      ).detach().reshape(-1)


def _shifted_slice(state: dict, order: list[str]) -> None:
    """``blocks.0.mlp.proj.weight`` (cut between DeepSpeed's ranks) read one element late: its masters and moments."""
    name = "blocks.0.mlp.proj.weight"
    start, numel = sum(state[n]["fp32"].numel() for n in order[:order.index(name)]), state[name]["fp32"].numel()
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        flat = torch.cat([state[n][key] for n in order])
        state[name][key] = flat[start + 1:start + 1 + numel].clone()


def _moments_swapped(state: dict, order: list[str]) -> None:
    """(Adam then takes the square root of negative values: NaN, which deepspeed_off_by counts as infinitely far.)"""
    entry = state["blocks.0.attn.qkv.weight"]
    entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg_sq"], entry["exp_avg"]


def _moment_of_another_parameter(state: dict, order: list[str]) -> None:
    state["blocks.0.mlp.proj.weight"]["exp_avg"] = state["blocks.1.mlp.proj.weight"]["exp_avg"].clone()


def _second_moment_of_another_parameter(state: dict, order: list[str]) -> None:
    state["blocks.0.attn.qkv.weight"]["exp_avg_sq"] = state["blocks.1.attn.qkv.weight"]["exp_avg_sq"].clone()


def _padding_missing(state: dict, order: list[str]) -> None:
    """Stage 3's padding (one element after rank 1's part of each odd-sized parameter) not skipped: rank 1's part of
    every parameter after the first odd-sized one read one element early, the padding (0) as its first value."""
    first_odd = next(i for i, n in enumerate(order) if state[n]["fp32"].numel() % 2)
    for name in order[first_odd + 1:]:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            flat, half = state[name][key], -(-state[name][key].numel() // 2)
            state[name][key] = torch.cat([flat[:half], flat.new_zeros(1), flat[half:-1]])


WRONG_MAPPINGS = {"a slice shifted by one element": _shifted_slice,
                  "exp_avg and exp_avg_sq swapped": _moments_swapped,
                  "exp_avg of another parameter": _moment_of_another_parameter,
                  "exp_avg_sq of another parameter": _second_moment_of_another_parameter,
                  "stage 3's padding missing": _padding_missing}
