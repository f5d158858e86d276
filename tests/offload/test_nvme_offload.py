"""NVMe offload of the optimizer (``offload_optimizer: {device: nvme}``) against the same run without offload,
and the life of its swap files (tests/offload/test_nvme_files.py tests the file layer itself)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _offload_cases as cases
from _dist import run_ranks
from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.offload.nvme import NvmeError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder on the work disk (O_DIRECT works there), not tmpfs."""
    folder = ROOT / ".pytest_nvme" / f"{os.getpid()}_{tmp_path_factory.mktemp('n').name}"
    folder.mkdir(parents=True)
    yield folder
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def configs(folder: Path) -> list[dict]:
    nvme = str(folder)
    return [
        {"stage": 1, "fused": True, "nvme": nvme},
        {"stage": 2, "fused": True, "nvme": nvme}, {"stage": 2, "fused": True, "nvme": nvme, "pipeline": True},
        {"stage": 3, "fused": True, "nvme": nvme}, {"stage": 3, "fused": True, "nvme": nvme, "pipeline": True},
        # groups of ~100 elements, at most 2 units with buffers: reads ahead and writes behind across many groups
        {"stage": 3, "fused": True, "nvme": nvme, "pipeline": True, "sub_group_size": 100, "buffer_count": 2},
        {"stage": 2, "fused": True, "nvme": nvme, "ratio": 0.5},
        {"stage": 3, "fused": True, "nvme": nvme, "acc": 2, "clip": 0.05},
        {"stage": 2, "fused": True, "nvme": nvme, "bf16": True}, {"stage": 3, "fused": True, "nvme": nvme, "bf16": True},
        # parameter shards in files too (zero3_offload_nvme), none kept in host memory (max_in_cpu 0)
        {"stage": 3, "fused": True, "nvme": nvme, "nvme_param": nvme},
        {"stage": 3, "fused": True, "nvme": nvme, "nvme_param": nvme, "pipeline": True, "bf16": True},
        {"stage": 3, "fused": True, "nvme": nvme, "nvme_param": nvme, "freeze": True},
        {"stage": 3, "fused": True, "nvme": nvme, "nvme_param": nvme, "max_in_cpu": 400},  # some in host memory
        {"stage": 3, "fused": True, "nvme_param": nvme, "offload_optimizer": False},  # parameters alone on NVMe
    ]


def test_nvme_offload_equals_device_step_by_step(disk: Path) -> None:
    cfgs = configs(disk)
    results = run_ranks(cases.offloaded_vs_device, 2, cfgs, timeout=300)
    for rank_results in results:
        for cfg, res in zip(cfgs, rank_results, strict=True):
            print(f"{ {k: v for k, v in cfg.items() if k != 'nvme'} }: bitwise={res['bitwise']} stores {res['stores']}")
            assert res["bitwise"], (cfg, res)
            expected = {"nvme", "device"} if cfg.get("ratio", 1.0) < 1 else {"nvme"}
            assert set(res["stores"]) == (expected if cfg.get("nvme") else {"device"}), cfg
            assert res["param_stores"] == (["nvme"] if cfg.get("nvme_param") else ["cpu"] if cfg["stage"] == 3
                                           else ["device"]), cfg
    assert list(disk.iterdir()) == []  # every run removed its swap folder


def test_host_memory_holds_no_optimizer_state_and_the_folder_goes(disk: Path) -> None:
    for rank, res in enumerate(run_ranks(cases.nvme_memory, 2, str(disk))):
        host, nvme, shard = res["by_store"]["cpu"], res["by_store"]["nvme"], res["shard"]
        print(f"rank {rank}: host {host}, nvme {nvme}, live {res['live']:,} bytes; files {len(res['files'])}")
        assert nvme["masters"] == 4 * shard and nvme["optimizer_state"] == 8 * shard  # 12 bytes/element on disk
        assert host["masters"] <= 4 and host["optimizer_state"] <= 4 * res["units"] + 4  # placeholders and `step`s
        assert host["gradients"] == 4 * shard  # the persistent fp32 shard gradients ([Note: persistent host buffers])
        # the process holds its fp32 parameter shards, gradients and buffers, not the 12 bytes/element of state
        assert res["by_store"]["device"]["parameters"] == 4 * shard
        assert res["live"] <= 4 * shard + host["gradients"] + host["buffers"] + 4096, res["live"]
        assert len(res["files"]) == 3 * res["units"] and res["modes"] == ["0o600"]
        assert not res["left"]
    assert list(disk.iterdir()) == []


