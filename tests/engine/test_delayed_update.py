"""``offload_optimizer.delayed_update`` (the ZeRO-Offload paper's one-step delayed parameter update) against a DDP
reference that runs the delay by hand, at world size 2 (tests/_delayed_cases.py holds the bodies)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from _dist import run_ranks
import _delayed_cases as cases
from lzero import ZeroConfig
from lzero.config import ZeroConfigError

CONFIGS = [{"stage": 1}, {"stage": 2}, {"stage": 2, "acc": 2}, {"stage": 2, "clip": 0.05}, {"stage": 3}]
CONTROL = {"stage": 2, "delayed": False}  # the engine without the delay, against the same reference


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(cases.delayed_against_reference, 2, [*CONFIGS, CONTROL], timeout=300)[0]


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[str(c) for c in CONFIGS])
def test_delayed_update_equals_the_delay_run_by_hand(results: list[dict], index: int) -> None:
    cfg, res = CONFIGS[index], results[index]
    print(cfg, res)
    assert res["in_flight_before_flush"], res  # a step was still running on the worker thread
    # as in test_stage_equivalence: bitwise where DDP's sums are the same two terms; accumulation at stage 2 sums
    # each micro-batch's reduction, and clipping's norm sums the shards, in another order than torch's
    bitwise = cfg.get("acc", 1) == 1 and cfg.get("clip") is None
    if cfg["stage"] < 3:  # after every step, the parameters the next forward uses: those of the step before
        if bitwise:
            assert res["published_equal"] == [True] * cases.STEPS, res
        assert len(res["published_rel"]) == cases.STEPS and max(res["published_rel"]) < 1e-6, res
    if bitwise:
        assert res["bitwise"], res
    assert res["max_rel"] < 1e-6, res


def test_the_reference_tells_a_delayed_run_from_one_without_the_delay(results: list[dict]) -> None:
    res = results[len(CONFIGS)]
    print(CONTROL, res)
    assert not res["in_flight_before_flush"], res
    assert not any(res["published_equal"]), res  # it steps ahead: its parameters are m(t+1), not m(t)
    assert res["max_rel"] > 1e-3, res


@pytest.mark.parametrize("block, match", [
    ({"device": "none", "delayed_update": True}, r"delayed_update=True` with `device: 'none'"),
    ({"device": "nvme", "delayed_update": True}, r"delayed_update=True` with `device: 'nvme'"),
    ({"device": "cpu", "ratio": 0.5, "delayed_update": True}, r"ratio: 0.5"),
    ({"device": "cpu", "delayed_update": "yes"}, r"`offload_optimizer.delayed_update='yes'` must be true or false"),
])
def test_delayed_update_refuses_what_it_cannot_delay(block: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(stage=2, offload_optimizer=block)


def _fit(folder: Path, steps: int, ckpt_path=None, validate: bool = True, clip: float = 0.5, delayed: bool = True):
    """A one-process fit with the delayed update and clipping; step t trains on batch (t - 1) mod 4 whatever the
    resume. ``validate``: validation after steps 3 and 7 and a checkpoint at the end of each 4-step epoch;
    otherwise a checkpoint every 2 steps. Returns the model, the data and the steps at which validation started."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lzero import ZeroStrategy

    class Small(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            i = self.trainer.global_step % 4 * 4
            return nn.functional.mse_loss(self.layer(x[i:i + 4]), y[i:i + 4])

        def validation_step(self, batch, batch_idx):
            self.log("val", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def on_validation_start(self) -> None:
            validated.append(self.trainer.global_step)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1, fused=False)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g)
    validated: list[int] = []
    data = DataLoader(TensorDataset(x, y), batch_size=4)
    model = Small()
    strategy = ZeroStrategy(stage=2, offload_optimizer={"device": "cpu", "delayed_update": delayed})
    checkpoints = ModelCheckpoint(dirpath=folder, save_top_k=-1, **(
        {"every_n_epochs": 1, "save_on_train_epoch_end": True} if validate else {"every_n_train_steps": 2}))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                      val_check_interval=3, limit_val_batches=1 if validate else 0, num_sanity_val_steps=0,
                      use_distributed_sampler=False, callbacks=[checkpoints])
    trainer.fit(model, data, data, ckpt_path=ckpt_path)
    return model, (x, y), validated


