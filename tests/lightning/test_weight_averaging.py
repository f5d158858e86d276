"""Lightning's weight-averaging callbacks at every stage: each rank averages the shard it owns (see [Note: weight
averaging under ZeRO] in lzero/lightning/trainer_averaging.py), bitwise as DDP's whole copy at world size 2
(tests/lightning/averaging_runs.py trains every run in one launched script), through validation, the end of fit,
checkpoints and resumes; the average is its own line of the memory accounting, the size of the shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _launch import run_script
from lzero import ZeroStrategy
from lzero.checkpoint.reader import ShardedCheckpoint

STAGES = ["zero1", "zero2", "zero3", "zero3_offload"]
KINDS = ["ema", "swa"]
LAST = "epoch=2.ckpt"  # after the third (last) training epoch; SWA's BatchNorm epoch follows it


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("averaging_runs")
    run_script("averaging_runs.py", str(out), ranks=2)
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


def assert_equal(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys(), what
    for k, v in ref.items():
        assert torch.equal(ours[k], v), f"{what} `{k}`: max |diff| {(ours[k].float() - v.float()).abs().max():.3e}"


def ddp_checkpoint(runs: Path, name: str) -> dict:
    return torch.load(runs / name / LAST, weights_only=False)  # Lightning's own file, written by this test's run


def current_weights(reader: ShardedCheckpoint) -> dict:
    """A sharded checkpoint's current parameters (``param/<name>``) and the tensors outside every unit that
    WeightAveraging's ``current_model_state`` holds."""
    params = {n: reader.read_range(f"param/{n}", 0, p["numel"]).view(p["shape"])
              for n, p in reader.manifest["params"].items()}
    return {**params, **reader.lightning_state()["current_model_state"]}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_averaged_weights_and_validation_losses_equal_ddp(runs: Path, kind: str, stage: str) -> None:
    """After fit the model holds the average (EMA and SWA's ``on_train_end``; SWA's BatchNorm epoch ran on it),
    and every validation loss on rank 0 (under EMA computed with the average swapped in) is DDP's, bit for bit."""
    ref, ours = load(runs, f"{kind}_ddp"), load(runs, f"{kind}_{stage}")
    assert ref["global_step"] == (12 if kind == "ema" else 13)  # 3 epochs of 4 steps; SWA's BatchNorm epoch: 1 more
    assert ours["global_step"] == ref["global_step"]
    assert_equal(ours["params"], ref["params"], "parameter")
    assert_equal(ours["buffers"], ref["buffers"], "buffer")
    assert ours["val_losses"] == ref["val_losses"] and len(ref["val_losses"]) == (6 if kind == "ema" else 8)


@pytest.mark.parametrize("kind", ["wa", "wa_multi"])
def test_weight_averaging_with_torchs_average_and_a_multi_avg_fn_equals_ddp(runs: Path, kind: str) -> None:
    """``WeightAveraging()`` (torch's equal-weight average, buffers averaged) and ``WeightAveraging(multi_avg_fn=...,
    use_buffers=False)`` (buffers copied) at zero3."""
    ref, ours = load(runs, f"{kind}_ddp"), load(runs, f"{kind}_zero3")
    assert_equal(ours["params"], ref["params"], "parameter")
    assert_equal(ours["buffers"], ref["buffers"], "buffer")
    assert ours["val_losses"] == ref["val_losses"]


def test_ema_with_sgd_at_zero2_offload_equals_ddp(runs: Path) -> None:
    """The optimizer offloaded to host memory (SGD with momentum): the averages live there too."""
    ref, ours = load(runs, "ema_sgd_ddp"), load(runs, "ema_sgd_zero2_offload")
    assert_equal(ours["params"], ref["params"], "parameter")
    assert ours["val_losses"] == ref["val_losses"]


@pytest.mark.parametrize("stage", STAGES)
def test_ema_sharded_checkpoint_holds_ddps_model_state(runs: Path, stage: str) -> None:
    """DDP's file holds the average as ``state_dict`` and the current weights as ``current_model_state``; the
    sharded checkpoint holds them as pieces (``average/<name>``, ``param/<name>``) and reads back as the same two,
    with ``n_averaged`` (12 updates)."""
    ref = ddp_checkpoint(runs, "ema_ddp")
    reader = ShardedCheckpoint(runs / f"ema_{stage}" / LAST)
    assert reader.has_average
    assert_equal(reader.full_state_dict(), ref["state_dict"], "state_dict")
    assert_equal(current_weights(reader), ref["current_model_state"], "current_model_state")
    assert not torch.equal(ref["state_dict"]["head.weight"], ref["current_model_state"]["head.weight"])
    assert reader.lightning_state()["averaging_state"]["n_averaged"] == ref["averaging_state"]["n_averaged"] == 12


