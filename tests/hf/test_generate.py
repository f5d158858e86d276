"""Generation under zero3 and zero3_offload at world size 2 (see [Note: every block gathered for generation] in
lzero/engine/gather.py): greedy tokens equal the plain model's and DDP's, with ``strategy.generation()`` (all-gathers only
on entry, none per token) and without it (each block gathered per forward, ranks kept stepping together); ranks
that stop at different lengths finish; a rollout inside ``training_step`` followed by an update equals DDP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _launch import run_script
from _pretrained_models import save_models

pytest.importorskip("transformers")
from generate_runs import EOS, NEW_TOKENS, PROMPTS  # noqa: E402

MODES = [(s, m) for s in ("zero3", "zero3_offload") for m in ("gathered", "streamed", "per_forward")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    models = save_models(tmp_path_factory.mktemp("generate_models"), ["gpt2", "llama"])
    out = tmp_path_factory.mktemp("generate_runs")
    # bounded: a rank left waiting in a collective for a peer that stopped generating would hang until this timeout
    run_script("generate_runs.py", str(models["gpt2"].parent), str(out), timeout=240, ranks=2)
    return out, models


def _load(out: Path, name: str) -> list:
    return torch.load(out / f"{name}.pt", weights_only=False)  # written by the test's own script


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy,mode", MODES)
def test_greedy_tokens_equal_the_plain_model(runs: tuple, name: str, strategy: str, mode: str) -> None:
    from transformers import AutoModelForCausalLM

    out, models = runs
    plain = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
    ours, ddp = _load(out, f"{name}-{strategy}-{mode}"), _load(out, f"{name}-ddp-per_forward")
    lengths = []
    for rank, prompt in enumerate(PROMPTS):
        expected = plain.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=EOS[name],
                                  pad_token_id=EOS[name])
        (got,) = ours[rank]
        assert torch.equal(got["tokens"], expected) and torch.equal(got["tokens"], ddp[rank][0]["tokens"]), rank
        lengths.append(got["tokens"].shape[1] - prompt.numel())
    assert lengths[0] < lengths[1] == NEW_TOKENS  # rank 0 met EOS early; rank 1 ran on without hanging


@pytest.mark.parametrize("name,units", [("gpt2", 3), ("llama", 2)])
@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload"])
def test_all_gathers_per_token(runs: tuple, name: str, units: int, strategy: str) -> None:
    out, _ = runs
    gathered, per_forward = _load(out, f"{name}-{strategy}-gathered"), _load(out, f"{name}-{strategy}-per_forward")
    for rank in range(2):
        g, p = gathered[rank][0], per_forward[rank][0]
        assert g["gathers_on_entry"] == g["gathers"] == units  # every block once, then none per token
        assert p["gathers"] == units * NEW_TOKENS  # every block per decoding step, on both ranks (kept in step)
        print(f"{name} {strategy} rank {rank}: all-gathers {g['gathers']} in the context vs {p['gathers']} without;"
              f" {g['tokens'].shape[1] - 4} tokens in {g['seconds']:.3f} s vs {p['seconds']:.3f} s")


@pytest.mark.parametrize("name,units", [("gpt2", 3), ("llama", 2)])
@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload"])
def test_streamed_mode_copies_each_block_per_token_without_collectives(runs: tuple, name: str, units: int,
                                                                       strategy: str) -> None:
    """One all-gather per block on entry (for the host copy; the root is gathered for the step already), then per
    token one host copy per block and no collective: rank 0, which stops early, copies for fewer tokens."""
    out, _ = runs
    streamed, gathered = _load(out, f"{name}-{strategy}-streamed"), _load(out, f"{name}-{strategy}-gathered")
    for rank in range(2):
        s, g = streamed[rank][0], gathered[rank][0]
        new = s["tokens"].shape[1] - 4
        assert s["gathers_on_entry"] == s["gathers"] == units
        assert s["host_copies"] == units * new
        print(f"{name} {strategy} rank {rank}: streamed {new / s['generate_seconds']:.1f} tokens/s"
              f" ({s['host_copies']} host copies, 0 all-gathers per token) vs gathered"
              f" {new / g['generate_seconds']:.1f} tokens/s")


def test_rollout_in_training_step_updates_like_ddp(runs: tuple) -> None:
    out, _ = runs
    ours, ddp = torch.load(out / "rollout-zero3.pt", weights_only=True), torch.load(out / "rollout-ddp.pt",
                                                                                     weights_only=True)
    assert ours.keys() == ddp.keys()
    for key, value in ddp.items():
        assert torch.equal(ours[key], value), key


def test_generation_takes_the_same_call_at_both_doors_and_names_a_wrong_argument_briefly() -> None:
    """``generation(module=None, mode=...)`` at both doors (the runs above pass the model inside the LightningModule,
    as Fabric scripts pass theirs); a mode given where the module goes, or a module outside the LightningModule, is
    refused naming the argument's class, not printing a model's whole tree."""
    import lightning as L

    import lzero

    class Policy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.policy = torch.nn.Linear(2, 2)

    strategy = lzero.ZeroStrategy(stage=3, parallel_devices=[torch.device("cpu")])
    strategy._lightning_module = Policy()
    with pytest.raises(ValueError, match="got 'streamed'.*the mode is a keyword argument"):
        with strategy.generation("streamed"):
            pass
    with pytest.raises(ValueError, match=r"got a Linear\. HINT") as refused:
        with strategy.generation(torch.nn.Linear(2, 2)):
            pass
    assert "in_features" not in str(refused.value)
    with strategy.generation(strategy.lightning_module.policy, mode="streamed"):  # no engine yet: nothing to hold
        pass
    fabric = lzero.ZeroFabricStrategy(stage=3)
    with pytest.raises(ValueError, match="got 'streamed'.*the mode is a keyword argument"):
        with fabric.generation("streamed"):
            pass
