"""Out-of-memory triage (see [Note: out-of-memory triage] in lzero/memory/triage.py): an injected OOM at zero2, world
size 2, with a budget that zero3 + activation checkpointing meets and neither alone does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _launch import run_script

from oom_runs import BATCH, INJECTED, LAYERS, SEQ, WIDTH  # noqa: E402


@pytest.fixture(scope="module")
def oom(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("oom_runs")
    run_script("oom_runs.py", str(out), ranks=2)
    return torch.load(out / "oom.pt", weights_only=False)  # written by the test's own script


def test_the_error_keeps_its_type_and_message(oom: dict) -> None:
    assert oom["error"] == "OutOfMemoryError"
    assert oom["message"].startswith(INJECTED)


def test_activations_are_measured_per_block(oom: dict) -> None:
    """Each block saves its input (u) and ReLU's output (4u, which fc2 saves too: one storage)."""
    u = BATCH * SEQ * WIDTH * 4
    probe = oom["record"]["probe"]
    assert probe["saved_in"] == {f"blocks.{i}": 5 * u for i in range(LAYERS)}
    assert probe["inputs"] == {f"blocks.{i}": u for i in range(LAYERS)}
    assert probe["total"] > LAYERS * 5 * u  # and the embedding's indices, the head's input, the loss's


def test_names_zero3_with_activation_checkpointing_and_the_bytes_it_saves(oom: dict) -> None:
    from lzero import ZeroConfig
    from lzero.memory.estimate import model_states, working_set

    record, count, acts = oom["record"], oom["count"], oom["record"]["probe"]["total"]

    def device(stage: int) -> int:
        config = ZeroConfig(stage=stage)
        return sum(model_states(config, count, 2, "32-true")["device"].values()) + \
            working_set(config, count, 2, "32-true")["device"]

    u = BATCH * SEQ * WIDTH * 4
    checkpointed = acts - (LAYERS * 5 * u - LAYERS * u - 5 * u)
    remedies = {r["name"]: r for r in record["remedies"]}
    assert record["current"] == device(2) + acts
    assert remedies["zero3"]["bytes"] == device(3) + acts and not remedies["zero3"]["fits"]
    assert remedies["activation checkpointing"]["bytes"] == device(2) + checkpointed
    assert not remedies["activation checkpointing"]["fits"]
    chosen = record["chosen"]
    assert chosen["name"] == "zero3 + activation checkpointing"
    assert chosen["bytes"] == device(3) + checkpointed <= oom["budget"]
    assert chosen["saves"] == device(2) + acts - chosen["bytes"]
    print(f"zero2 {record['current']:,} B per rank (activations {acts:,} B) against a budget of {oom['budget']:,} B;"
          f" zero3 + activation checkpointing {chosen['bytes']:,} B, saves {chosen['saves']:,} B")
    assert f"the cheapest that fits is zero3 + activation checkpointing, which saves" in oom["message"]
    assert f"({chosen['saves']:,} B)" in oom["message"]