def test_ema_sharded_checkpoint_consolidates_to_the_average(runs: Path, tmp_path: Path) -> None:
    """``lzero consolidate`` (what ``load_from_checkpoint`` and export read too) writes the average as DDP's file
    holds it."""
    from lzero.checkpoint.consolidate import consolidate

    out = consolidate(runs / "ema_zero3" / LAST, tmp_path / "plain.ckpt")
    assert_equal(torch.load(out, weights_only=True)["state_dict"], ddp_checkpoint(runs, "ema_ddp")["state_dict"],
                 "state_dict")


@pytest.mark.parametrize("stage", STAGES)
def test_swa_sharded_checkpoint_holds_ddps_model_state_and_average(runs: Path, stage: str) -> None:
    """SWA keeps the current weights as the model state and its average model in the callback's state: the sharded
    checkpoint's model state is DDP's, and its ``average/<name>`` pieces are DDP's averaged parameters."""
    ref = ddp_checkpoint(runs, "swa_ddp")
    reader = ShardedCheckpoint(runs / f"swa_{stage}" / LAST)
    assert_equal(reader.full_state_dict(), ref["state_dict"], "state_dict")
    key = next(k for k in ref["callbacks"] if k.startswith("StochasticWeightAveraging"))
    saved, ours = ref["callbacks"][key], reader.lightning_state()["callbacks"][key]
    averages = {n: reader.read_range(f"average/{n}", 0, p["numel"]).view(p["shape"])
                for n, p in reader.manifest["params"].items()}
    assert_equal(averages, {n: saved["average_model_state"][n] for n in averages}, "average")
    assert ours["n_averaged"] == saved["n_averaged"] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_full_checkpoint_file_equals_ddps(runs: Path, kind: str) -> None:
    """``checkpoint_format="full"`` at zero3: one file on rank 0 with DDP's keys and values (averages gathered)."""
    ref = ddp_checkpoint(runs, f"{kind}_ddp")
    ours = torch.load(runs / f"{kind}_zero3_full" / LAST, weights_only=False)
    assert_equal(ours["state_dict"], ref["state_dict"], "state_dict")
    if kind == "ema":
        assert_equal(ours["current_model_state"], ref["current_model_state"], "current_model_state")
        assert ours["averaging_state"]["n_averaged"] == ref["averaging_state"]["n_averaged"]
    else:
        key = next(k for k in ref["callbacks"] if k.startswith("StochasticWeightAveraging"))
        assert_equal(ours["callbacks"][key]["average_model_state"], ref["callbacks"][key]["average_model_state"],
                     "average_model_state")


@pytest.mark.parametrize("resume", ["resume_zero3", "resume_zero3_at_zero1", "resume_ddp_at_zero3"])
@pytest.mark.parametrize("kind", KINDS)
def test_resume_mid_run_keeps_the_average(runs: Path, kind: str, resume: str) -> None:
    """Resumed after epoch 1 from zero3's sharded checkpoint (at zero3, and re-sharded by name at zero1) or from
    DDP's file (at zero3): the final averaged weights, and the last epoch's validation losses, are those of the
    uninterrupted run, bit for bit."""
    ref, ours = load(runs, f"{kind}_ddp"), load(runs, f"{kind}_{resume}")
    assert ours["global_step"] == ref["global_step"]
    assert_equal(ours["params"], ref["params"], "parameter")
    assert_equal(ours["buffers"], ref["buffers"], "buffer")
    assert ours["val_losses"] == ref["val_losses"][-len(ours["val_losses"]):] and ours["val_losses"]


@pytest.mark.parametrize(("run", "store"), [("ema_zero3", "device"), ("ema_zero3_offload", "cpu"),
                                            ("swa_zero3_offload", "cpu")])
def test_the_average_is_a_memory_line_the_size_of_the_shard(runs: Path, run: str, store: str) -> None:
    """``memory/<store>/averages_bytes/rank<r>``: fp32 x the elements a rank owns, where the masters live (host
    memory when the optimizer is offloaded), on both ranks at every logged step; zero elsewhere."""
    found = load(runs, run)
    owned = found["shard_numel"]
    assert owned > 0
    other = "cpu" if store == "device" else "device"
    for rank in (0, 1):
        logged = found["memory"][f"memory/{store}/averages_bytes/rank{rank}"]
        assert [s for s, _ in logged] == [2, 4, 6, 8, 10, 12]
        assert all(v == 4 * owned for _, v in logged), (logged, owned)
        assert all(v == 0 for _, v in found["memory"].get(f"memory/{other}/averages_bytes/rank{rank}", []))


