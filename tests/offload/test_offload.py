"""ZeRO-Offload (``offload_optimizer`` / ``offload_param`` = "cpu") against the same run without offload.

On this CPU-only machine the "device" is host memory too: the host store still keeps separate tensors
and runs the same landing, publishing and host-step code (see [Note: host store copies] in store.py);
what only CUDA runs (pinned buffers, side-stream copies, events) is not exercised here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import _offload_cases as cases
from _dist import run_ranks
from lzero import ZeroConfig, ZeroConfigError, ZeroOptimizerError

CONFIGS = [
    # the host step runs the kernel the device step runs (the user chose fused=True): bitwise
    {"stage": 1, "fused": True}, {"stage": 2, "fused": True}, {"stage": 3, "fused": True},
    {"stage": 2, "fused": True, "ratio": 0.5}, {"stage": 3, "fused": True, "ratio": 0.5},
    {"stage": 2, "fused": True, "acc": 2, "clip": 0.05}, {"stage": 3, "fused": True, "acc": 2, "clip": 0.05},
    {"stage": 2, "fused": True, "sub_group_size": 100},
    {"stage": 3, "fused": True, "offload_optimizer": False},  # parameter shards alone in host memory
    {"stage": 2, "fused": True, "bf16": True}, {"stage": 3, "fused": True, "bf16": True},
    # the user's default (for-loop) kernel on the device, lzero's fused kernel on the host: rounding level
    {"stage": 2}, {"stage": 3},
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(cases.offloaded_vs_device, 2, CONFIGS, timeout=300)


def test_offloaded_equals_device_step_by_step(results: list[dict]) -> None:
    for rank_results in results:
        for cfg, res in zip(CONFIGS, rank_results, strict=True):
            print(f"{cfg}: bitwise={res['bitwise']} max relative difference {res['max_rel']:.2e} stores {res['stores']}"
                  f" parameter shards {res['param_stores']}")
            expected = {"cpu", "device"} if cfg.get("ratio", 1.0) < 1 else {"cpu"}
            if cfg.get("offload_optimizer") is False:
                expected = {"device"}
            assert set(res["stores"]) == expected, cfg
            assert res["param_stores"] == (["cpu"] if cfg["stage"] == 3 else ["device"]), cfg
            if cfg.get("fused"):
                assert res["bitwise"], (cfg, res)
            else:  # fused AdamW vs the for-loop kernel: the last bit differs, and only the last bit
                assert not res["bitwise"] and 0 < res["max_rel"] <= 1e-6, (cfg, res)


@pytest.mark.parametrize("stage", [2, 3])
def test_memory_is_labelled_by_store_and_matches_the_formula(stage: int) -> None:
    world_size = 2
    for rank, res in enumerate(run_ranks(cases.memory_by_store, world_size, stage)):
        device, host = res["by_store"].get("device", {}), res["by_store"]["cpu"]
        shard, padded = res["shard"], res["padded"]
        print(f"stage {stage} rank {rank}: device {device}, host {host}; live {res['live']:,} bytes")
        # host: fp32 masters 4 bytes and AdamW's two moments 8 bytes per owned element (+ a 4-byte step per unit)
        assert host["masters"] == (0 if stage == 3 else 4 * shard)  # stage 3: the master is the parameter shard
        assert host["optimizer_state"] == 8 * shard + 4 * res["units"]
        # the fp32 shard gradients stay in persistent host buffers ([Note: persistent host buffers]); nothing else
        assert host["gradients"] == 4 * shard and device.get("gradients", 0) == 0
        assert host["buffers"] == 0  # a CPU model without the delayed update casts straight into its parameters
        if stage == 3:  # the fp32 parameter shard is the master itself, in host memory; nothing on the device
            assert host["parameters"] == 4 * shard and device.get("parameters", 0) == 0
        else:  # full fp32 parameters on the device, as without offload
            assert device["parameters"] == 4 * padded
        assert not res["aliased"]
        # the accounting covers what the process holds: the rest is the model's inputs and torch's small tensors
        accounted = sum(sum(kinds.values()) for kinds in res["by_store"].values())
        assert accounted <= res["live"] <= accounted + 4096, (accounted, res["live"])


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 1, "offload_param": "cpu"}, r"offload_param=\{'device': 'cpu'\}` at stage 1: only stage 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, r"at stage 2: only stage 3 .*HINT: use `stage=3`"),
    ({"offload_optimizer": "gpu"}, r"`offload_optimizer.device='gpu'` is not an offload device.*HINT: use 'none'"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0}}, r"`offload_optimizer.ratio=0` must be a fraction in \(0, 1\]"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 1.5}}, r"`offload_optimizer.ratio=1.5` must be a fraction"),
    ({"offload_optimizer": {"device": "cpu", "nvme_path": "/nvme"}},
     r"`offload_optimizer.nvme_path` only applies with `device: nvme`.*with device 'cpu' it would be ignored"),
    ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 6}}, r"`offload_param.buffer_count` only applies"),
    ({"offload_optimizer": {"device": "cpu", "max_in_cpu": 5}}, r"`offload_optimizer.max_in_cpu` is not an"
                                                                r" `offload_optimizer` key.*move it to `offload_param`"),
    ({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}, r"`aio.thread_count=2` and `aio.intra_op_parallelism=4`"),
    ({"aio": {"block_sise": 4096}}, r"Unknown key `aio.block_sise`.*did you mean `block_size`"),
    ({"aio": {"block_size": 1000}}, r"`aio.block_size=1000` must be a multiple of 4096"),
    ({"aio": {"use_gds": True}}, r"`aio.use_gds=true`.*HINT: set `use_gds: false`"),
    ({"offload_optimizer": {"device": "cpu", "pin_memroy": False}}, r"`offload_optimizer.pin_memroy`.*did you mean `pin_memory`"),
    ({"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}, r"`offload_optimizer.pin_memory='yes'` must be true"),
    ({"offload_optimizer": 3}, r"`offload_optimizer=3` must be a device name or a block"),
    ({"offload_optimizer": "cpu", "sub_group_size": 0}, r"`sub_group_size=0` must be a positive whole number"),
])
def test_bad_offload_options_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**kwargs)


def test_an_nvme_key_at_its_default_is_accepted_with_another_device() -> None:
    """LightningCLI writes out every key of a block; a key at its default loses nothing."""
    config = ZeroConfig(stage=3, offload_param={"device": "cpu", "buffer_count": 5, "nvme_path": None})
    assert config.offload_param.device == "cpu" and config.offload_param.buffer_count == 5


def test_deepspeed_blocks_and_defaults() -> None:
    config = ZeroConfig(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu", "pin_memory": False},
                        sub_group_size=1e9)
    assert (config.offload_optimizer.pin_memory, config.offload_optimizer.ratio) == (True, 1.0)
    assert (config.offload_param.device, config.offload_param.pin_memory) == ("cpu", False)
    assert config.sub_group_size == 1_000_000_000
    assert ZeroConfig().offload_optimizer.device == "none" and ZeroConfig().offload_param.device == "none"
    aio = ZeroConfig(aio={"thread_count": 8, "queue_depth": 16}).aio  # DeepSpeed's older name, read (not ignored)
    assert (aio.intra_op_parallelism, aio.queue_depth, aio.block_size) == (8, 16, 1_048_576)


class CudaOnlySGD(torch.optim.SGD):
    """Stands for an optimizer with a GPU kernel only (apex's FusedAdam, bitsandbytes' 8-bit optimizers)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_cuda:
                    raise RuntimeError(f"expected a CUDA tensor, got {p.device}")
        return super().step(closure)


