"""``lzero consolidate`` / ``lzero inspect`` on what users actually pass: a sharded checkpoint with frozen
parameters, a plain .ckpt, a file inside a checkpoint, a folder of checkpoints, a missing path, and
output paths that cannot be written. Every refusal happens before anything is written."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from lzero.cli import main

FROZEN = 64 * 64 + 64  # the frozen base layer
BUFFERS = 3
TRAINABLE = 64 * 2 + 2 * 64  # the low-rank adapter


def _fit_and_save(directory: Path) -> None:
    """A LoRA-like model: a frozen base layer, a trainable adapter and a buffer. One step under zero2
    writes ``sharded.ckpt/`` (during fit) and ``plain.ckpt`` (after fit, one full file)."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    class LoRA(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(64, 64).requires_grad_(False)
            self.down, self.up = nn.Linear(64, 2, bias=False), nn.Linear(2, 64, bias=False)
            self.register_buffer("scale", torch.ones(BUFFERS))

        def training_step(self, batch, batch_idx):
            return (self.base(batch[0]) + self.up(self.down(batch[0]))).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad])

    class Save(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.save_checkpoint(directory / "sharded.ckpt")

    trainer = Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=1, callbacks=[Save()], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LoRA(), DataLoader(TensorDataset(torch.randn(4, 64)), batch_size=4))
    trainer.save_checkpoint(directory / "plain.ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed as dist

    directory = tmp_path_factory.mktemp("lora")
    environ = dict(os.environ)
    try:
        _fit_and_save(directory)
    finally:  # as the in_process_fit fixture: later launched scripts must not inherit these
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return directory


@pytest.fixture
def work(saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh copy to run in: the checkpoint, the plain file, a folder of two checkpoints, junk."""
    shutil.copytree(saved / "sharded.ckpt", tmp_path / "sharded.ckpt")
    shutil.copy(saved / "plain.ckpt", tmp_path / "plain.ckpt")
    for name in ("epoch=0-step=1.ckpt", "last.ckpt"):
        shutil.copytree(saved / "sharded.ckpt", tmp_path / "checkpoints" / name)
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_inspect_counts_trainable_and_frozen_parameters(work: Path, capsys: pytest.CaptureFixture) -> None:
    from lzero.checkpoint.consolidate import inspect

    info = inspect(work / "sharded.ckpt")
    assert (info["trainable_parameters"], info["frozen_parameters_and_buffers"], info["total_parameters"]) == (
        TRAINABLE, FROZEN + BUFFERS, TRAINABLE + FROZEN + BUFFERS)
    assert main(["inspect", "sharded.ckpt"]) == 0
    out = capsys.readouterr().out
    assert f"trainable_parameters: {TRAINABLE}\n" in out and f"total_parameters: {TRAINABLE + FROZEN + BUFFERS}\n" in out
    # zero2 at world size 1, fp32 AdamW (two 4-byte moments read from the checkpoint): 4 + 8 bytes per trainable
    # parameter between steps (the frozen base is not a model state lzero shards below stage 3)
    assert info["model_states_bytes_per_rank"] == 12 * TRAINABLE
    needs = info["resume_needs"]
    assert needs[(2, 2)] == 4 * TRAINABLE + 8 * TRAINABLE // 2  # parameters whole, moments sharded
    # stage 3 shards everything; a zero1/2 checkpoint does not tell frozen parameters from buffers, so its frozen
    # base is not counted (a zero3 checkpoint marks them)
    assert needs[(3, 4)] == (4 * TRAINABLE + 8 * TRAINABLE) // 4
    assert f"  zero3{needs[(3, 1)]:>16,}" in out.replace("N=", "")  # the table row

@pytest.mark.parametrize("source, message", [
    ("plain.ckpt", r"`plain.ckpt` is a single torch.save file \(a plain Lightning/DDP checkpoint\), not an lzero sharded"
                   r" checkpoint\. (It is already one full file and needs no consolidation\. HINT: use `plain.ckpt` as it"
                   r" is .*`lzero consolidate plain.ckpt out.safetensors`|`lzero inspect` reads sharded checkpoint"
                   r" directories\. HINT: look inside with `torch.load)"),
    ("sharded.ckpt/manifest.json", r"`sharded.ckpt/manifest.json` is a file inside the lzero checkpoint `sharded.ckpt`\."
                                   r" HINT: pass the checkpoint directory itself: `lzero (consolidate|inspect) sharded.ckpt"),
    ("missing.ckpt", r"`missing.ckpt` does not exist\. HINT: check the path"),
    ("checkpoints", r"`checkpoints` is a folder of lzero checkpoints \(`epoch=0-step=1.ckpt`, `last.ckpt`\), not one"
                    r" checkpoint\. HINT: pass one of them: `lzero (consolidate|inspect) checkpoints/last.ckpt"),
    ("junk.bin", r"`junk.bin` is neither an lzero checkpoint \(a directory holding manifest.json\) nor a torch.save"),
])
@pytest.mark.parametrize("command", ["consolidate", "inspect"])
def test_inputs_that_are_not_sharded_checkpoints_are_named(work: Path, capsys: pytest.CaptureFixture, command: str,
                                                           source: str, message: str) -> None:
    before = listing(work)
    assert main([command, source, *(["out.ckpt"] if command == "consolidate" else [])]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lzero {command}: ") and "has no manifest.json" not in err
    assert re.search(message, err), err
    assert listing(work) == before


@pytest.mark.parametrize("out, message", [
    ("missing/model.ckpt", r"The output's folder `missing` does not exist\. HINT: create it first \(`mkdir -p missing`\)"),
    ("sharded.ckpt", r"The output `sharded.ckpt` is the checkpoint itself\. HINT: name another file"),
    ("sharded.ckpt/model.ckpt", r"The output `sharded.ckpt/model.ckpt` is inside the checkpoint `sharded.ckpt`"),
    ("checkpoints/last.ckpt", r"The output `checkpoints/last.ckpt` is an lzero checkpoint directory\. HINT: name a new"),
    ("checkpoints.pt", None),  # replaced by a directory below
    ("model.txt", r"Cannot tell the format of `model.txt`\. HINT: end the output name with .ckpt, .pt, .pth \(torch.save\)"
                  r" or .safetensors"),
])
def test_bad_outputs_are_refused_before_writing(work: Path, capsys: pytest.CaptureFixture, out: str,
                                                 message: str | None) -> None:
    if message is None:
        (work / out).mkdir()
        message = r"The output `checkpoints.pt` is a directory\. HINT: name a file"
    before = listing(work)
    assert main(["consolidate", "sharded.ckpt", out]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert listing(work) == before  # no .partial, nothing inside the checkpoint


def test_pth_is_torch_save_as_pt(work: Path) -> None:
    """``.pth`` (PyTorch's usual name, litgpt's ``lit_model.pth``) writes what ``.pt`` writes."""
    assert main(["consolidate", "sharded.ckpt", "model.pt"]) == 0
    assert main(["consolidate", "sharded.ckpt", "model.pth"]) == 0
    pt, pth = (torch.load(work / name, weights_only=True) for name in ("model.pt", "model.pth"))
    assert pth.keys() == pt.keys() and pth["state_dict"].keys() == pt["state_dict"].keys()
    assert all(torch.equal(pth["state_dict"][k], pt["state_dict"][k]) for k in pt["state_dict"])
    assert sum(t.numel() for t in pth["state_dict"].values()) == TRAINABLE + FROZEN + BUFFERS


def test_fabric_save_consolidates_to_the_plain_state_dict(tmp_path: Path) -> None:
    """A Fabric save (litgpt's ``final/lit_model.pth``) consolidates to ``torch.save(model.state_dict())``'s content,
    which ``fabric.load_raw``, ``model.load_state_dict`` and litgpt's ``load_checkpoint`` read."""
    import subprocess
    import sys

    script = (f"import torch, lightning as L\n"
              f"fabric = L.Fabric(strategy='zero3', accelerator='cpu', devices=1)\n"
              f"fabric.launch()\n"
              f"torch.manual_seed(0)\n"
              f"model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))\n"
              f"opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))\n"
              f"fabric.backward(model(torch.randn(4, 8)).sum()); opt.step()\n"
              f"fabric.save({str(tmp_path / 'lit_model.pth')!r}, {{'model': model, 'optimizer': opt, 'iter_num': 1}})\n"
              f"torch.save(model.state_dict(), {str(tmp_path / 'reference.pt')!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["consolidate", str(tmp_path / "lit_model.pth"), str(tmp_path / "out.pth")]) == 0
    written, reference = torch.load(tmp_path / "out.pth", weights_only=True), torch.load(tmp_path / "reference.pt")
    assert written.keys() == reference.keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert all(torch.equal(written[k], reference[k]) for k in reference)


def test_plain_file_converts_to_safetensors(work: Path) -> None:
    from lzero.checkpoint import TensorFile

    assert main(["consolidate", "plain.ckpt", "model.safetensors"]) == 0
    state = torch.load(work / "plain.ckpt", weights_only=True)["state_dict"]
    converted = TensorFile(work / "model.safetensors")
    assert sorted(converted.names) == sorted(state) and all(torch.equal(converted.read(k), state[k]) for k in state)
    assert sum(math.prod(converted.entry(k).shape) for k in state) == TRAINABLE + FROZEN + BUFFERS
    # a bare state dict with tied weights: stored once, the other key in the aliases metadata
    weight = torch.randn(3, 4)
    torch.save({"embed.weight": weight, "head.weight": weight, "head.bias": torch.zeros(3)}, work / "tied.pt")
    assert main(["consolidate", "tied.pt", "tied.safetensors"]) == 0
    tied = TensorFile(work / "tied.safetensors")
    assert sorted(tied.names) == ["embed.weight", "head.bias"] and torch.equal(tied.read("embed.weight"), weight)
    assert json.loads(tied.metadata["aliases"]) == {"head.weight": "embed.weight"}
