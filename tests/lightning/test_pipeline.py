"""Pipeline parallel under ZeRO (fp32, the Trainer): ``ZeroStrategy(pipeline_parallel_size=2)`` at pp2 x dp2 (world 4)
trains a tiny Hugging Face Llama and lzero's demo GPT (its head tied to the embedding), both built in
``configure_model`` with their ``training_step`` as written for DDP, as one process does on the same global batches
(4 clipped AdamW steps), with GPipe, 1F1B and interleaved 1F1B (4 virtual stages), at zero1, zero2, zero3 and
zero2_offload; validation runs the forward-only schedule. See [Note: pipeline parallel under ZeRO] in
lzero/engine/pipeline.py.

The floor, measured by pipeline_runs.py's second reference (one process accumulating the same 8 micro-batches'
gradients, plain torch, against the whole batch at once): losses 1.2e-7, norms 2.2e-7, final parameters 2.1e-6
relative (AdamW's division by sqrt(v) turns the last bits of small gradient elements into whole steps; eps=1e-4 as in
the tensor-parallel tests). lzero measured against the whole batch: losses 1.2e-7, norms 2.8e-7, parameters 2.4e-6,
validation 1.4e-7.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script
from pipeline_runs import CONFIGURATIONS, EAGER, SCHEDULES

TOLERANCE = 1e-6  # losses, gradient norms, logged and validation losses
PARAMETERS = 5e-6  # final parameters after 4 AdamW steps: about twice the floor measured above


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launched(tmp_path_factory, "pipeline_runs.py", [((), 4)])


def _launched(tmp_path_factory: pytest.TempPathFactory, script: str, phases: list, tensor_heads: bool = False) -> Path:
    """A folder holding a tiny Llama (pipeline_runs.py's; pipeline_3d_runs.py's heads split over 2 tensor ranks with
    ``tensor_heads``) and what ``script`` wrote, run once per (extra arguments, ranks) of ``phases``."""
    from pipeline_3d_runs import save_llama as save_tp_llama
    from pipeline_runs import save_llama

    out = tmp_path_factory.mktemp(script.removesuffix(".py"))
    (save_tp_llama if tensor_heads else save_llama)(out / "llama")
    for extra, ranks in phases:
        run_script(script, str(out), str(out / "llama"), *extra, ranks=ranks)
    return out


def _load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def _relative(a: object, b: object) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


MODELS = ("llama", "gpt")


RUNS = [f"{model}_{config}_{schedule}" for model in MODELS for config in CONFIGURATIONS for schedule in SCHEDULES]


@pytest.mark.parametrize("name", RUNS + [f"{name}_eager" for name in EAGER])
def test_pipeline_equals_one_process(runs: Path, name: str) -> None:
    """Every run, and the runs whose model is built in ``__init__`` (``_eager``) instead of ``configure_model``;
    ``test`` runs the forward-only schedule as ``validate`` does, on the same batches."""
    model = name.split("_")[0]
    got, want = _load(runs, name), _load(runs, f"reference_{model}")
    assert len(got["losses"]) == len(want["losses"]) == 4
    assert _relative(got["losses"], want["losses"]) <= TOLERANCE, (got["losses"], want["losses"])
    assert _relative(got["norms"], want["norms"]) <= TOLERANCE, (got["norms"], want["norms"])
    assert _relative(got["logged"], want["rank0"]) <= TOLERANCE, (got["logged"], want["rank0"])  # rank 0's own batch
    assert abs(got["val_loss"] - want["val_loss"]) <= TOLERANCE * want["val_loss"]
    assert got["test_loss"] == got["val_loss"]
    assert got["sampler"] == {"num_replicas": 2, "rank": 0}
    assert set(got["params"]) == set(want["params"])  # every parameter, from the stage holding it
    for name, value in want["params"].items():
        for held in got["params"][name]:  # a tied weight: from each stage holding it
            assert held.shape == value.shape, name
            assert _relative(held, value) <= PARAMETERS, (name, _relative(held, value))


@pytest.mark.parametrize("config", CONFIGURATIONS)
@pytest.mark.parametrize("model", MODELS)
def test_schedules_are_bitwise_alike(runs: Path, model: str, config: str) -> None:
    """GPipe, 1F1B and interleaved 1F1B run the same micro-batches in other orders: each stage's gradients add up in
    the same order, so the runs agree to the bit."""
    first = _load(runs, f"{model}_{config}_{SCHEDULES[0]}")
    for schedule in SCHEDULES[1:]:
        other = _load(runs, f"{model}_{config}_{schedule}")
        assert other["losses"] == first["losses"] and other["norms"] == first["norms"]
        for name, values in first["params"].items():
            for a, b in zip(values, other["params"][name]):
                assert torch.equal(a, b), (schedule, name)


def test_tied_weights_stay_one_weight(runs: Path) -> None:
    """The demo GPT's embedding (stage 0) and head (stage 1) hold one weight: their gradients are summed across the
    stages, so after 4 steps both copies are equal to the bit."""
    got = _load(runs, "gpt_zero3_1f1b")
    assert "wte.weight" in got["params"] and "lm_head.weight" in got["params"]
    assert torch.equal(got["params"]["wte.weight"][0], got["params"]["lm_head.weight"][0])


@pytest.fixture(scope="module")
def seeds_3d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launched(tmp_path_factory, "pipeline_3d_runs.py", [((), 8)], tensor_heads=True)


def test_the_seeds_3d_json_runs_at_tp2_pp2_dp2_as_one_process(seeds_3d: Path) -> None:
    """The seeds' DeepSpeed JSON, sizes scaled to world 8, under ``Trainer(strategy=ZeroStrategy(config=...))``:
    ZeRO-2 with CPU optimizer offload over 2 data ranks of each (stage, tensor) coordinate, 4 micro-batches of 1 per
    step; 4 steps equal one process within the tensor-parallel floor (test_tensor_parallel.py's 1e-5 on parameters)."""
    got, want = _load(seeds_3d, "seeds_3d"), _load(seeds_3d, "reference_seeds_3d")
    assert got["sizes"] == {"tensor": 2, "pipeline": 2, "microbatches": 4, "stage": 2, "offload": "cpu", "data": 2}
    assert got["sampler"] == {"num_replicas": 2, "rank": 0}
    assert _relative(got["losses"], want["losses"]) <= TOLERANCE, (got["losses"], want["losses"])
    assert _relative(got["norms"], want["norms"]) <= TOLERANCE, (got["norms"], want["norms"])
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        assert _relative(got["params"][name], value) <= 1e-5, (name, _relative(got["params"][name], value))


CHECKPOINT_LAYOUTS = [(2, 2), (1, 4), (1, 1)]  # (pipeline, data) sizes of the resumes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    phases = [(("save",), 4), *(((f"resume:{pp}",), pp * dp) for pp, dp in CHECKPOINT_LAYOUTS)]
    return _launched(tmp_path_factory, "pipeline_checkpoint_runs.py", phases)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pp, dp", CHECKPOINT_LAYOUTS)
def test_a_pipeline_checkpoint_resumes_at_other_pipeline_and_data_sizes(checkpoints: Path, model: str, stage: int,
                                                                        pp: int, dp: int) -> None:
    """Saved at pp2 x dp2 after epoch 0 (one parameter-keyed checkpoint of the whole model, the tied weight written
    once: [Note: pipeline checkpoints] in lzero/checkpoint/sharded.py); resumed at pp2 x dp2 (bitwise), pp1 x dp4 and
    world size 1, epoch 1's two steps equal the uninterrupted run within 1e-6 (measured: 1.9e-7)."""
    whole = _load(checkpoints, f"{model}_zero{stage}")
    resumed = _load(checkpoints, f"{model}_zero{stage}_at_pp{pp}dp{dp}")
    assert len(whole["losses"]) == 4 and len(resumed["losses"]) == 2
    bound = 0.0 if pp == 2 else TOLERANCE
    assert _relative(resumed["losses"], whole["losses"][2:]) <= bound, (resumed["losses"], whole["losses"])
    for name, value in whole["params"].items():
        held = resumed["params"].get(name, resumed["params"].get("wte.weight"))  # one process: one tied name
        assert _relative(held, value) <= bound, (name, _relative(held, value))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("model", MODELS)
def test_consolidate_and_export_give_the_gathered_model(checkpoints: Path, tmp_path: Path, model: str,
                                                        stage: int) -> None:
    """``lzero consolidate`` of the pp2 x dp2 run's last checkpoint is its gathered model, bitwise (the tied weight
    once, the head's key an alias of it); ``export-hf`` writes the Llama as a Hugging Face folder of the same weights."""
    import json

    from lzero.cli import main

    checkpoint = checkpoints / f"{model}_zero{stage}" / "epoch=1.ckpt"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["pipeline_parallel"] == {"size": 2}
    assert main(["consolidate", str(checkpoint), str(tmp_path / "whole.pt")]) == 0
    state = torch.load(tmp_path / "whole.pt", weights_only=True)["state_dict"]
    gathered = _load(checkpoints, f"{model}_zero{stage}")["params"]  # at the end of epoch 1
    assert state.keys() == {f"model.{k}" for k in gathered}
    for name, value in gathered.items():
        assert torch.equal(state[f"model.{name}"], value), name
    if model == "llama":
        from transformers import AutoModelForCausalLM

        assert main(["export-hf", str(checkpoint), str(tmp_path / "hf"), "--config", str(checkpoints / "llama")]) == 0
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
        assert all(torch.equal(exported[name], value) for name, value in gathered.items())


def test_fp16_overflow_skips_the_same_steps_on_every_stage(runs: Path) -> None:
    """16-mixed at pp2 x dp2: a loss scale of 2^20 overflows the first steps' fp16 gradients on some stage; the inf/NaN
    check spans the stages, so every rank skips the same steps, the scale halves at each, and training goes on once it
    fits. (A run without pipelines skips another number of steps: its per-rank batch of 2 sends twice the scaled
    gradient per sample through fp16 that 4 micro-batches of 1 do.) Before any step both see the same loss."""
    piped, plain = _load(runs, "16-mixed_pp2dp2"), _load(runs, "16-mixed_pp1dp4")
    skipped = piped["skipped"]
    assert len(set(skipped)) == 1 and 1 <= skipped[0] < 6, skipped  # every rank alike; some steps taken
    scales = piped["scales"]  # before each step
    assert scales[: skipped[0] + 1] == [2.0 ** (20 - i) for i in range(skipped[0] + 1)]
    assert len(set(scales[skipped[0]:])) == 1
    assert abs(piped["losses"][0] - plain["losses"][0]) <= 1e-6 * plain["losses"][0]


def test_bf16_mixed_under_a_pipeline_follows_the_run_without(runs: Path) -> None:
    """bf16-mixed at pp2 x dp2 against pp1 x dp4 on the same global batches (both lzero zero2, bf16 compute copies of
    fp32 masters): the losses agree within bf16's rounding (measured below)."""
    piped, plain = _load(runs, "bf16-mixed_pp2dp2"), _load(runs, "bf16-mixed_pp1dp4")
    assert len(piped["losses"]) == 6 and piped["skipped"] == plain["skipped"] == [0, 0, 0, 0]
    assert _relative(piped["losses"], plain["losses"]) <= 1e-2, (piped["losses"], plain["losses"])


@pytest.mark.parametrize("name, stages", [("llama_zero3_1f1b", ["stage0", "stage0", "stage1", "stage1"]),
                                          ("gpt_zero1_interleaved_1f1b", ["stage0+2", "stage0+2", "stage1+3",
                                                                         "stage1+3"])])
def test_memory_logs_name_each_ranks_stages_and_match_the_formula(runs: Path, name: str, stages: list) -> None:
    """The memory monitor under pipelines gathers every stage's ranks and names their stages; each rank's model states
    are the ZeRO formula over its stage's own parameters (within the units' padding to the data ranks)."""
    import csv

    from pipeline_runs import MEMORY_LOGGED

    assert name in MEMORY_LOGGED
    with open(runs / name / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    last = {k: float(v) for row in rows for k, v in row.items() if v not in ("", None)}
    held = []
    for rank, stage in enumerate(stages):
        measured = last[f"memory/model_states_bytes/{stage}/rank{rank}"]
        expected = last[f"memory/model_states_expected_bytes/{stage}/rank{rank}"]
        assert abs(measured - expected) <= 0.01 * expected, (rank, measured, expected)  # measured: to the byte
        held.append(measured)
    assert held[0] == held[1] and held[2] == held[3] and held[0] != held[2]  # a stage's data ranks alike


@pytest.mark.parametrize("what, match", [
    ("generation", r"`strategy.generation\(\)` under `pipeline_parallel_size=2`.*HINT: save a checkpoint"),
    ("predict", r"`predict` under pipeline parallel is not built.*HINT"),
    ("full_checkpoint", r"`pipeline_parallel_size=2` with a checkpoint callback and `checkpoint_format='full'`.*HINT"),
    ("manual", r"`pipeline_parallel_size=2` with manual optimization.*HINT"),
])
def test_what_pipelines_do_not_run_is_refused_by_name(runs: Path, what: str, match: str) -> None:
    import re

    message = _load(runs, f"refused_{what}")["message"]
    assert message is not None and re.search(match, message, re.S), message


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launched(tmp_path_factory, "pipeline_fabric_runs.py", [((), 4)])


@pytest.mark.parametrize("name", ["llama_zero1", "gpt_zero2", "gpt_zero3"])
def test_fabric_pipeline_steps_equal_the_trainers(runs: Path, fabric_runs: Path, name: str) -> None:
    """Fabric's door: the loop hands its step to ``strategy.pipeline_step`` (``fabric.backward`` of the returned loss
    only runs the hooks, ``fabric.clip_gradients`` the pipeline's norm) and trains as the Trainer's 1F1B run does, to
    the bit, so as one process does; ``fabric.save`` then ``fabric.load`` into a fresh pipelined model give the
    parameters back bitwise."""
    got, trainer = _load(fabric_runs, f"fabric_{name}"), _load(runs, f"{name}_1f1b")
    assert got["losses"] == trainer["losses"] and got["norms"] == trainer["norms"]
    assert set(got["params"]) == set(trainer["params"])
    for key, value in got["params"].items():
        assert all(torch.equal(value, held) for held in trainer["params"][key]), key
        assert torch.equal(got["loaded"][key], value), key


def test_a_joint_fabric_setup_is_refused_under_a_pipeline(fabric_runs: Path) -> None:
    message = _load(fabric_runs, "refused_joint_setup")["message"]
    assert message is not None and "`fabric.setup(model, optimizer)` with `pipeline_parallel_size=2`" in message
    assert "HINT: `model = fabric.setup_module(model)`" in message


def test_per_tensor_ownership_under_a_pipeline(runs: Path, fabric_runs: Path) -> None:
    """pp2 x dp2 at zero3 with `optimizer_partition="per_tensor"`: each stage's parameters owned whole by its data ranks
    (the tied embedding's gradient summed across the end stages, the norm over both), AdamW stepped per tensor: the
    same run as per element, to the bit, and through fabric.save / fabric.load."""
    got, trainer = _load(fabric_runs, "fabric_gpt_zero3_per_tensor"), _load(runs, "gpt_zero3_1f1b")
    assert got["losses"] == trainer["losses"] and got["norms"] == trainer["norms"]
    for key, value in got["params"].items():
        assert all(torch.equal(value, held) for held in trainer["params"][key]), key
        assert torch.equal(got["loaded"][key], value), key


def test_the_demo_pipeline_config_trains_logs_stages_and_resumes(tmp_path: Path) -> None:
    """`lzero fit --config configs/demo_pipeline.yaml` as a user runs it (2 processes: pp2 x dp1, zero2, 1F1B; a
    stage's data group of one rank, where every side group's collectives stay local): the sanity check's and each
    validation's forward-only schedule, TensorBoard memory tags naming each rank's stage, sharded checkpoints of both
    stages; a second `fit` resumes from `last.ckpt` and `lzero consolidate` writes the whole model."""
    import json
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lzero.cli import main

    repo = Path(__file__).resolve().parents[2]
    fit = [sys.executable, "-m", "lzero.cli", "fit", "--config", str(repo / "configs" / "demo_pipeline.yaml"),
           "--trainer.max_epochs", "3", "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "2",
           "--trainer.enable_progress_bar", "false", "--data.steps_per_epoch", "4"]
    done = subprocess.run([*fit, "--trainer.max_steps", "4"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "demo" / "demo_pipeline" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["pipeline_parallel"] == {"size": 2} and manifest["global_step"] == 4
    assert manifest["aliases"] == {"model.lm_head.weight": "model.wte.weight"}  # the tied head, written once
    events = EventAccumulator(str(run)).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"memory/model_states_bytes/stage0/rank0", "memory/model_states_bytes/stage1/rank1", "val_loss",
            "train_loss"} <= tags
    done = subprocess.run([*fit, "--trainer.max_steps", "6", "--ckpt_path", str(last)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads((run.parent / "version_1" / "checkpoints" / "last.ckpt" / "manifest.json").read_text())
    assert resumed["global_step"] == 6
    assert main(["consolidate", str(last), str(tmp_path / "whole.pt")]) == 0
    state = torch.load(tmp_path / "whole.pt", weights_only=True)["state_dict"]
    assert "model.lm_head.weight" in state and torch.equal(state["model.lm_head.weight"], state["model.wte.weight"])