# --- world size 1, in the test's process ---------------------------------------------------------------------------


class TwoBlocks(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.blocks(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(strategy: Any, averaging: Callback) -> Trainer:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, callbacks=[averaging],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TwoBlocks(), data)
    return trainer


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_swa_and_ema_at_world_size_1_equal_ddp(in_process_fit, stage: int) -> None:
    for make in (lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
                 lambda: EMAWeightAveraging(decay=0.5)):
        trainer, reference = fit(ZeroStrategy(stage=stage), make()), fit("ddp", make())
        assert trainer.global_step == reference.global_step == 8
        from lzero import unshard

        unshard(trainer.lightning_module)
        for p, q in zip(trainer.lightning_module.parameters(), reference.lightning_module.parameters(), strict=True):
            assert torch.equal(p, q)


def fit_net(strategy: Any, **trainer_kwargs: Any) -> tuple[dict, list]:
    from averaging_runs import Net, data

    torch.manual_seed(0)
    model = Net()
    Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False,
            callbacks=[EMAWeightAveraging(decay=0.8)], enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs).fit(model, data(32, 0), data(16, 9))
    from lzero import unshard

    unshard(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model.val_losses


@pytest.mark.parametrize("how", ["nvme", "delayed_update", "bf16-mixed"])
def test_ema_at_world_size_1_with_nvme_the_delayed_update_and_bf16_mixed_equals_ddp(in_process_fit, tmp_path: Path,
                                                                                      how: str) -> None:
    """Masters in swap files (the averages in host memory), the host step finished before each update (delayed
    update), fp32 masters and averages under bf16 compute: DDP's averaged weights and validation losses."""
    from lzero import ZeroPrecision

    if how == "nvme":
        swap = {"device": "nvme", "nvme_path": str(tmp_path)}
        ours = fit_net(ZeroStrategy(stage=3, offload_optimizer=swap, offload_param=swap))
        ref = fit_net("ddp")
    elif how == "delayed_update":
        ours = fit_net(ZeroStrategy(stage=2, offload_optimizer={"device": "cpu", "delayed_update": True}))
        ref = fit_net("ddp")
    else:
        ours = fit_net("zero3", plugins=[ZeroPrecision("bf16-mixed", keep_fp32_modules=["BatchNorm1d"])])
        ref = fit_net("ddp", precision="bf16-mixed")
    assert_equal(ours[0], ref[0], "parameter")
    assert ours[1] == ref[1]


class AverageAtStart(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        average = trainer.strategy.engine.average
        self.pieces = {spec.name: (a, b, piece.clone()) for spec, a, b, piece in average.pieces()}
        self.n_averaged = int(trainer.callbacks[0]._average_model.n_averaged)


def test_the_average_resumes_at_world_size_1(runs: Path, in_process_fit) -> None:
    """zero3's sharded checkpoint of world size 2, resumed at world size 1 under zero2: the one rank's averaged
    shards hold every parameter's whole average, read from both ranks' ``average/<name>`` pieces."""
    from averaging_runs import Net, data

    checkpoint = runs / "ema_zero3" / "epoch=1.ckpt"
    probe = AverageAtStart()
    torch.manual_seed(0)
    Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=1, max_epochs=3, logger=False,
            callbacks=[EMAWeightAveraging(decay=0.8), probe], enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0).fit(Net(), data(32, 0), ckpt_path=str(checkpoint))
    reader = ShardedCheckpoint(checkpoint)
    assert probe.pieces.keys() == reader.manifest["params"].keys()
    for name, (a, b, piece) in probe.pieces.items():
        assert (a, b) == (0, reader.manifest["params"][name]["numel"])
        assert torch.equal(piece, reader.read_range(f"average/{name}", 0, b)), name
        assert torch.equal(piece, reader.full_state_dict()[name].reshape(-1)), name  # the checkpoint's model state
    assert probe.n_averaged == 8  # 2 epochs of 4 steps


def test_two_averaging_callbacks_are_refused(in_process_fit) -> None:
    from lzero import ZeroConfigError

    with pytest.raises(ZeroConfigError, match=r"2 weight-averaging callbacks .*HINT: keep one"):
        data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
        Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=1, max_epochs=1, logger=False,
                callbacks=[EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=0.05)], enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False).fit(TwoBlocks(), data)
