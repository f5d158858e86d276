"""Several Trainer configurations in one launched script (Lightning re-runs it for the other ranks).

    python tests/lightning/trainer_runs.py SUITE OUT_DIR

Rank 0 writes, for every run, ``OUT_DIR/<run>.pt``: the final parameters, per-step losses,
validation/test metrics and what the strategy reported. tests/test_trainer_*.py compare them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lzero  # noqa: F401  (names; the "fresh interpreter" test covers the import-free path)
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

STEPS = 10


class TiedNet(LightningModule):
    """Tied embedding/head, LayerNorm, BatchNorm buffers, a frozen layer and an optionally unused one.

    With ``use_spare_every=k`` the ``spare`` layer is used in every k-th batch only; in the other
    batches it is skipped (``zero_unused=False``: no gradient at all) or multiplied by zero
    (``zero_unused=True``: a zero gradient, the reference for lzero's unit semantics).
    """

    def __init__(self, use_spare_every: int = 1, zero_unused: bool = False, lr_decay: float = 0.9,
                 batchnorm: bool = True) -> None:
        super().__init__()
        self.use_spare_every = use_spare_every
        self.zero_unused = zero_unused
        self.lr_decay = lr_decay
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.bn = nn.BatchNorm1d(8) if batchnorm else nn.LayerNorm(8)
        self.norm = nn.LayerNorm(8)
        self.spare = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=16)

    def forward(self, x: torch.Tensor, use_spare: bool = True) -> torch.Tensor:
        h = self.bn(self.embed(x).mean(1))  # (B, 8)
        h = self.body(h) + self.frozen(h)
        if use_spare:
            h = h + self.spare(h)
        elif self.zero_unused:
            h = h + 0.0 * self.spare(h)
        return self.head(self.norm(h))  # (B, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x, batch_idx % self.use_spare_every == 0), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.lr_decay**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GAN(LightningModule):
    """Manual optimization with two optimizers and toggle_optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch[0][:, :8].float(), batch[0][:, 8:12].float()
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(opt_g)
        g_loss = bce(self.disc(self.gen(z)), torch.ones(len(z), 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self.gen(z).detach()
        d_loss = bce(self.disc(real), torch.ones(len(z), 1)) + bce(self.disc(fake), torch.zeros(len(z), 1))
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log("train_loss", g_loss + d_loss)

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.SGD(self.disc.parameters(), lr=1e-2,
                                                                                   momentum=0.9))


class LazyNet(LightningModule):
    """Layers created in ``configure_model``: under zero3 they are built on the meta device. With ``init_from``
    (a file of full parameters) the built layers take those values: the DDP reference for a zero3 run."""

    def __init__(self, init_from: str | None = None) -> None:
        super().__init__()
        self.init_from = init_from

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.embed = nn.Embedding(16, 32)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(4)])
        self.head = nn.Linear(32, 16)
        weight = self.blocks[0][1].weight  # under zero3 a fake tensor: no memory, the compute device reported
        self.built_on = (weight.device.type, weight.untyped_storage().device.type)
        if self.init_from is not None:
            self.load_state_dict(torch.load(self.init_from, weights_only=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.blocks(self.embed(x).mean(1))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SaveInitial(Callback):
    """Rank 0 saves the full parameters the model starts training with (gathered under zero3)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with trainer.strategy.gathered_parameters():
            state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(state, self.path)


class Recorder(Callback):
    """Per-step loss and, under lzero, the global gradient norm the strategy reports."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.norm_layer = ""
        self.summary_params = 0
        self.param_dtype = ""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning.pytorch.utilities.model_summary import ModelSummary

        self.norm_layer = type(getattr(pl_module, "bn", None)).__name__
        self.summary_params = ModelSummary(pl_module).total_parameters  # real sizes even when sharded

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if isinstance(trainer.strategy, lzero.ZeroStrategy):
            self.grad_norms.append(trainer.strategy.grad_norm().item())
        else:
            grads = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
            self.grad_norms.append(torch.linalg.vector_norm(torch.stack(grads)).item() if grads else 0.0)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(outputs, dict) and "loss" in outputs:
            self.losses.append(outputs["loss"].item())
        self.param_dtype = str(pl_module.body[0].weight.dtype) if hasattr(pl_module, "body") else ""
        if isinstance(trainer.strategy, lzero.ZeroStrategy) and trainer.strategy.config.stage >= 2:
            leaked = [n for n, p in pl_module.named_parameters() if p.grad is not None]
            if leaked:
                raise AssertionError(f"stage 2 left full gradients on {leaked}")


def data(n: int = 64, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 16, (n, 6), generator=g)
    y = torch.randint(0, 16, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def gan_data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(n, 12, generator=g)), batch_size=4)


def unseeded_init() -> None:
    """Different initial weights on every rank, as an unseeded model has; rank 0's must win."""
    torch.manual_seed(1234 + 7919 * int(os.environ.get("LOCAL_RANK", 0)) + 104729 * int(os.environ.get("NODE_RANK", 0)))


def fit(out: Path, name: str, strategy: Any, model: LightningModule, devices: int, loader: DataLoader,
        val: DataLoader | None = None, ckpt_path: str | None = None, save: bool = False, steps: int = STEPS,
        callbacks_extra: tuple = (), **trainer_kwargs: Any) -> Trainer:
    recorder = Recorder()
    if save and strategy == "zero3":  # after fit, save_checkpoint writes a DDP-format file (default: a directory)
        strategy = lzero.ZeroStrategy(stage=3, checkpoint_format="full")
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder, *callbacks_extra], num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(model, loader, val, ckpt_path=ckpt_path)
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    if save:
        trainer.save_checkpoint(out / f"{name}.ckpt")
    if val is not None:
        trainer.test(model, val, verbose=False)
        metrics.update({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("test")})
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "buffers": {n: b.clone() for n, b in model.named_buffers()},
                    "losses": recorder.losses, "grad_norms": recorder.grad_norms, "metrics": metrics,
                    "norm_layer": recorder.norm_layer, "summary_params": recorder.summary_params,
                    "param_dtype": recorder.param_dtype,
                    "global_step": trainer.global_step}, out / f"{name}.pt")
    return trainer


