"""Sharded checkpoints under the Trainer: continuation, re-sharding, consolidation, damaged files.

See tests/checkpoint/ckpt_runs.py (a toy regression whose samples are a function of the global step;
``ModelCheckpoint(every_n_train_steps=10, save_last=True)``).
"""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from _launch import run_script, script, script_env
from lzero.checkpoint import CheckpointError
from lzero.checkpoint.consolidate import consolidate, inspect
from lzero.checkpoint.reader import MANIFEST, ShardedCheckpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt_runs")
    for suite, ranks in (("ws2", 2), ("ws1", None), ("ws3", 3), ("ws2b", 2)):  # every Trainer of a suite: `ranks`
        run_script("ckpt_runs.py", suite, str(out), ranks=ranks)
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_continues_bitwise(runs: Path, stage: int) -> None:
    full, resumed = load(runs, f"zero{stage}_full"), load(runs, f"zero{stage}_resumed")
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["losses"] == full["losses"][20:]
    # save_top_k=1 removed the step-10 directory; last.ckpt/ was rewritten in place (manifest commit)
    assert load(runs, f"zero{stage}_first")["files"] == ["epoch=0-step=20.ckpt", "last.ckpt"]
    last = runs / f"zero{stage}_first" / "last.ckpt"
    assert sorted(p.name.split("-")[0] for p in last.iterdir()) == ["manifest.json", "shard", "shard"]


def test_async_save_resumes_bitwise(runs: Path) -> None:
    full, resumed = load(runs, "zero2_full"), load(runs, "zero2_async_resumed")
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["losses"] == full["losses"][20:]
    assert load(runs, "zero2_async_first")["files"] == ["epoch=0-step=20.ckpt", "last.ckpt"]


def test_rank_killed_during_async_save_keeps_the_checkpoint_it_would_replace(runs: Path) -> None:
    """With save_top_k=1, ModelCheckpoint asks to remove step 5 right after the step-10 save returns;
    under async_save that removal waits for the commit, which never comes: step 5 stays loadable."""
    import subprocess

    proc = subprocess.run([sys.executable, str(script("ckpt_runs.py")), "kill_async", str(runs)],
                          capture_output=True, text=True, timeout=300, env=script_env())
    assert proc.returncode != 0
    directory = runs / "killed_async"
    assert ShardedCheckpoint(directory / "epoch=0-step=5.ckpt").manifest["global_step"] == 5
    assert ShardedCheckpoint(directory / "last.ckpt").manifest["global_step"] == 5
    with pytest.raises(CheckpointError, match="never finished"):
        ShardedCheckpoint(directory / "epoch=0-step=10.ckpt")


def test_reshard_zero3_ws2_to_zero1_ws1(runs: Path) -> None:
    ours, ddp, full = (load(runs, n)["params"] for n in ("zero3_to_zero1_ws1", "ddp_to_ddp_ws1", "zero3_full"))
    print(f"zero3 ws2 -> zero1 ws1: vs DDP 2->1 {max_rel(ours, ddp):.2e}, vs uninterrupted {max_rel(ours, full):.2e}")
    assert max_rel(ours, ddp) < 1e-6
    assert max_rel(ours, full) < 1e-3


@pytest.mark.parametrize("source", ["ws1", "ws3"])
def test_reshard_to_world_size_2_at_stage_2(runs: Path, source: str) -> None:
    ours, ddp = load(runs, f"zero2_{source}_to_ws2")["params"], load(runs, f"ddp_{source}_to_ws2")["params"]
    full = load(runs, "zero2_full")["params"]
    print(f"zero2 {source} -> ws2: vs DDP {max_rel(ours, ddp):.2e}, vs uninterrupted {max_rel(ours, full):.2e}")
    assert max_rel(ours, ddp) < 1e-6
    assert max_rel(ours, full) < 1e-3
    # each rank read only the elements it owns: together every element exactly once
    reads = [torch.load(runs / f"reads_{source}_rank{r}.pt") for r in (0, 1)]
    psi = sum(v.numel() for v in full.values())
    assert sum(r["param"] for r in reads) == psi
    assert sum(r["optim"] for r in reads) == 2 * psi  # AdamW's exp_avg and exp_avg_sq
    assert all(r["param"] < 0.6 * psi for r in reads)