def test_optimizer_without_a_cpu_implementation_is_refused_at_setup() -> None:
    from lzero import ZeroEngine, ZeroOptimizer

    model = torch.nn.Linear(4, 4)
    opt = CudaOnlySGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, offload_optimizer="cpu", allow_untested_optimizer=True))
    try:
        with pytest.raises(ZeroOptimizerError, match=r"`test_offload.CudaOnlySGD` cannot step a CPU tensor.*expected a"
                                                     r" CUDA tensor.*HINT: .*`offload_optimizer: none`"):
            ZeroOptimizer(opt, engine, 0)
    finally:
        engine.remove()


def test_pinned_allocation_failure_falls_back_to_pageable_memory_with_one_warning(monkeypatch) -> None:
    from lzero.offload.store import HostStore

    store = HostStore(torch.device("cpu"), pin_memory=True)
    store.pin = True  # as on CUDA; this machine has no page-locked allocator

    def fail(nbytes):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(store, "_pinned", fail)
    with pytest.warns(UserWarning, match=r"could not allocate 4,000 bytes of pinned host memory.*`pin_memory: false`"):
        held = store.land_grad(None, torch.ones(1000), torch.float32, "unit0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only: another buffer is allocated, pageable, without a warning
        store.land_grad(held, torch.full((1000,), 2.0), torch.float32, "unit0")
        other = store.land_grad(None, torch.ones(3000, dtype=torch.bfloat16), torch.float32, "unit1")
        store.finish()
    assert torch.equal(held, torch.full((1000,), 3.0)) and torch.equal(other, torch.ones(3000))
    assert not store.pin and not held.is_pinned()


def test_gradient_buffers_persist_across_steps() -> None:
    """A unit's host gradient lands in the same buffer every step (no allocation on the hot path, see [Note: persistent
    host buffers]); while the delayed update's step reads one buffer (``busy``), the next landing takes a second one,
    and the two alternate from then on."""
    from lzero.offload.store import HostStore

    store = HostStore(torch.device("cpu"))
    first = store.land_grad(None, torch.full((100,), 1.0), torch.float32, "unit0")
    again = store.land_grad(None, torch.full((100,), 2.0), torch.float32, "unit0")
    assert again is first and torch.equal(first, torch.full((100,), 2.0))
    assert store.land_grad(again, torch.full((100,), 3.0), torch.float32, "unit0") is first
    assert torch.equal(first, torch.full((100,), 5.0))
    second = store.land_grad(None, torch.full((100,), 7.0), torch.float32, "unit0", busy=first)
    assert second is not first and torch.equal(first, torch.full((100,), 5.0))  # the busy one is left alone
    assert store.land_grad(None, torch.ones(100), torch.float32, "unit0", busy=second) is first
    other = store.land_grad(None, torch.ones(30, dtype=torch.bfloat16), torch.float32, "unit1")
    assert other.dtype == torch.float32 and torch.equal(other, torch.ones(30))
    assert sorted(b.numel() for b in store.gradient_buffers()) == [30, 100, 100]


@pytest.mark.parametrize("stage", [2, 3])
def test_pinned_allocation_failing_mid_run_goes_on_pageable_and_unchanged(stage: int) -> None:
    """From step 4, every pinned allocation fails (injected; the persistent gradient buffers dropped so new ones are
    needed):
    one warning per rank naming `pin_memory: false`, and the run's losses and parameters stay bitwise those of the
    run without the failure."""
    for rank, res in enumerate(run_ranks(cases.pinned_failure_mid_run, 2, stage)):
        print(f"stage {stage} rank {rank}: {res}")
        assert res["bitwise"], res
        assert len(res["warnings"]) == 1 and "`pin_memory: false`" in res["warnings"][0], res["warnings"]