def suite_ws2(out: Path) -> None:
    """World size 2: DDP vs zero1/zero2, accumulation, clipping, manual GAN, checkpoints."""
    ddp = "ddp_find_unused_parameters_true"
    for acc in (1, 2, 3):
        for strategy in (ddp, "zero1", "zero2", "zero3"):
            unseeded_init()
            fit(out, f"{strategy}_acc{acc}", strategy, TiedNet(), 2, data(), data(16, seed=9),
                accumulate_grad_batches=acc, save=(acc == 1 and strategy in (ddp, "zero2", "zero3")))
    for strategy in (ddp, "zero1", "zero2", "zero3"):
        unseeded_init()
        fit(out, f"{strategy}_unused", strategy, TiedNet(use_spare_every=2, zero_unused=strategy == ddp), 2, data())
    unseeded_init()
    fit(out, f"{ddp}_unused_skipped", ddp, TiedNet(use_spare_every=2), 2, data())
    for strategy in (ddp, "zero1", "zero2", "zero3"):
        unseeded_init()
        fit(out, f"{strategy}_bf16", strategy, TiedNet(batchnorm=False), 2, data(), precision="bf16-mixed",
            save=True)
    for strategy in ("zero1", "zero2", "zero3"):  # embeddings and norms kept in fp32: Lightning's numerics
        unseeded_init()
        fit(out, f"{strategy}_bf16keep", strategy, TiedNet(batchnorm=False), 2, data(),
            plugins=[lzero.ZeroPrecision("bf16-mixed", keep_fp32_modules=["Embedding", "LayerNorm"])])
    lazy = LazyNet()
    fit(out, "zero3_configure_model", "zero3", lazy, 2, data(), steps=20,
        callbacks_extra=[SaveInitial(out / "zero3_configure_model_init.pt")])
    if lazy.trainer.is_global_zero:
        torch.save({"built_on": lazy.built_on}, out / "zero3_configure_model_device.pt")
    fit(out, f"{ddp}_configure_model", ddp, LazyNet(init_from=str(out / "zero3_configure_model_init.pt")), 2, data(),
        steps=20)
    for strategy in (ddp, "zero1", "zero2", "zero3"):
        unseeded_init()
        fit(out, f"{strategy}_clip", strategy, TiedNet(), 2, data(), gradient_clip_val=0.05)
        unseeded_init()
        fit(out, f"{strategy}_clipvalue", strategy, TiedNet(), 2, data(), gradient_clip_val=0.01,
            gradient_clip_algorithm="value")
        unseeded_init()
        fit(out, f"{strategy}_gan", strategy, GAN(), 2, gan_data())
    for source in (ddp, "zero2", "zero3"):
        for strategy in (ddp, "zero1", "zero2", "zero3"):
            fit(out, f"resume_{source}_{strategy}", strategy, TiedNet(), 2, data(),
                ckpt_path=str(out / f"{source}_acc1.ckpt"), steps=2 * STEPS)


def suite_ws1(out: Path) -> None:
    """World size 1: a zero2 checkpoint written at world size 2 resumes under DDP and zero1/zero2."""
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        fit(out, f"ws1_resume_zero2_{strategy}", strategy, TiedNet(), 1, data(),
            ckpt_path=str(out / "zero2_acc1.ckpt"), steps=2 * STEPS)


if __name__ == "__main__":
    suite, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    {"ws2": suite_ws2, "ws1": suite_ws1}[suite](out_dir)
    destroy_process_group()
