"""strategy="zero_auto": the least-communication configuration that fits the budget, chosen at setup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lzero import ZeroConfig, ZeroConfigError
from lzero.memory.auto import choose
from lzero.memory.estimate import ModelCount, model_states

PSI = 1_000_000
MODEL = ModelCount(trainable=PSI)


def _bytes(name: str, fields: dict, store: str = "both") -> int:
    per_rank = model_states(ZeroConfig().with_overrides(**fields), MODEL, 2, "32-true")
    stores = ("device", "cpu") if store == "both" else (store,)
    return sum(sum(per_rank.get(s, {}).values()) for s in stores)


def test_on_cpu_each_budget_gets_the_least_communication_that_fits() -> None:
    # fp32 Adam, N = 2, per rank: zero1 4Ψ+4Ψ+8Ψ/N = 12 MB, zero2 4Ψ+12Ψ/N = 10 MB, zero3 16Ψ/N = 8 MB;
    # on CPU offloading to host memory saves nothing; NVMe keeps 8Ψ/N (gradients, parameter shards) = 4 MB
    assert [_bytes("zero1", {"stage": 1}), _bytes("zero2", {"stage": 2}), _bytes("zero3", {"stage": 3})] == [
        12 * PSI, 10 * PSI, 8 * PSI]
    expect = [(20 * PSI, "zero1"), (13 * PSI, "zero2"), (11 * PSI, "zero3"), (6 * PSI, "zero3_offload_nvme")]
    for budget, name in expect:  # margin 0.2: the states must fit in 80% of the budget
        config, record = choose(ZeroConfig(), MODEL, 2, 2, "32-true", torch.device("cpu"), budget)
        assert record["chosen"] == name, (budget, record)
        assert [c["fits"] for c in record["candidates"]][-1] is True
    assert (config.stage, config.offload_optimizer.device, config.offload_param.device) == (3, "nvme", "nvme")
    with pytest.raises(ZeroConfigError, match=r"no configuration fits.*zero3_offload_nvme needs"):
        choose(ZeroConfig(), MODEL, 2, 2, "32-true", torch.device("cpu"), 2 * PSI)


def test_on_a_gpu_host_offload_comes_before_nvme() -> None:
    """With a device budget (no CUDA call is made when the budget is given), zero3_offload keeps nothing on the
    device and is chosen before NVMe when the device is too small for zero3."""
    cuda = torch.device("cuda")
    _, record = choose(ZeroConfig(), MODEL, 2, 1, "32-true", cuda, 11 * PSI)
    assert record["chosen"] == "zero3"
    config, record = choose(ZeroConfig(), MODEL, 2, 1, "32-true", cuda, 5 * PSI)
    assert record["chosen"] == "zero3_offload" and config.offload_param.device == "cpu"


def test_bad_margin_is_named() -> None:
    with pytest.raises(ZeroConfigError, match=r"`memory_margin=1.5` must be a fraction in \[0, 1\)"):
        choose(ZeroConfig(), MODEL, 2, 1, "32-true", torch.device("cpu"), 10**9, margin=1.5)


@pytest.mark.parametrize("squeeze", [False, True])
def test_the_chosen_configuration_trains_and_is_recorded(tmp_path: Path, in_process_fit, squeeze: bool) -> None:
    """World size 1: every stage holds 16Ψ, so the registered name picks zero1 (this machine has far more); a
    budget below 16Ψ / 0.8 and above NVMe's 8Ψ / 0.8 (gradients and parameter shards in host memory) makes it
    zero3_offload_nvme, which trains."""
    from lightning.pytorch import Trainer

    from lzero import ZeroStrategy
    from lzero.memory.estimate import count_parameters
    from lzero.checkpoint.reader import ShardedCheckpoint
    from lzero.demo import DemoGPT, TextDataModule

    model = DemoGPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    psi = count_parameters(model).trainable
    budget = 15 * psi if squeeze else None
    strategy = ZeroStrategy(stage="auto", memory_budget_bytes=budget) if squeeze else "zero_auto"
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      limit_val_batches=0)  # ModelCheckpoint writes tmp_path/checkpoints/epoch=0-step=3.ckpt/
    trainer.fit(model, datamodule=TextDataModule(block_size=16, batch_size=2, steps_per_epoch=3))
    chosen = "zero3_offload_nvme" if squeeze else "zero1"
    config = trainer.strategy.config
    assert trainer.global_step == 3 and config.stage == (3 if squeeze else 1)
    assert config.offload_optimizer.device == ("nvme" if squeeze else "none")
    manifest = ShardedCheckpoint(tmp_path / "checkpoints" / "epoch=0-step=3.ckpt").manifest
    assert manifest["auto"]["chosen"] == chosen and manifest["stage"] == config.stage


def test_across_nodes_hybrid_stages_come_first() -> None:
    """4 nodes of 2 processes: zero1-3 sharded within a node (G = 2) are tried before the flat stages, priced at
    N = 2; a budget too small for them falls through to flat zero3 at N = 8."""
    budget = 16 * PSI  # fp32 Adam at G = 2: zero1 12 MB, zero2 10 MB, zero3 8 MB (80% of 16 = 12.8: zero1 fits)
    config, record = choose(ZeroConfig(), MODEL, 8, 2, "32-true", torch.device("cpu"), budget)
    assert record["chosen"] == "zero1_hybrid" and config.stage == 1 and config.shard_group_size == 2
    assert [c["name"] for c in record["candidates"]] == ["zero1_hybrid"]
    config, record = choose(ZeroConfig(), MODEL, 8, 2, "32-true", torch.device("cpu"), 11 * PSI)
    assert record["chosen"] == "zero3_hybrid" and config.stage == 3
    # flat zero3 at N = 8: 16 bytes x Ψ / 8 = 2 MB fits 80% of 3 MB; every hybrid stage needs >= 8 MB
    config, record = choose(ZeroConfig(), MODEL, 8, 2, "32-true", torch.device("cpu"), 3 * PSI)
    assert record["chosen"] == "zero3" and config.shard_group_size is None
    assert [c["name"] for c in record["candidates"]] == ["zero1_hybrid", "zero2_hybrid", "zero3_hybrid", "zero1",
                                                         "zero2", "zero3"]
    _, record = choose(ZeroConfig(), MODEL, 2, 2, "32-true", torch.device("cpu"), 20 * PSI)  # one node: flat only
    assert record["chosen"] == "zero1"
