"""Sharded checkpoints: continuation and re-sharding (Lightning re-runs this script for the other ranks).

    python tests/checkpoint/ckpt_runs.py SUITE OUT_DIR

The toy model of skip_runs.py, whose samples are a function of the global step (the same global
batch of 12 at every world size). ``ModelCheckpoint(every_n_train_steps=10, save_last=True)``
writes the checkpoints. Rank 0 writes ``OUT_DIR/<run>.pt`` with the final parameters and losses.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from skip_runs import Record, Toy, data  # noqa: E402

import lzero
from lzero import ZeroStrategy  # noqa: E402
from _teardown import destroy_process_group  # a sibling: scripts run from their folder


def fit(out: Path, name: str, strategy: object, devices: int, steps: int, resume: Optional[str] = None,
        every: int = 10, dirpath: Optional[Path] = None) -> None:
    torch.manual_seed(0)
    model = Toy({})
    record = Record() if strategy != "ddp" else None
    checkpoints = ModelCheckpoint(dirpath=dirpath or out / name, every_n_train_steps=every, save_last=True)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[checkpoints] + ([record] if record else []))
    trainer.fit(model, data(), ckpt_path=resume)
    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "losses": [r["loss"] for r in record.rows] if record else [],
                    "files": sorted(p.name for p in (dirpath or out / name).iterdir())}, out / f"{name}.pt")


def main(suite: str, out: Path) -> None:
    zero = {s: (lambda s=s: ZeroStrategy(stage=s)) for s in (1, 2, 3)}
    if suite == "ws2":
        for stage in (1, 2, 3):
            fit(out, f"zero{stage}_full", zero[stage](), 2, steps=30)
            fit(out, f"zero{stage}_first", zero[stage](), 2, steps=20)
            fit(out, f"zero{stage}_resumed", zero[stage](), 2, steps=30,
                resume=str(out / f"zero{stage}_first" / "last.ckpt"))
        fit(out, "ddp_first", "ddp", 2, steps=20)
        fit(out, "zero2_async_first", ZeroStrategy(stage=2, async_save=True), 2, steps=20)
        fit(out, "zero2_async_resumed", ZeroStrategy(stage=2, async_save=True), 2, steps=30,
            resume=str(out / "zero2_async_first" / "last.ckpt"))
    elif suite == "ws1":  # 2 -> 1: zero3 -> zero1 and DDP -> DDP; and the world-size-1 saves for 1 -> 2
        fit(out, "zero3_to_zero1_ws1", zero[1](), 1, steps=30, resume=str(out / "zero3_first" / "last.ckpt"))
        fit(out, "ddp_to_ddp_ws1", "ddp", 1, steps=30, resume=str(out / "ddp_first" / "last.ckpt"))
        fit(out, "zero2_first_ws1", zero[2](), 1, steps=20)
        fit(out, "ddp_first_ws1", "ddp", 1, steps=20)
    elif suite == "ws3":  # world size 3, micro batch 4, saved for 3 -> 2
        fit(out, "zero2_first_ws3", zero[2](), 3, steps=20)
        fit(out, "ddp_first_ws3", "ddp", 3, steps=20)
    elif suite == "ws2b":  # 1 -> 2 and 3 -> 2 at stage 2, against DDP resumed the same way
        for source in ("ws1", "ws3"):
            with count_reads() as reads:
                fit(out, f"zero2_{source}_to_ws2", zero[2](), 2, steps=30,
                    resume=str(out / f"zero2_first_{source}" / "last.ckpt"))
            torch.save(reads, out / f"reads_{source}_rank{torch.distributed.get_rank()}.pt")
            fit(out, f"ddp_{source}_to_ws2", "ddp", 2, steps=30, resume=str(out / f"ddp_first_{source}" / "last.ckpt"))
    elif suite == "offload_ws2":  # zero3_offload saved at step 6, resumed under zero2_offload (and DDP -> DDP)
        fit(out, "zero3_offload_first", "zero3_offload", 2, steps=6, every=6)
        fit(out, "ddp_first6", "ddp", 2, steps=6, every=6)
        fit(out, "zero3_offload_to_zero2_offload", "zero2_offload", 2, steps=12,
            resume=str(out / "zero3_offload_first" / "last.ckpt"))
        fit(out, "ddp6_to_ddp_ws2", "ddp", 2, steps=12, resume=str(out / "ddp_first6" / "last.ckpt"))
        # NVMe: saved from the swap files, resumed without offload; and a host-offload checkpoint resumed on NVMe
        nvme = {"device": "nvme", "nvme_path": str(out / "swap")}
        fit(out, "zero2_nvme_first", ZeroStrategy(stage=2, offload_optimizer=nvme), 2, steps=6, every=6)
        fit(out, "zero2_nvme_to_zero3", zero[3](), 2, steps=12, resume=str(out / "zero2_nvme_first" / "last.ckpt"))
        fit(out, "zero3_offload_to_zero3_nvme", ZeroStrategy(stage=3, offload_optimizer=nvme), 2, steps=12,
            resume=str(out / "zero3_offload_first" / "last.ckpt"))
    elif suite == "offload_ws1":  # ... and under zero2 at world size 1
        fit(out, "zero3_offload_to_zero2_ws1", zero[2](), 1, steps=12, resume=str(out / "zero3_offload_first" / "last.ckpt"))
        fit(out, "ddp6_to_ddp_ws1", "ddp", 1, steps=12, resume=str(out / "ddp_first6" / "last.ckpt"))
    elif suite == "kill":  # rank 1 dies while rewriting last.ckpt/ in place at step 10
        die_while_writing(rank=1, call=4)  # writes: step 5 (epoch=0-step=5.ckpt, last.ckpt), step 10 (the same)
        fit(out, "killed", zero[2](), 2, steps=20, every=5)
    elif suite == "kill_async":  # rank 1 dies on the writer thread during the step-10 save (save_top_k=1)
        die_while_writing(rank=1, call=3)
        fit(out, "killed_async", ZeroStrategy(stage=2, async_save=True), 2, steps=20, every=5)
    elif suite in ("enospc_rank1", "enospc_both"):  # the disk fills while writing epoch=0-step=4.ckpt/ (3rd write)
        fit(out, f"{suite}_reference", zero[3](), 2, steps=2, every=2)  # what the surviving step-2 saves must hold
        disk_full_while_writing(ranks=(1,) if suite == "enospc_rank1" else (0, 1), call=3)
        fit(out, suite, zero[3](), 2, steps=8, every=2)
    elif suite == "after_kill":  # resume from what the killed run left, saving into the same directory
        fit(out, "after_kill", zero[2](), 2, steps=15, every=5, resume=str(out / "killed" / "last.ckpt"),
            dirpath=out / "killed")


@contextlib.contextmanager
def count_reads() -> Iterator[dict[str, int]]:
    """Elements of parameters and optimizer state this rank reads from checkpoint files."""
    from lzero.checkpoint.files import TensorFile

    original, counts = TensorFile.read_flat_range, {"param": 0, "optim": 0}

    def read_flat_range(self, name, start, end):  # type: ignore[no-untyped-def]
        kind = name.split("/")[0]
        if kind in counts:
            counts[kind] += end - start
        return original(self, name, start, end)

    TensorFile.read_flat_range = read_flat_range
    try:
        yield counts
    finally:
        TensorFile.read_flat_range = original


def die_while_writing(rank: int, call: int) -> None:
    """SIGKILL this process, on ``rank``, in the middle of its ``call``-th shard write: half a file left."""
    import os
    import signal

    import lzero.checkpoint.sharded as sharded

    original, calls = sharded.write_tensors, []

    def write_tensors(path, tensors, metadata):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == call and int(os.environ.get("LOCAL_RANK", 0)) == rank:
            Path(path).write_bytes(b"\x00" * 64)  # a torn shard
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, tensors, metadata)

    sharded.write_tensors = write_tensors


def disk_full_while_writing(ranks: tuple[int, ...], call: int) -> None:
    """On ``ranks``, the ``call``-th shard write fails with ENOSPC after its header and first tensors are written:
    the writer's own error path runs, as when the disk fills mid-file."""
    import errno
    import os

    import lzero.checkpoint.sharded as sharded

    original, calls = sharded.write_tensors, []

    class Full:
        def __init__(self, t: torch.Tensor) -> None:
            self.dtype, self.shape = t.dtype, t.shape

        def materialize(self) -> torch.Tensor:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write_tensors(path, tensors, metadata):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == call and int(os.environ.get("LOCAL_RANK", 0)) in ranks:
            last = list(tensors)[-1]
            tensors = {**tensors, last: Full(tensors[last])}
        return original(path, tensors, metadata)

    sharded.write_tensors = write_tensors


if __name__ == "__main__":
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    main(sys.argv[1], out_dir)
    destroy_process_group()