def test_consolidate_loads_into_a_plain_module(runs: Path, tmp_path: Path) -> None:
    from skip_runs import Toy

    source = runs / "zero3_first" / "last.ckpt"
    saved = load(runs, "zero3_first")["params"]  # the parameters at step 20, when last.ckpt was written
    consolidate(source, tmp_path / "model.ckpt")
    plain = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert plain["global_step"] == 20 and "pytorch-lightning_version" in plain
    # the loops' progress too, as DDP's weights-only file has it
    from lzero.checkpoint.reader import ShardedCheckpoint

    assert plain["loops"] == ShardedCheckpoint(source).lightning_state()["loops"]
    assert plain["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] > 0
    model = Toy.load_from_checkpoint(tmp_path / "model.ckpt", strict=True)
    reference = Toy({})
    reference.load_state_dict(saved)
    x = torch.randn(5, 8)
    assert torch.equal(model.net(x), reference.net(x))
    for name, value in saved.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    consolidate(source, tmp_path / "model.safetensors")
    from lzero.checkpoint import TensorFile

    flat = TensorFile(tmp_path / "model.safetensors")
    assert sorted(flat.names) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(flat.read(name), value), name
    info = inspect(source)
    assert (info["world_size"], info["stage"], info["global_step"], info["trainable_parameters"]) == (2, 3, 20, 321)


def test_rank_killed_while_rewriting_last_leaves_the_previous_checkpoint(runs: Path) -> None:
    """Rank 1 is SIGKILLed halfway through its shard of last.ckpt/ at step 10 (save_top_k=1,
    rewriting in place): the step-5 manifest and files stay loadable, the resumed run continues
    exactly, and its next save into last.ckpt/ removes the torn leftovers."""
    import subprocess

    proc = subprocess.run([sys.executable, str(script("ckpt_runs.py")), "kill", str(runs)], capture_output=True,
                          text=True, timeout=300, env=script_env())
    assert proc.returncode != 0  # rank 0 sees its peer die
    last = runs / "killed" / "last.ckpt"
    assert ShardedCheckpoint(last).manifest["global_step"] == 5
    assert len(list(last.glob("shard-*"))) == 4  # two committed, rank 0's new one and rank 1's torn one
    assert ShardedCheckpoint(runs / "killed" / "epoch=0-step=10.ckpt").manifest["global_step"] == 10
    run_script("ckpt_runs.py", "after_kill", str(runs), ranks=2)
    after, full = load(runs, "after_kill"), load(runs, "zero2_full")
    assert after["losses"] == full["losses"][5:15]
    names = sorted(p.name for p in last.iterdir())
    assert names[0] == MANIFEST and len(names) == 3
    assert len({n.split("-")[1] for n in names[1:]}) == 1  # one save id: the leftovers are gone


@pytest.mark.parametrize("suite", ["enospc_rank1", pytest.param("enospc_both", marks=pytest.mark.slow)])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path, suite: str) -> None:
    """ENOSPC inside the shard writer at step 4 (zero3, a save every 2 steps), on rank 1 or on both ranks at once:
    every failing rank raises a CheckpointError naming its file and the disk-full error, the other rank names the
    failing ranks, the step-2 checkpoints stay loadable and hold what a run without the fault saved at step 2 (a
    2-step reference run), and the failed save leaves no directory behind."""
    import subprocess

    proc = subprocess.run([sys.executable, str(script("ckpt_runs.py")), suite, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=script_env())
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    failing = (1,) if suite == "enospc_rank1" else (0, 1)
    for rank in (0, 1):
        errors = [ln for ln in output.splitlines() if ln.startswith(f"[rank{rank}]: lzero.checkpoint.files.Checkpoint")]
        assert errors, output[-4000:]
        if rank in failing:
            assert f"Rank {rank} could not write its shard" in errors[-1] and "No space left on device" in errors[-1]
        else:
            assert "Rank(s) [1] could not write their shard" in errors[-1], errors[-1]
        assert "epoch=0-step=4.ckpt" in errors[-1] and "not committed" in errors[-1]
    run = tmp_path / suite
    assert sorted(p.name for p in run.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    reference = ShardedCheckpoint(tmp_path / f"{suite}_reference" / "epoch=0-step=2.ckpt").full_state_dict()
    assert "net.0.weight" in reference
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        checkpoint = ShardedCheckpoint(run / name)
        assert checkpoint.manifest["global_step"] == 2
        state = checkpoint.full_state_dict()
        assert list(state) == list(reference), (name, list(state), list(reference))
        differ = [k for k in state if not torch.equal(state[k], reference[k])]
        assert differ == [], f"{name}: not the uninterrupted run's step-2 values: {differ}"


def test_lightning_pointed_at_a_sharded_directory_says_consolidate(runs: Path) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from skip_runs import Toy

    source = runs / "zero2_first" / "last.ckpt"
    with pytest.raises(IsADirectoryError, match="lzero consolidate"):
        Toy.load_from_checkpoint(source)
    with pytest.raises(IsADirectoryError, match="lzero consolidate"):
        TorchCheckpointIO().load_checkpoint(source)  # what DDPStrategy reads a ckpt_path with


@pytest.fixture
def copy(runs: Path, tmp_path: Path) -> Path:
    target = tmp_path / "last.ckpt"
    shutil.copytree(runs / "zero2_first" / "last.ckpt", target)
    ShardedCheckpoint(target)  # intact
    return target


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("victim", ["manifest", "shard"])
def test_a_pickle_in_place_of_any_file_is_refused_without_running(copy: Path, tmp_path: Path, victim: str) -> None:
    marker = tmp_path / "ran"
    target = copy / MANIFEST if victim == "manifest" else sorted(copy.glob("shard-*"))[1]
    target.write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(CheckpointError):
        ShardedCheckpoint(copy)
    assert not marker.exists()


def test_truncated_shard_is_refused_with_its_name(copy: Path) -> None:
    shard = sorted(copy.glob("shard-*"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=shard.name):
        ShardedCheckpoint(copy)


def test_directory_without_manifest_is_an_unfinished_save(copy: Path) -> None:
    (copy / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="its save never finished"):
        ShardedCheckpoint(copy)


def test_shard_of_another_save_is_refused(copy: Path) -> None:
    shards = sorted(copy.glob("shard-*"))
    other = shards[1].read_bytes().replace(shards[1].name.split("-")[1].encode(), b"0123456789abcdef")
    shards[1].write_bytes(other)
    with pytest.raises(CheckpointError, match="belongs to save"):
        ShardedCheckpoint(copy)


def _small_fit(tmp_path: Path, steps: int, strategy: object, ckpt_path: object = None, precision: str = "32-true",
               hparam: object = None):
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Small(LightningModule):
        def __init__(self, extra: object = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)
    model = Small(hparam)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, precision=precision,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True)])
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model


