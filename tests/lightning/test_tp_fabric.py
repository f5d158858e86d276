"""Tensor parallel through Fabric's door (``ZeroFabricStrategy(tensor_parallel_size=2, parallelize_fn=...)``, the
contract of Fabric's ``ModelParallelStrategy``): at tp2 x dp2, zero1, zero2 and zero3 train the small block as one
process does on the same global batches (losses and gradient norms within 1e-5 relative, the saved parameters too),
bitwise alike; ``fabric.save`` and ``fabric.load`` resume at step 2 bitwise. See [Note: tensor parallel under ZeRO] in
lzero/engine/tensor_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import run_script
from lzero import ZeroConfigError
from lzero.lightning.fabric_strategy import ZeroFabricStrategy

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp_fabric_runs")
    run_script("tp_fabric_runs.py", str(out), ranks=4)
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _whole(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    from lzero.cli import main

    assert main(["consolidate", str(checkpoint), str(tmp_path / "whole.pt")]) == 0
    return torch.load(tmp_path / "whole.pt", weights_only=True)  # a Fabric checkpoint: the module's state dict


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fabric_tensor_parallel_equals_one_process(runs: Path, tmp_path: Path, stage: int) -> None:
    got = torch.load(runs / f"fabric_zero{stage}.pt", weights_only=True)
    want = torch.load(runs / "reference_dp2.pt", weights_only=True)
    for key in ("losses", "norms"):
        assert _relative(torch.tensor(got[key]), torch.tensor(want[key])) <= TOLERANCE, (key, got[key], want[key])
    params = _whole(runs / f"fabric_zero{stage}_step4.ckpt", tmp_path)
    assert params.keys() == want["params"].keys()
    for name, value in want["params"].items():
        assert _relative(params[name], value) <= TOLERANCE, name
    assert got["resumed"] == got["losses"][2:]  # fabric.load at step 2: steps 3 and 4 again, bitwise


@pytest.mark.parametrize("stage", [2, 3])
def test_fabric_stages_are_bitwise_alike(runs: Path, tmp_path: Path, stage: int) -> None:
    one = torch.load(runs / "fabric_zero1.pt", weights_only=True)
    other = torch.load(runs / f"fabric_zero{stage}.pt", weights_only=True)
    assert one["losses"] == other["losses"] and one["norms"] == other["norms"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = _whole(runs / "fabric_zero1_step4.ckpt", tmp_path / "a"), \
        _whole(runs / f"fabric_zero{stage}_step4.ckpt", tmp_path / "b")
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("options, match", [
    ({"stage": 2, "parallelize_fn": lambda m, mesh: m}, r"`parallelize_fn` with `tensor_parallel_size=1`.*HINT"),
    ({"stage": 2, "tensor_parallel_size": 2, "tp_plan": "auto", "parallelize_fn": lambda m, mesh: m},
     r"`parallelize_fn` beside `tp_plan='auto'`.*HINT"),
    ({"stage": "auto", "tensor_parallel_size": 2}, r"`stage='auto'` with `tensor_parallel_size=2`.*HINT"),
])
def test_fabric_refuses_what_it_does_not_build(options: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ZeroFabricStrategy(**options)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_fabric_save_writes_no_whole_model_on_rank_0(stage: int, tmp_path: Path, in_process_fit) -> None:  # noqa: ANN001
    """A sharded ``fabric.save`` writes each parameter as the ranks' pieces only: rank 0's common part holds no copy of
    the whole model (it did: the module's state dict, read through the set-up module's shadow, was the gathered one)."""
    from lightning.fabric import Fabric
    from safetensors import safe_open

    fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=stage))
    fabric.launch()
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    fabric.backward(model(torch.randn(4, 8)).sum())
    optimizer.step()
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    (file,) = (tmp_path / "ckpt").glob("*.safetensors")
    with safe_open(file, "pt") as handle:
        common = sorted(k.removeprefix("common/lzero/module_state.") for k in handle.keys()
                        if k.startswith("common/lzero/module_state."))
        pieces = sorted(k for k in handle.keys() if k.startswith("param/"))
    assert common == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]  # the buffers alone
    assert pieces == ["param/0.bias", "param/0.weight", "param/1.bias", "param/1.weight"]
    again = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)))
    fabric.load(tmp_path / "ckpt", {"model": again})
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
