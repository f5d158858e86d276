"""DeepSpeed's checkpoints resumed under lzero (issue 49; Lightning re-runs this script for the other ranks).

    python tests/checkpoint/deepspeed_resume_runs.py SUITE OUT_DIR

The fixtures' run (tests/deepspeed_fixtures/README.md): their GPT, the batch of step i on DeepSpeed's rank r drawn
from seed 1000 i + r, the mean cross entropy, AdamW (lr 1e-2, betas (0.9, 0.95), weight decay 0.1), LambdaLR
min(1, (s + 1) / 4), clipping at 1.0; resumed from the step-3 folder and trained to step 6. At world size 1 the two
DeepSpeed ranks' batches are two micro-batches of each step (``accumulate_grad_batches=2``). Every rank writes
``OUT_DIR/<run>_rank<r>.pt`` (its losses, the step, epoch and scheduler state found when training starts, the bytes
it read of DeepSpeed's tensors); the run
saves an lzero checkpoint at step 6 as ``OUT_DIR/<run>``. ``OUT_DIR/imported_<case>`` (written by the test with
``lzero import-deepspeed`` from the case's step-3 folder) are resumed as the folders are.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lzero import ZeroStrategy
from lzero.checkpoint import deepspeed_checkpoint
from lzero.demo.model import GPT, GPTConfig
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

FIXTURES = Path(__file__).resolve().parents[1] / "deepspeed_fixtures"
CONFIG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=3, n_embd=15, dropout=0.0, bias=True)


def tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 65, (2, 9), generator=torch.Generator().manual_seed(1000 * step + rank))


class Resumed(LightningModule):
    """The fixtures' GPT as ``self.model``: DeepSpeed saved the GPT itself (names without ``model.``), Lightning's
    DeepSpeedStrategy this module's (``two_groups``: DemoGPT's groups, decay on the matrices only)."""

    def __init__(self, out: Path, name: str, two_groups: bool) -> None:
        super().__init__()
        self.out, self.name, self.two_groups = out, name, two_groups
        self.model = GPT(CONFIG)
        self.record: dict[str, Any] = {"losses": [], "lrs": []}

    def on_train_start(self) -> None:
        scheduler = self.lr_schedulers()
        self.record.update(start_step=self.trainer.global_step, start_epoch=self.trainer.current_epoch,
                           scheduler_last_epoch=scheduler.last_epoch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # DeepSpeed's rank r's batch; at world size 1, micro-batch r of two (the batch index counts from 0 on resume)
        t = tokens(self.trainer.global_step + 1, self.global_rank if self.trainer.world_size > 1 else batch_idx % 2)
        loss = F.cross_entropy(self.model(t[:, :-1]).float().flatten(0, 1), t[:, 1:].flatten())
        self.record["losses"].append(loss.item())
        self.record["lrs"].append(self.optimizers().param_groups[0]["lr"])
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 6:
            self.trainer.save_checkpoint(self.out / self.name)

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        groups = ([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
                  if self.two_groups else params)
        optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@contextlib.contextmanager
def counted_reads() -> Iterator[list[int]]:
    """Bytes this rank reads of DeepSpeed's tensors (every read of a piece goes through ``_Slice``)."""
    read, count = deepspeed_checkpoint._Slice.read_flat_range, [0]

    def counting(piece: Any, start: int, end: int) -> torch.Tensor:
        values = read(piece, start, end)
        count[0] += values.numel() * values.element_size()
        return values

    deepspeed_checkpoint._Slice.read_flat_range = counting
    try:
        yield count
    finally:
        deepspeed_checkpoint._Slice.read_flat_range = read


def step3(source: str) -> Path:
    """A case's step-3 folder, or a path as it is (an imported checkpoint)."""
    if Path(source).is_absolute():
        return Path(source)
    return FIXTURES / source / ("epoch=0-step=3.ckpt" if source.startswith("lightning") else "global_step3")


def fit(out: Path, name: str, source: str, strategy: Any, devices: int, precision: str) -> None:
    lightning = source.startswith("lightning")
    path = step3(source)
    torch.manual_seed(1)  # not the fixtures' initialization: every value comes from the checkpoint
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread, as the fixtures' processes: a matmul's sums split by thread
    torch.set_num_threads(1)  # (Lightning sets the threads from OMP_NUM_THREADS, else to the cores per rank)
    model = Resumed(out, name, two_groups=lightning)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=6,
                      accumulate_grad_batches=3 - devices, gradient_clip_val=1.0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with counted_reads() as read:
        trainer.fit(model, DataLoader(list(range(64)), batch_size=1), ckpt_path=str(path))
    model.record["bytes_read"] = read[0]
    torch.save(model.record, out / f"{name}_rank{trainer.global_rank}.pt")


def fabric_fit(out: Path, name: str, source: str, strategy: str) -> None:
    """The same through Fabric's ``load``: the GPT itself (DeepSpeed's names), its optimizer, the rest returned."""
    import lightning as L

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    model = fabric.setup_module(GPT(CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                          weight_decay=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    rest = fabric.load(step3(source), {"model": model, "optimizer": optimizer})
    scheduler.load_state_dict(rest["lr_schedulers"][0])
    record: dict[str, Any] = {"losses": [], "lrs": [], "start_step": rest["global_step"],
                              "scheduler_last_epoch": scheduler.last_epoch}
    for step in range(rest["global_step"] + 1, 7):
        t = tokens(step, fabric.global_rank)
        loss = F.cross_entropy(model(t[:, :-1]).float().flatten(0, 1), t[:, 1:].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        record["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        record["losses"].append(loss.item())
    fabric.save(out / name, {"model": model, "optimizer": optimizer})
    torch.save(record, out / f"{name}_rank{fabric.global_rank}.pt")


def main(suite: str, out: Path) -> None:
    if suite == "ws2":
        for stage in (1, 2, 3):
            for kind, precision in (("fp32", "32-true"), ("bf16", "bf16-mixed")):
                fit(out, f"stage{stage}_{kind}", f"stage{stage}_{kind}", ZeroStrategy(stage=stage), 2, precision)
        fit(out, "stage2_fp32_as_zero1", "stage2_fp32", ZeroStrategy(stage=1), 2, "32-true")
        fit(out, "lightning_stage2_fp32", "lightning_stage2_fp32", "zero2", 2, "32-true")
        fabric_fit(out, "fabric_stage3_fp32", "stage3_fp32", "zero3")
        fit(out, "stage2_fp32_imported", str(out / "imported_stage2_fp32"), ZeroStrategy(stage=2), 2, "32-true")
        fabric_fit(out, "fabric_stage3_fp32_imported", str(out / "imported_stage3_fp32"), "zero3")
    elif suite == "ws1":
        fit(out, "stage2_fp32_as_zero3_ws1", "stage2_fp32", ZeroStrategy(stage=3), 1, "32-true")
    destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
