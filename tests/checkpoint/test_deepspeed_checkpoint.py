"""Resuming DeepSpeed ZeRO checkpoints (issue 49), against what DeepSpeed itself wrote and computed: the fixtures of
tests/deepspeed_fixtures/ (DeepSpeed 0.19.8, world size 2, steps 1-3 saved, steps 4-6 recorded).

The reader against DeepSpeed's own reassembly of every folder (bitwise); resumed runs
(tests/checkpoint/deepspeed_resume_runs.py) against DeepSpeed's steps 4-6: losses, fp32 masters and Adam's moments, within
ACROSS_CPUS (another machine computed them), and against each other bitwise; bad folders refused by name; ``lzero
import-deepspeed`` against the folder it read, and its checkpoint resumed, consolidated and exported.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from _deepspeed_reference import (ACROSS_CPUS, BF16_VS_DEEPSPEED, FIXTURES, WRONG_MAPPINGS, assert_within,
                                  continue_in_torch, deepspeed_off_by, deepspeed_steps, expected, saved_state)
from _launch import run_script
from lzero.checkpoint import CheckpointError
from lzero.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint, _precision_state, prefix_renaming
from lzero.checkpoint.deepspeed_files import LossScalerFields, load_deepspeed_file
from lzero.checkpoint.deepspeed_import import import_deepspeed
from lzero.checkpoint.reader import ShardedCheckpoint

CASES = [f"stage{s}_{p}" for s in (1, 2, 3) for p in ("fp32", "bf16")]


@pytest.mark.parametrize("case", CASES + ["lightning_stage2_fp32"])
def test_reader_gives_deepspeed_masters_and_moments(case: str) -> None:
    """Every folder at step 3 (and 6), read back bitwise as DeepSpeed reassembles it (zero_to_fp32 for the masters,
    safe_get_full_optimizer_state for the moments), the tied ``lm_head.weight`` included."""
    lightning = case.startswith("lightning")
    for step, folder in ((3, "epoch=0-step=3.ckpt" if lightning else "global_step3"),) + ((6, ""),) * (not lightning):
        reader = DeepSpeedCheckpoint(FIXTURES / case / folder)
        masters, moments = expected(case, step)
        state = reader.full_state_dict()
        assert set(state) == set(masters)
        for name, value in masters.items():
            assert torch.equal(state[name].float(), value), name
        for name, entry in moments["params"].items():
            numel = entry["exp_avg"].numel()
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(reader.read_range(f"optim/0/{name}/{key}", 0, numel), entry[key].reshape(-1)), name
            assert reader.scalar(f"optim/0/{name}/step").item() == step
        assert reader.manifest["global_step"] == step and reader.world_size == 2


def test_reader_carries_groups_schedule_and_lightning_state() -> None:
    raw = DeepSpeedCheckpoint(FIXTURES / "stage2_fp32" / "global_step3").lightning_state()
    (group,) = raw["lzero/param_groups"][0]
    assert (group["lr"], group["betas"], group["weight_decay"], len(group["params"])) == (0.01, (0.9, 0.95), 0.1, 28)
    assert raw["lr_schedulers"][0]["last_epoch"] == 3 and raw["global_step"] == 3 and raw["epoch"] == 0
    optimizer_steps = raw["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    assert optimizer_steps["step"]["total"]["completed"] == 3
    assert raw["lzero/precision"] == {"skipped_steps": 0}  # bf16/fp32: no dynamic loss scaler
    lightning = DeepSpeedCheckpoint(FIXTURES / "lightning_stage2_fp32" / "epoch=0-step=3.ckpt").lightning_state()
    assert [len(g["params"]) for g in lightning["lzero/param_groups"][0]] == [10, 18]
    assert [g["weight_decay"] for g in lightning["lzero/param_groups"][0]] == [0.1, 0.0]
    assert lightning["hyper_parameters"]["n_embd"] == 15 and "callbacks" in lightning
    assert lightning["lr_schedulers"][0]["last_epoch"] == 3


def test_fp16_dynamic_loss_scale_carries_over() -> None:
    """DeepSpeed's DynamicLossScaler (no fixture: DeepSpeed refuses fp16 on the CPU) as lzero's precision state,
    which the fp16 plugin loads: scale, iteration, last overflow, hysteresis, skipped steps."""
    from lzero import ZeroPrecision

    scaler = LossScalerFields()
    scaler.__dict__.update(cur_scale=2048.0, cur_iter=40, last_overflow_iter=31, scale_factor=2.0, scale_window=1000,
                           min_scale=1, delayed_shift=2, cur_hysteresis=1, consecutive_hysteresis=False, dynamic=True)
    plugin = ZeroPrecision("16-mixed")
    plugin.load_state_dict(_precision_state(scaler, 3))
    assert (plugin.skipped_steps, plugin.scaler.scale, plugin.scaler.iteration) == (3, 2048.0, 40)
    assert (plugin.scaler.last_overflow_iteration, plugin.scaler.hysteresis_left) == (31, 1)


def test_names_matched_to_the_module_by_one_prefix() -> None:
    saved = ["wte.weight", "blocks.0.ln_1.weight"]
    added = prefix_renaming(saved, {"model.wte.weight", "model.blocks.0.ln_1.weight", "model.lm_head.weight"})
    assert added("wte.weight") == "model.wte.weight"
    assert prefix_renaming(["model." + n for n in saved], set(saved))("model.wte.weight") == "wte.weight"
    assert prefix_renaming(saved, set(saved)) is None  # already the module's
    assert prefix_renaming(saved, {"a.wte.weight", "b.blocks.0.ln_1.weight"}) is None  # no single prefix
    path = FIXTURES / "stage3_fp32" / "global_step3"
    reader = DeepSpeedCheckpoint(path, names=["model." + n for n in DeepSpeedCheckpoint(path).manifest["params"]])
    assert reader.param_name("model.lm_head.weight") == "model.wte.weight"
    assert reader.optimizer_keys(0, "model.wte.weight") == ["exp_avg", "exp_avg_sq", "step"]


# --- resumed runs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed_resume")
    for case in ("stage2_fp32", "stage3_fp32"):  # resumed as the folders are
        import_deepspeed(FIXTURES / case / "global_step3", out / f"imported_{case}")
    run_script("deepspeed_resume_runs.py", "ws2", str(out), ranks=2)
    run_script("deepspeed_resume_runs.py", "ws1", str(out))
    return out


def records(runs: Path, name: str, ranks: int = 2) -> list[dict]:
    return [torch.load(runs / f"{name}_rank{r}.pt", weights_only=True) for r in range(ranks)]


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("fp32")])
def test_resumed_fp32_runs_continue_deepspeed_within_across_cpus(runs: Path, case: str) -> None:
    """Same stage, world size 2: each rank's losses of steps 4-6 and the step-6 masters and moments are DeepSpeed's,
    within ACROSS_CPUS (the same AdamW over the same values; the fixtures' machine summed in another order); the step,
    epoch and scheduler came from the folder."""
    for record in records(runs, case):
        assert (record["start_step"], record["start_epoch"], record["scheduler_last_epoch"]) == (3, 0, 3)
        assert record["lrs"] == [s["lr"] for s in deepspeed_steps(case)]
    saved = ShardedCheckpoint(runs / case)
    losses = [record["losses"] for record in records(runs, case)]
    assert_within(case, deepspeed_off_by(case, losses, saved_state(saved, "model.")))
    for name in expected(case, 6)[1]["params"]:
        assert saved.scalar(f"optim/0/model.{name}/step").item() == 6


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("bf16")])
def test_resumed_bf16_runs_continue_deepspeed_within_bf16_rounding(runs: Path, case: str) -> None:
    """DeepSpeed runs its whole module in bf16, lzero's bf16-mixed under autocast (normalizations in fp32): losses,
    masters (the key bias apart: see KEY_BIAS) and moments within BF16_VS_DEEPSPEED."""
    losses = [record["losses"] for record in records(runs, case)]
    saved = saved_state(ShardedCheckpoint(runs / case), "model.")
    assert_within(case, deepspeed_off_by(case, losses, saved), BF16_VS_DEEPSPEED)


@pytest.mark.parametrize("run", ["stage2_fp32_as_zero1", "stage2_fp32_as_zero3_ws1"])
def test_resumed_in_another_layout_continues_as_the_same_layout(runs: Path, run: str) -> None:
    """DeepSpeed stage 2 at world size 2 resumed as lzero zero1 at world size 2 and zero3 at world size 1 (the two
    ranks' batches as two micro-batches): the same-layout resume's masters, moments and losses, bit for bit (both
    computed here); DeepSpeed's losses within ACROSS_CPUS."""
    same = ShardedCheckpoint(runs / "stage2_fp32")
    other = ShardedCheckpoint(runs / run)
    for name, info in same.manifest["params"].items():
        assert torch.equal(other.full_param(name), same.full_param(name)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(other.read_range(f"optim/0/{name}/{key}", 0, info["numel"]),
                               same.read_range(f"optim/0/{name}/{key}", 0, info["numel"])), (name, key)
    ranks = 1 if run.endswith("ws1") else 2
    losses = [loss for step in zip(*[r["losses"] for r in records(runs, run, ranks)]) for loss in step]
    same_losses = [loss for step in zip(*[r["losses"] for r in records(runs, "stage2_fp32")]) for loss in step]
    assert losses == same_losses and len(losses) == 6
    per_rank = [losses[rank::2] for rank in range(2)]  # the two micro-batches of a step at world size 1: ranks 0, 1
    assert_within(run, deepspeed_off_by("stage2_fp32", per_rank))


@pytest.mark.parametrize("run, case", [("stage1_fp32", "stage1_fp32"), ("stage2_fp32", "stage2_fp32"),
                                       ("stage3_fp32", "stage3_fp32"), ("stage2_fp32_as_zero1", "stage2_fp32")])
def test_each_rank_reads_its_share_of_the_optimizer_files(runs: Path, run: str, case: str) -> None:
    """A rank reads only the elements of its own shard from DeepSpeed's partitions: at most 1.1x its share (1/2) of
    the optimizer files' bytes (measured: 0.90x at stages 1-2, 0.92x at stage 3; the rest of a file is its pickle).
    Counted as the bytes of the pieces read from the mapped files; the pages mapped round each piece up to 4 KiB."""
    files = sum(f.stat().st_size for f in (FIXTURES / case / "global_step3").glob("*optim_states.pt"))
    for record in records(runs, run):
        assert 0 < record["bytes_read"] <= 1.1 * files / 2, (record["bytes_read"], files / 2)


def test_lightning_deepspeed_checkpoint_resumes_under_zero2(runs: Path) -> None:
    """Lightning's DeepSpeedStrategy folder: its global step, epoch and scheduler in place; the losses of the steps
    Lightning's DeepSpeed run took after the save."""
    for record in records(runs, "lightning_stage2_fp32"):
        assert (record["start_step"], record["start_epoch"], record["scheduler_last_epoch"]) == (3, 0, 3)
    losses = [record["losses"] for record in records(runs, "lightning_stage2_fp32")]
    assert_within("lightning_stage2_fp32", deepspeed_off_by("lightning_stage2_fp32", losses))


def test_fabric_load_resumes_a_deepspeed_folder(runs: Path) -> None:
    """``fabric.load(folder, {"model": model, "optimizer": optimizer})`` under zero3; the rest (global step, the
    scheduler's state) returned: DeepSpeed's losses and step-6 masters and moments, within ACROSS_CPUS; the same as
    the Trainer's zero3 resume, bit for bit."""
    for record in records(runs, "fabric_stage3_fp32"):
        assert (record["start_step"], record["scheduler_last_epoch"]) == (3, 3)
    losses = [record["losses"] for record in records(runs, "fabric_stage3_fp32")]
    assert losses == [record["losses"] for record in records(runs, "stage3_fp32")]
    saved = ShardedCheckpoint(runs / "fabric_stage3_fp32")
    assert set(saved.manifest["params"]) <= set(expected("stage3_fp32", 6)[0])
    assert_within("fabric_stage3_fp32", deepspeed_off_by("stage3_fp32", losses, saved_state(saved, "")))
    trainer = ShardedCheckpoint(runs / "stage3_fp32")
    for name in saved.manifest["params"]:
        assert torch.equal(saved.full_param(name), trainer.full_param(f"model.{name}")), name



def test_a_wrong_mapping_is_far_outside_the_bound() -> None:
    """ACROSS_CPUS tells a right mapping from a wrong one: DeepSpeed's step-3 state continued in plain torch is within
    it; the same state mapped wrongly in one way (one parameter, or rank 1's parts) is at least 1000x outside it in
    masters or moments, and outside BF16_VS_DEEPSPEED (measured: see the printed figures)."""
    case = "stage3_fp32"
    reader = DeepSpeedCheckpoint(FIXTURES / case / "global_step3")
    order = list(reader.manifest["params"])
    masters = reader.full_state_dict()

    def loaded() -> dict[str, dict[str, torch.Tensor]]:
        return {name: {"fp32": masters[name].reshape(-1).clone(),
                       **{key: reader.read_range(f"optim/0/{name}/{key}", 0, info["numel"])
                          for key in ("exp_avg", "exp_avg_sq")}}
                for name, info in reader.manifest["params"].items()}

    assert_within("right mapping, in torch", deepspeed_off_by(case, *continue_in_torch(case, loaded())))
    for wrong, corrupt in WRONG_MAPPINGS.items():
        state = loaded()
        corrupt(state, order)
        off = deepspeed_off_by(case, *continue_in_torch(case, state))
        print(f"{wrong}: " + ", ".join(f"{k} {v:.1e} ({v / ACROSS_CPUS[k]:.0e}x)" for k, v in off.items()))
        worst = max(off[k] / ACROSS_CPUS[k] for k in ("master", "exp_avg", "exp_avg_sq"))
        assert worst >= 1e3, (wrong, off)
        assert any(off[k] > BF16_VS_DEEPSPEED[k] for k in ("master", "exp_avg", "exp_avg_sq")), (wrong, off)

# --- bad folders -------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "stage2_fp32" / "global_step3", tmp_path / "global_step3")
    return tmp_path / "global_step3"


class Payload:
    """Pickles as a call of ``os.makedirs``: what a tampered file could run when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.makedirs, (str(self.marker),)


def rewrite(path: Path, **changes: object) -> None:
    """Replace entries of an optimizer file's ``optimizer_state_dict``; DeepSpeed's classes written as plain values
    (our stand-ins would pickle under lzero's names)."""
    state = load_deepspeed_file(path)
    inner = state["optimizer_state_dict"]
    inner.update({"zero_stage": int(inner["zero_stage"]), "loss_scaler": None, **changes})
    inner.pop("param_slice_mappings")
    path.unlink()
    torch.save(state, path)


def test_a_class_off_the_allow_list_is_refused_by_name_and_never_runs(folder: Path, tmp_path: Path) -> None:
    rewrite(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt", loss_scaler=Payload(tmp_path / "ran"))
    with pytest.raises(CheckpointError, match=r"rank_1_mp_rank_00_optim_states.pt` names the class `os\.makedirs`"):
        DeepSpeedCheckpoint(folder)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("extra, message", [
    ("mp_rank_01_model_states.pt", r"mp_rank_01_model_states.pt` belongs to tensor- or pipeline-parallel rank 1"),
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt", r"mp_rank_01_optim_states.pt` belongs to tensor- or pipeline"),
    ("layer_01-model_00-model_states.pt", r"layer_01-model_00-model_states.pt` is a pipeline-parallel layer file"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", r"expp_rank_0_mp_rank_00_optim_states.pt` is a mixture-of-experts"),
    ("layer_0_expert_0_mp_rank_00_model_states.pt", r"layer_0_expert_0_mp_rank_00_model_states.pt` is a mixture-of"),
])
def test_model_parallel_and_expert_files_are_refused_by_name(folder: Path, extra: str, message: str) -> None:
    (folder / extra).write_bytes(b"never read")
    with pytest.raises(CheckpointError, match=message):
        DeepSpeedCheckpoint(folder)


def test_a_missing_rank_file_is_named(folder: Path) -> None:
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks \['zero_pp_rank_1_mp_rank_00_optim_states.pt'\], of the 2 ranks"):
        DeepSpeedCheckpoint(folder)


def test_an_optimizer_state_not_per_element_is_refused(folder: Path) -> None:
    path = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    base = load_deepspeed_file(path)["optimizer_state_dict"]["base_optimizer_state"]
    base["state"][0]["exp_avg_sq_row"] = torch.zeros(65)  # a factored second moment (Adafactor's)
    rewrite(path, base_optimizer_state=base)
    with pytest.raises(CheckpointError, match=r"optimizer state `exp_avg_sq_row` is \[65\], not one value per element"):
        DeepSpeedCheckpoint(folder)


# --- lzero import-deepspeed ----------------------------------------------------------------------


IMPORTS = {"stage2_fp32": ("stage2_fp32", 6), "stage3_bf16": ("stage3_bf16", 6),
           "lightning_stage2_fp32": ("lightning_stage2_fp32/epoch=0-step=3.ckpt", 3)}
"""Case -> the folder imported (a save directory: its ``latest`` tag; Lightning's .ckpt directory) and its step."""


@pytest.mark.parametrize("case", IMPORTS)
def test_import_writes_the_folder_as_an_lzero_checkpoint(case: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The imported checkpoint reads back as the folder does, bit for bit: state dict (dtypes, tied keys), every
    optimizer state piece and step, param groups, scheduler, loops and precision state; streamed: no read larger than
    one parameter's half (its cut at DeepSpeed's world size 2)."""
    folder, step = IMPORTS[case]
    source = DeepSpeedCheckpoint(FIXTURES / folder)
    largest = []
    read_range = DeepSpeedCheckpoint.read_range
    monkeypatch.setattr(DeepSpeedCheckpoint, "read_range",
                        lambda self, key, a, b, dtype=None: largest.append(b - a) or read_range(self, key, a, b, dtype))
    manifest = import_deepspeed(FIXTURES / folder, tmp_path / "imported")
    assert 0 < max(largest) <= -(-max(p["numel"] for p in source.manifest["params"].values()) // 2)
    imported = ShardedCheckpoint(tmp_path / "imported")
    assert (manifest["global_step"], manifest["world_size"], imported.manifest["imported_from"]["format"]) == \
        (step, 2, "deepspeed")
    ours, theirs = imported.full_state_dict(), source.full_state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)
    assert ours["lm_head.weight" if case != "lightning_stage2_fp32" else "model.lm_head.weight"] is \
        ours["wte.weight" if case != "lightning_stage2_fp32" else "model.wte.weight"]
    for name, info in source.manifest["params"].items():
        assert imported.optimizer_keys(0, name) == source.optimizer_keys(0, name) == ["exp_avg", "exp_avg_sq", "step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(imported.read_range(f"optim/0/{name}/{key}", 0, info["numel"]),
                               source.read_range(f"optim/0/{name}/{key}", 0, info["numel"])), (name, key)
        assert torch.equal(imported.scalar(f"optim/0/{name}/step"), source.scalar(f"optim/0/{name}/step"))
    ours, theirs = imported.lightning_state(), source.lightning_state()
    assert set(ours) == set(theirs)
    for key in ("lzero/param_groups", "lzero/precision", "lr_schedulers", "loops", "global_step", "epoch",
                "callbacks", "hyper_parameters"):
        assert ours.get(key) == theirs.get(key), key


@pytest.mark.parametrize("case", IMPORTS)
def test_imported_checkpoint_consolidates_and_exports_to_deepspeeds_masters(case: str, tmp_path: Path) -> None:
    """``lzero consolidate`` of the imported checkpoint, and of the DeepSpeed folder itself, give the fp32 masters
    DeepSpeed's zero_to_fp32 gives for the folder's tag, bit for bit (bf16 runs keep fp32 masters too); ``lzero
    export-hf`` writes them, the tied key once."""
    from safetensors.torch import load_file

    from lzero.cli import main

    folder, step = IMPORTS[case]
    masters = torch.load(FIXTURES / case / f"expected_step{step}_fp32.pt", weights_only=True)
    assert main(["import-deepspeed", str(FIXTURES / folder), str(tmp_path / "imported")]) == 0
    for source, out in ((tmp_path / "imported", tmp_path / "imported.ckpt"), (FIXTURES / folder, tmp_path / "ds.ckpt")):
        assert main(["consolidate", str(source), str(out)]) == 0
        consolidated = torch.load(out, weights_only=True)
        assert consolidated["global_step"] == step and set(consolidated["state_dict"]) == set(masters)
        for name, value in masters.items():
            assert torch.equal(consolidated["state_dict"][name], value), (out.name, name)
    assert main(["export-hf", str(tmp_path / "imported"), str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    prefix = "model." if case.startswith("lightning") else ""
    assert set(exported) == {k[len(prefix):] for k in masters} - {"lm_head.weight"}
    assert all(torch.equal(v, masters[prefix + k]) for k, v in exported.items())


def test_imported_checkpoint_resumes_as_the_deepspeed_folder(runs: Path) -> None:
    """``Trainer.fit(ckpt_path=<imported>)`` under zero2 and ``fabric.load`` under zero3 (the module holding the GPT
    as ``self.model`` under the Trainer: the names matched by one prefix, as for the folder): the folders' resumes'
    losses and step-6 masters and moments, bit for bit (both computed here); DeepSpeed's, within ACROSS_CPUS."""
    for run, case, prefix in (("stage2_fp32_imported", "stage2_fp32", "model."),
                              ("fabric_stage3_fp32_imported", "stage3_fp32", "")):
        same = run.replace("_imported", "")
        for record, folder_record in zip(records(runs, run), records(runs, same)):
            assert record["losses"] == folder_record["losses"]
            assert (record["start_step"], record["scheduler_last_epoch"]) == (3, 3)
        saved = ShardedCheckpoint(runs / run)
        ours, folders = saved_state(saved, prefix), saved_state(ShardedCheckpoint(runs / same), prefix)
        for name in expected(case, 6)[1]["params"]:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours(name, key), folders(name, key)), (name, key)
        losses = [record["losses"] for record in records(runs, run)]
        assert_within(run, deepspeed_off_by(case, losses, ours))


def test_import_refuses_a_non_empty_output_and_leaves_none_when_interrupted(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    source = FIXTURES / "stage2_fp32"
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"`.*taken` exists and is not empty \(it holds `notes.txt`\)"):
        import_deepspeed(source, tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"`.*file` is a file"):
        import_deepspeed(source, tmp_path / "file")

    from lzero.checkpoint import deepspeed_import

    written = []

    def write_one(path: Path, *args: object) -> None:  # the second shard file fails: a full disk
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        write_tensors(path, *args)

    write_tensors = deepspeed_import.write_tensors
    monkeypatch.setattr(deepspeed_import, "write_tensors", write_one)
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="No space left"):
        import_deepspeed(source, tmp_path / "empty")
    assert written and sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "taken"]
    assert list((tmp_path / "empty").iterdir()) == []
    monkeypatch.undo()
    import_deepspeed(source, tmp_path / "empty")  # an empty directory is taken
    assert ShardedCheckpoint(tmp_path / "empty").manifest["global_step"] == 6
