"""``lzero estimate --pipeline-parallel``: the activations each schedule keeps in flight on each pipeline rank ([Note:
activations in flight by schedule] in lzero/memory/pipeline_estimate.py), each rank's stage counted as the strategy
cuts the model, and its model states over N / (P x T) data ranks."""

from __future__ import annotations

import json

import pytest

from lzero.cli import main
from lzero.memory.estimate import ModelCount, estimate
from lzero.memory.pipeline_estimate import in_flight


def test_gpipe_holds_every_micro_batch_and_1f1b_one_per_stage_after_it() -> None:
    assert [in_flight("gpipe", 4, 8, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, r) for r in range(4)] == [2, 2, 2, 1]  # fewer micro-batches than stages


def test_interleaved_holds_chunks_of_its_virtual_stages() -> None:
    """torch's warm-up: (v - 1) x P + 2 x (P - 1 - p) forwards of one stage's chunk, plus the steady state's one,
    each 1/v of the rank's layers: Megatron's (1 + (P - 1) / (P v)) x P micro-batches on the first rank, less after."""
    assert [in_flight("interleaved_1f1b", 4, 8, r, virtual=2) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert in_flight("interleaved_1f1b", 2, 2, 0, virtual=4) == 2.0  # capped at every chunk: m x v


def test_a_stage_s_model_states_are_the_formula_over_the_data_ranks_of_its_stage() -> None:
    stage = estimate(ModelCount(3_500_000_000), num_gpus=8, strategies=["zero2"], pipeline_parallel_size=2)[0]
    flat = estimate(ModelCount(3_500_000_000), num_gpus=4, strategies=["zero2"])[0]  # the same 4 data ranks alone
    assert stage.per_device == flat.per_device


def test_the_cli_cuts_a_model_as_the_strategy_does(capsys: pytest.CaptureFixture) -> None:
    """The demo GPT (4 blocks, head tied to the embedding) at pp2: rank 0 holds the embeddings and blocks 0-1, rank 1
    blocks 2-3, the final norm and the head (the tied weight on both)."""
    from lzero.demo.module import DemoGPT

    model = DemoGPT(n_layer=4)
    block = sum(p.numel() for p in model.model.blocks[0].parameters())
    wte, wpe = model.model.wte.weight.numel(), model.model.wpe.weight.numel()
    ln_f = sum(p.numel() for p in model.model.ln_f.parameters())
    assert main(["estimate", "--model", "lzero.demo.module:DemoGPT", "--model-args", '{"n_layer": 4}', "--num-gpus",
                 "4", "--pipeline-parallel", "2", "--microbatches", "4", "--microbatch-activations", "1e6",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["pipeline"]
    assert [r["trainable_params"] for r in rows] == [wte + wpe + 2 * block, 2 * block + ln_f + wte]
    assert [r["microbatches_in_flight"] for r in rows] == [2, 1]
    assert [r["activations_bytes"] for r in rows] == [1_000_000, 500_000]  # half the layers each: 2 x 1/2, 1 x 1/2
    assert rows[0]["per_device"]["zero3"] < rows[0]["per_device"]["zero2"] < rows[0]["per_device"]["zero1"]


@pytest.mark.parametrize("argv, message", [
    (["--microbatches", "4"], "`--microbatches` is given without `--pipeline-parallel`"),
    (["--pipeline-parallel", "3"], "must divide the world size 8"),
    (["--pipeline-parallel", "2", "--pipeline-schedule", "zbv"], "`--pipeline-schedule zbv` is not one of"),
    (["--pipeline-parallel", "2", "--virtual-stages", "2"], "`--virtual-stages 2` with `--pipeline-schedule 1f1b`"),
])
def test_bad_pipeline_flags_are_named(argv: list, message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", "--params", "1e9", "--num-gpus", "8", *argv]) == 2
    assert message in capsys.readouterr().err