def _engine(folder: Path, **offload) -> tuple[ZeroEngine, ZeroOptimizer, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, reduce_bucket_size=64,
                                                 offload_optimizer={"device": "nvme", "nvme_path": str(folder),
                                                                    **offload}))
    return engine, ZeroOptimizer(opt, engine, 0), model


def _step(engine: ZeroEngine, zopt: ZeroOptimizer, model: torch.nn.Module) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    zopt.step()
    zopt.zero_grad()


def test_a_full_disk_mid_run_is_a_clear_error_and_the_folder_is_removed(disk: Path, monkeypatch) -> None:
    engine, zopt, model = _engine(disk)
    _step(engine, zopt, model)  # the first step creates the moments' files
    real = os.pwritev

    def full(fd, buffers, offset):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(NvmeError, match=r"(?s)unit\d+\.\w+.*No space left.*HINT"):
        _step(engine, zopt, model)
    monkeypatch.setattr(os, "pwritev", real)
    engine.remove(after_failure=True)
    assert list(disk.iterdir()) == []


def test_a_dead_runs_folder_is_removed_at_start_and_nothing_else(disk: Path) -> None:
    code = (f"import os, torch; from lzero.offload.nvme import SwapFiles, aligned_empty; f = SwapFiles({str(disk)!r}, 0);"
            " t = aligned_empty(10, torch.float32); f.write('k', t).result(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    dead = [p for p in disk.iterdir() if p.name.startswith("lzero-")]
    (disk / "mydata").mkdir()
    assert len(dead) == 1
    engine, zopt, model = _engine(disk)
    assert sorted(p.name for p in disk.iterdir() if p.name.startswith("lzero-")) == [
        Path(next(s for s in engine.stores if s.name == "nvme").files.run_folder).name]
    assert (disk / "mydata").is_dir()
    engine.remove()


def test_bad_paths_are_refused_before_the_first_step(disk: Path, monkeypatch) -> None:
    (disk / "file.txt").write_text("x")
    with pytest.raises(NvmeError, match=r"file\.txt/sub.*cannot be created"):
        _engine(disk / "file.txt" / "sub")
    import lzero.offload.nvme_checks

    monkeypatch.setattr(lzero.offload.nvme_checks, "free_bytes", lambda path: 1000)
    with pytest.raises(NvmeError, match=rf"{disk}.*1,000 bytes"):
        _engine(disk)
    assert [p.name for p in disk.iterdir()] == ["file.txt"]  # nothing made


def test_a_loaded_state_read_before_the_first_step_is_kept(disk: Path) -> None:
    """Regression: a loaded optimizer state (in memory, no swap file yet) survived neither a read-only visit (a
    callback reading the shards) nor the step after it: the step ran on a placeholder and corrupted the heap."""
    def run(offload):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, reduce_bucket_size=64, offload_optimizer=offload))
        return model, engine, ZeroOptimizer(opt, engine, 0)

    model, engine, zopt = run("cpu")
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(6)]
    for x in batches[:3]:
        model(x).pow(2).mean().backward()
        zopt.step()
        zopt.zero_grad()
    saved = zopt.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    engine.remove()
    finals = []
    for offload in ("cpu", {"device": "nvme", "nvme_path": str(disk)}):
        model, engine, zopt = run(offload)
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
        engine.all_gather_params()
        for unit in engine.units:  # the loaded masters: written through load_params in a real resume
            with unit.resident(write=True):
                unit.master_shard.data.copy_(unit.flat_param[slice(*unit.spec.shard_range(0))])
        zopt.load_state_dict(saved)
        for unit in engine.units:  # a read-only visit, as a callback snapshotting the shards makes
            with unit.resident():
                assert zopt.shard_optimizer(unit).state[unit.master_shard]["exp_avg"].stride() == (1,)
        for x in batches[3:]:
            model(x).pow(2).mean().backward()
            zopt.step()
            zopt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
        engine.remove()
    assert all(torch.equal(a, b) for a, b in zip(*finals))


def test_a_parameter_buffer_smaller_than_an_io_request_is_refused(disk: Path) -> None:
    model = torch.nn.Linear(4, 4)
    block = {"device": "nvme", "nvme_path": str(disk)}
    config = ZeroConfig(stage=3, offload_optimizer=block, offload_param={**block, "buffer_size": 1000},
                        aio={"block_size": 1 << 20})
    with pytest.raises(NvmeError, match=r"`buffer_size` \(4,000 bytes\) is smaller than aio `block_size` \(1,048,576"):
        ZeroEngine(model, [torch.optim.AdamW(model.parameters())], config)
    assert list(disk.iterdir()) == []