def test_unsafe_hyperparameter_is_refused_at_save_naming_its_key(tmp_path: Path, in_process_fit) -> None:
    from lzero import ZeroStrategy

    with pytest.raises(CheckpointError, match=r"hyper_parameters\.extra"):
        _small_fit(tmp_path, 2, ZeroStrategy(stage=2), hparam=torch.nn.GELU())
    assert not list(tmp_path.glob("*/manifest.json"))  # nothing committed


def test_ckpt_path_last_and_a_change_of_precision(tmp_path: Path, in_process_fit) -> None:
    from lzero import ZeroStrategy

    _, reference = _small_fit(tmp_path / "ref", 8, ZeroStrategy(stage=2))
    _small_fit(tmp_path / "run", 4, ZeroStrategy(stage=3))
    trainer, resumed = _small_fit(tmp_path / "run", 8, ZeroStrategy(stage=1), ckpt_path="last")
    assert trainer.global_step == 8
    for (name, value), ref in zip(resumed.named_parameters(), reference.parameters()):
        assert torch.equal(value, ref), name
    # the same fp32 checkpoint resumes under bf16-mixed: the fp32 masters are loaded as saved
    loaded, rng_after_load = {}, []

    class Peek(ZeroStrategy):
        def load_optimizer_state_dict(self, checkpoint) -> None:  # right after the parameters were loaded
            super().load_optimizer_state_dict(checkpoint)
            rng_after_load.append(torch.get_rng_state())
            for unit in self.engine.units:
                for spec, a, b, s in unit.spec.owned_pieces(0):
                    loaded[spec.name] = unit.master_shard.detach()[s : s + (b - a)].clone()

    saved_rng = ShardedCheckpoint(tmp_path / "run" / "last.ckpt").tree("rng", 0)
    trainer, _ = _small_fit(tmp_path / "run", 9, Peek(stage=2), precision="bf16-mixed", ckpt_path="last")
    assert torch.equal(rng_after_load[0], saved_rng["torch"])  # this rank's RNG state, restored at load
    assert trainer.global_step == 9 and trainer.strategy.precision_plugin.precision == "bf16-mixed"
    for name, value in reference.named_parameters():  # the fp32 masters, as saved
        assert torch.equal(loaded[name], value.detach().reshape(-1)), name