def _by_hand(steps: int, data: tuple, flushed: set[int], clip: float = 0.5, undelayed: int = 0) -> dict:
    """The same training with the delay run by hand: each step's gradient at the published parameters, the
    published parameters are the masters before the step, and after the steps in ``flushed`` (validation, a
    checkpoint) and at the end of fit the step in flight is published. The first ``undelayed`` steps run without
    the delay (each published at once)."""
    torch.manual_seed(0)
    published = nn.Linear(3, 2)
    masters = copy.deepcopy(published)
    opt = torch.optim.AdamW(masters.parameters(), lr=0.1, fused=False)
    x, y = data
    for step in range(1, steps + 1):
        i = (step - 1) % 4 * 4
        published.zero_grad()
        nn.functional.mse_loss(published(x[i:i + 4]), y[i:i + 4]).backward()
        torch.nn.utils.clip_grad_norm_(published.parameters(), clip)
        for m, p in zip(masters.parameters(), published.parameters()):
            m.grad = p.grad.clone()
        with torch.no_grad():
            for m, p in zip(masters.parameters(), published.parameters()):
                p.copy_(m)  # the step of the previous call, finished and published
        opt.step()
        if step in flushed or step == steps or step <= undelayed:
            with torch.no_grad():
                for m, p in zip(masters.parameters(), published.parameters()):
                    p.copy_(m)
    return {f"layer.{name}": p for name, p in published.named_parameters()}


def test_fit_with_the_delay_flushes_at_validation_checkpoints_and_the_end(tmp_path: Path, in_process_fit) -> None:
    """Through the Trainer, with clipping: 8 steps equal the delay run by hand with the step in flight finished at
    validation (after steps 3 and 7), at the checkpoints (4 and 8) and at the end of fit, and differ from it
    when the hand-run delay flushes only at the end."""
    model, data, validated = _fit(tmp_path, 8)
    assert validated == [3, 7] and sorted(p.name for p in tmp_path.glob("*.ckpt")) == \
        ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    reference, unflushed = _by_hand(8, data, {3, 4, 7}), _by_hand(8, data, set())
    for name, value in model.named_parameters():
        assert torch.allclose(value, reference[name], rtol=1e-6, atol=1e-7), (name, value, reference[name])
        assert not torch.allclose(value, unflushed[name], rtol=1e-3, atol=1e-4), name


def test_a_run_resumed_with_the_delay_ends_bitwise_where_the_uninterrupted_one_does(
        tmp_path: Path, in_process_fit) -> None:
    """A checkpoint finishes the step in flight, so resuming from it continues exactly as the run that saved it."""
    model, data, _ = _fit(tmp_path / "full", 8, validate=False)
    resumed, _, _ = _fit(tmp_path / "resumed", 8, ckpt_path=tmp_path / "full" / "epoch=0-step=4.ckpt", validate=False)
    reference = _by_hand(8, data, {2, 4, 6})
    for (name, value), (_, full) in zip(resumed.named_parameters(), model.named_parameters()):
        assert torch.equal(value, full), name
        assert torch.allclose(value, reference[name], rtol=1e-6, atol=1e-7), name


def test_a_run_without_the_delay_resumes_with_it(tmp_path: Path, in_process_fit) -> None:
    """The paper's recipe: the first steps without the delay, then on with it from their checkpoint (the checkpoint
    format does not change)."""
    _, data, _ = _fit(tmp_path / "plain", 4, validate=False, delayed=False)
    resumed, _, _ = _fit(tmp_path / "delayed", 8, ckpt_path=tmp_path / "plain" / "epoch=0-step=4.ckpt", validate=False)
    reference = _by_hand(8, data, {6}, undelayed=4)
    for name, value in resumed.named_parameters():
        assert torch.allclose(value, reference[name], rtol=1e-6, atol=1e-7), (name, value, reference[name])