def test_validate_with_a_sharded_checkpoint_outside_fit(runs: Path, in_process_fit) -> None:
    """validate reads the checkpoint into shards; ``lzero.unshard`` then gives the module every parameter in full."""
    from lightning.pytorch import Trainer
    from skip_runs import Toy, data

    from lzero import ZeroStrategy

    class Checked(Toy):
        def validation_step(self, batch, batch_idx) -> None:
            self.log("v", self.net(torch.ones(4, 8)).float().pow(2).mean())

    model = Checked({})
    trainer = Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    trainer.validate(model, data(), ckpt_path=str(runs / "zero3_first" / "last.ckpt"), verbose=False)
    import lzero

    lzero.unshard(model)
    saved = load(runs, "zero3_first")["params"]
    for name, value in model.named_parameters():
        assert torch.equal(value, saved[name]), name


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt_offload_runs")
    for suite, ranks in (("offload_ws2", 2), ("offload_ws1", None)):
        run_script("ckpt_runs.py", suite, str(out), ranks=ranks)
    return out


@pytest.mark.parametrize("resumed, ddp", [("zero3_offload_to_zero2_offload", "ddp6_to_ddp_ws2"),
                                          ("zero3_offload_to_zero2_ws1", "ddp6_to_ddp_ws1"),
                                          ("zero2_nvme_to_zero3", "ddp6_to_ddp_ws2"),
                                          ("zero3_offload_to_zero3_nvme", "ddp6_to_ddp_ws2")])
def test_zero3_offload_checkpoint_resumes_under_another_stage_offload_and_world_size(offload_runs: Path, resumed: str,
                                                                                    ddp: str) -> None:
    """zero3_offload at world size 2 saved at step 6 (the ordinary sharded format), resumed to step 12 under
    zero2_offload at world size 2 and under zero2 at world size 1, against DDP saved and resumed the same way."""
    ours, ref = load(offload_runs, resumed)["params"], load(offload_runs, ddp)["params"]
    print(f"{resumed}: max relative difference vs {ddp} {max_rel(ours, ref):.2e}")
    assert max_rel(ours, ref) < 1e-6
    assert ShardedCheckpoint(offload_runs / "zero3_offload_first" / "last.ckpt").manifest["global_step"] == 6
    assert list((offload_runs / "swap").iterdir()) == []  # NVMe runs removed their swap folders
