"""DeepSpeed JSON configurations (lzero/deepspeed/config.py): each realistic config translates to the expected
lzero arguments or is refused with the expected message. Training them against Python, and the convert-config round
trip: test_deepspeed_migration.py."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lzero import ZeroConfig, ZeroConfigError
from lzero.deepspeed.config import BatchTriple, DeepSpeedConfigError, translate

TUTORIAL_BF16 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16,
                 "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
TUTORIAL_ZERO3 = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "zero_optimization": {"stage": 3,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e7,
                          "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e6},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000}}
HF_AUTO_ZERO2 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "steps_per_print": 2000, "wall_clock_breakdown": False,
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True}}
FP16_DYNAMIC = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                         "hysteresis": 3, "min_loss_scale": 0.5}, "zero_optimization": {"stage": 2},
                "gradient_clipping": 1.0}
NVME = {"zero_optimization": {"stage": 3, "sub_group_size": 1e8,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pipeline_read": True},
                              "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 6}},
        "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2}}
DEPRECATED = {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                                    "cpu_offload_use_pin_memory": False,
                                    "stage3_gather_fp16_weights_on_model_save": True}}


def notes(translated) -> dict[str, str]:
    return {n.key: n.kind for n in translated.notes}


def test_tutorial_bf16_zero2_translates() -> None:
    t = translate(TUTORIAL_BF16)
    assert t.strategy_kwargs() == {"stage": 2, "precision": "bf16-mixed"}
    assert t.trainer_kwargs() == {"accumulate_grad_batches": 16}
    assert (t.batch.train_batch_size, t.batch.micro, t.batch.accumulate) == (None, 1, 16)
    assert translate(TUTORIAL_BF16, world_size=4).batch.train_batch_size == 64  # 1 x 16 x 4


def test_tutorial_zero3_offload_fp16_translates() -> None:
    t = translate(TUTORIAL_ZERO3)
    kwargs = t.strategy_kwargs()
    assert kwargs == {"stage": 3, "reduce_bucket_size": 50_000_000, "overlap_comm": True,
                      "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 1_000_000,
                      "offload_optimizer": {"device": "cpu", "pin_memory": True},
                      "offload_param": {"device": "cpu", "pin_memory": True}, "precision": "16-mixed",
                      "loss_scaling": {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000}}
    assert notes(t) == {}  # every key honoured as it stands
    from lzero import ZeroStrategy

    strategy = ZeroStrategy(config=TUTORIAL_ZERO3)
    assert strategy.config.offload_param.device == "cpu" and strategy.config.offload_optimizer.device == "cpu"
    assert strategy.config.reduce_bucket_size == 50_000_000 and strategy.precision_plugin.scaler.scale == 2.0 ** 16


def test_hf_auto_zero2_cpu_offload_fills_from_the_callers_numbers() -> None:
    t = translate(HF_AUTO_ZERO2, world_size=2, micro_batch=2, accumulate=4, trainer_precision="bf16-mixed")
    assert (t.batch.train_batch_size, t.batch.micro, t.batch.accumulate) == (16, 2, 4)
    assert t.strategy_kwargs() == {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": 200_000_000,
                                   "overlap_comm": True,
                                   "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                   "train_batch_size": 16, "precision": "bf16-mixed"}
    assert t.gradient_clip_val is None
    kinds = notes(t)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "bf16.enabled", "zero_optimization.reduce_bucket_size"):
        assert kinds[key] == "filled", key
    assert kinds["wall_clock_breakdown, steps_per_print"] == "notice"  # one notice naming both logging keys
    # without the caller's numbers (ZeroStrategy at construction), "auto" is left to the Trainer
    later = translate(HF_AUTO_ZERO2)
    assert later.precision is None and later.batch.micro is None and "train_batch_size" not in later.options


def test_stage3_with_an_explicit_consistent_batch_triple() -> None:
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "zero_optimization": {"stage": 3, "overlap_comm": False}}
    assert translate(ds, world_size=4).options == {"stage": 3, "overlap_comm": False, "train_batch_size": 32}
    assert translate(ds).batch.train_batch_size == 32  # world size 4 implied: 32 / (4 x 2)
    derived = translate({"train_batch_size": 32, "gradient_accumulation_steps": 2,
                         "zero_optimization": {"stage": 3}}, world_size=4)
    assert derived.batch.micro == 4  # given two, the third


def test_inconsistent_batch_triple_shows_the_three_numbers_and_the_world_size() -> None:
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
          "zero_optimization": {"stage": 2}}
    with pytest.raises(ZeroConfigError, match=r"train_batch_size 64 != train_micro_batch_size_per_gpu 4 x"
                                              r" gradient_accumulation_steps 4 x world size 2 = 32"):
        translate(ds, world_size=2)
    with pytest.raises(ZeroConfigError, match=r"`gradient_accumulation_steps=4` but accumulate_grad_batches is 8"):
        translate(ds, world_size=4, accumulate=8)


def test_stage3_nvme_offload_and_aio_thread_count() -> None:
    t = translate(NVME)
    config = ZeroConfig(**t.options)
    assert config.offload_optimizer.device == "nvme" and config.offload_optimizer.pipeline_read
    assert config.offload_param.device == "nvme" and config.offload_param.buffer_count == 6
    assert config.offload_param.nvme_path == "/local_nvme" and config.sub_group_size == 100_000_000
    assert (config.aio.block_size, config.aio.queue_depth, config.aio.intra_op_parallelism) == (262144, 16, 2)
    assert notes(t) == {"aio.thread_count": "renamed"}


def test_fp16_dynamic_loss_scaling_becomes_zero_precision() -> None:
    from lzero import ZeroStrategy

    strategy = ZeroStrategy(config=FP16_DYNAMIC)
    plugin = strategy.precision_plugin
    assert plugin.precision == "16-mixed"
    scaling = plugin.scaler.config
    assert (scaling.loss_scale, scaling.initial_scale_power, scaling.loss_scale_window, scaling.hysteresis,
            scaling.min_loss_scale) == (0, 12, 500, 3, 0.5)
    assert plugin.loss_scale == 2.0 ** 12
    assert strategy._deepspeed.gradient_clip_val == 1.0
    with pytest.raises(ZeroConfigError, match=r"precision '16-mixed' .* but the Trainer for 'bf16-mixed'"):
        translate(FP16_DYNAMIC, trainer_precision="bf16-mixed")


def test_deprecated_spellings_are_understood() -> None:
    t = translate(DEPRECATED)
    config = ZeroConfig(**t.options)
    assert config.offload_optimizer.device == "cpu" and config.offload_optimizer.pin_memory is False
    assert config.offload_param.device == "cpu" and config.offload_param.pin_memory is False
    kinds = notes(t)
    assert kinds["zero_optimization.cpu_offload"] == kinds["zero_optimization.cpu_offload_params"] == "renamed"
    assert kinds["zero_optimization.stage3_gather_fp16_weights_on_model_save"] == "renamed"
    assert kinds["zero_optimization.stage3_gather_16bit_weights_on_model_save"] == "notice"


def test_zero_plus_plus_keys_are_read_as_hpz_and_the_quantized_collectives() -> None:
    t = translate({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                                         "zero_quantized_gradients": True}})
    assert t.options == {"stage": 3, "hpz_partition_size": 8, "quantized_weights": True, "quantized_gradients": 4}
    ZeroConfig(**t.options)
    assert translate({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}).options == {"stage": 3}
    with pytest.raises(DeepSpeedConfigError, match=r"`zero_optimization.zero_quantized_nontrainable_weights=True`: not"
                                                   r" built in lzero"):
        translate({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}})
    with pytest.raises(ZeroConfigError, match=r"`zero_optimization.zero_quantized_weights=True` \(lzero's"
                                              r" `quantized_weights`\) at stage 2"):
        translate({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})


def test_unknown_key_under_zero_optimization_names_it_and_a_suggestion() -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        translate({"zero_optimization": {"stage": 2, "overlap_com": True}, "optimiser": {}})
    assert err.value.errors == [
        "Unknown DeepSpeed key `optimiser`. HINT: did you mean `optimizer`?",
        "Unknown DeepSpeed key `zero_optimization.overlap_com`. HINT: did you mean `zero_optimization.overlap_comm`?",
    ]


def test_contradictions_and_unbuilt_blocks_are_refused_by_name() -> None:
    with pytest.raises(ZeroConfigError, match=r"`zero_optimization.offload_param=\{'device': 'cpu'\}` at stage 2"):
        translate({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ZeroConfigError, match=r"`scheduler.type='LRRangeTest'` is not built in lzero"):
        translate({"zero_optimization": {"stage": 2}, "scheduler": {"type": "LRRangeTest", "params": {}}})
    with pytest.raises(ZeroConfigError, match=r"`communication_data_type='bf16'` is not built in lzero \(it runs null"
                                              r" or \"fp32\"\)"):
        translate({"zero_optimization": {"stage": 2}, "communication_data_type": "bf16"})
    fp32 = translate({"zero_optimization": {"stage": 2}, "communication_data_type": "fp32", "fp32_allreduce": False})
    assert fp32.options == {"stage": 2} and notes(fp32) == {"fp32_allreduce": "notice"}
    with pytest.raises(ZeroConfigError, match=r"`zero_optimization.contiguous_gradients=False`: lzero's gradients"):
        translate({"zero_optimization": {"stage": 2, "contiguous_gradients": False}})


def convert(path: Path) -> tuple[int, str]:
    from lzero.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["convert-config", str(path)])
    return code, out.getvalue()


def test_convert_config_prints_refusals_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8},
                                                      "overlap_com": True}}))
    code, text = convert(path)
    assert code == 1
    assert text.splitlines() == [
        "# refused: Unknown DeepSpeed key `zero_optimization.overlap_com`. HINT: did you mean"
        " `zero_optimization.overlap_comm`?",
        "# refused: `zero_optimization.zeropp_loco_param={'err_beta': 0.8}`: not built in lzero (ZeRO++'s hpZ, qwZ"
        " and qgZ are). HINT: remove `zeropp_loco_param`.",
    ]


def test_mics_shard_size_is_hybrid_sharding() -> None:
    """MiCS's shard groups are lzero's shard_group_size; its hierarchical gather needs them."""
    from lzero.deepspeed.config import DeepSpeedConfigError, translate

    out = translate({"zero_optimization": {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True}})
    assert out.options == {"stage": 3, "shard_group_size": 8}
    with pytest.raises(DeepSpeedConfigError, match="without `mics_shard_size`"):
        translate({"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": True}})


BAD_VALUES = [  # (configuration, the key as written with its value, lzero's name where it differs)
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": -2}}, "zero_optimization.zero_hpz_partition_size=-2",
     "hpz_partition_size"),
    ({"zero_optimization": {"stage": 9}}, "zero_optimization.stage=9", None),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": -5}},
     "zero_optimization.stage3_max_live_parameters=-5", "max_live_parameters"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size=0", None),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 3}}},
     "zero_optimization.offload_optimizer.ratio=3", None),
    ({"zero_optimization": {"stage": 3, "cpu_offload": True, "offload_param": {"device": "nvme", "nvme_path": "/a"},
                            "sub_group_size": 1e6}, "aio": {"block_size": 1000}}, "aio.block_size=1000", None),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": 3}}, "zero_optimization.zero_quantized_gradients=3",
     "quantized_gradients"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}},
     "zero_optimization.mics_shard_size=2", "shard_group_size"),
    ({"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": "yes"}, "zero_allow_untested_optimizer",
     "allow_untested_optimizer"),
]


@pytest.mark.parametrize(("config", "written", "lzero_name"), BAD_VALUES, ids=[w.split("=")[0] for _, w, _ in BAD_VALUES])
def test_a_bad_value_is_named_by_the_deepspeed_key_it_was_written_as(config: dict, written: str,
                                                                      lzero_name: str) -> None:
    """lzero's own checks of a translated value name the key the user wrote ([Note: errors name the key as
    written]), lzero's field in parentheses where its name differs; before, only lzero's field."""
    from lzero import ZeroStrategy

    for build in (translate, lambda c: ZeroStrategy(config=c)):
        with pytest.raises(DeepSpeedConfigError) as err:
            build(config)
        print(err.value)
        assert f"`{written}" in str(err.value)
        if lzero_name is not None:
            assert f"(lzero's `{lzero_name}`)" in str(err.value)


def test_an_argument_beside_the_json_keeps_lzeros_name() -> None:
    """``ZeroStrategy(config=ds, stage=2)``: the stage is the constructor's, so lzero's name; hpZ is the file's."""
    from lzero import ZeroStrategy

    with pytest.raises(DeepSpeedConfigError, match=r"^`zero_optimization.zero_hpz_partition_size=2` \(lzero's"
                                                   r" `hpz_partition_size`\) at stage 2: .* HINT: use `stage=3`."):
        ZeroStrategy(config={"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, stage=2)


@pytest.mark.parametrize("door", ["trainer", "fabric"])
def test_a_value_checked_against_the_world_size_at_setup_names_the_deepspeed_key(tmp_path: Path, in_process_fit,
                                                                                 door: str) -> None:
    """hpZ's partition must divide the world size, known at setup: at world size 1, ``zero_hpz_partition_size: 8``
    from a JSON is refused by that key at both doors (a ZeroConfig's own field keeps lzero's name:
    tests/lightning/test_setup_failure.py)."""
    from lzero import ZeroFabricStrategy, ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule

    config = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}
    says = (r"^`zero_optimization.zero_hpz_partition_size=8` \(lzero's `hpz_partition_size`\) does not divide the world"
            r" size 1")
    with pytest.raises(DeepSpeedConfigError, match=says):
        if door == "trainer":
            from lightning.pytorch import Trainer

            trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(config=config), max_steps=1,
                              logger=False, enable_progress_bar=False, enable_model_summary=False,
                              enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path)
            trainer.fit(DemoGPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16),
                        datamodule=TextDataModule(block_size=8, batch_size=2, steps_per_epoch=4))
        else:
            import lightning as L

            from lzero.demo.model import GPT, GPTConfig

            fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(config=config))
            fabric.launch()
            module = fabric.setup(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)))
            module(torch.zeros(1, 4, dtype=torch.long))  # the engine starts at the model's first use


def test_strategy_checks_the_config_against_the_trainer_at_setup(tmp_path: Path, in_process_fit) -> None:
    """What a config says and the Trainer contradicts is refused when fitting starts, naming both."""
    from lightning.pytorch import Trainer

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule

    def fit(config: dict, **trainer_kwargs) -> None:
        trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(config=config), max_steps=1,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path, **trainer_kwargs)
        trainer.fit(DemoGPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16),
                    datamodule=TextDataModule(block_size=8, batch_size=2, steps_per_epoch=4))

    stage2 = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ZeroConfigError, match=r"`train_micro_batch_size_per_gpu=4` but the DataLoader's batch size is"
                                              r" 2 \(train_batch_size None, world size 1\)"):
        fit({**stage2, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ZeroConfigError, match=r"precision 'bf16-mixed' .* but the Trainer for '16-mixed'"):
        fit({**stage2, "bf16": {"enabled": True}}, precision="16-mixed")
    with pytest.raises(ZeroConfigError, match=r"`gradient_clipping=1.0` but the Trainer has `gradient_clip_val=0.5`"):
        fit({**stage2, "gradient_clipping": 1.0}, gradient_clip_val=0.5)


BF16_WITH_BLOCKS = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 2, "warmup_type": "linear",
                                                      "total_num_steps": 5}},
}


def test_bad_optimizer_and_scheduler_blocks_are_named(tmp_path: Path, in_process_fit) -> None:
    cases = [
        ({"type": "AdamX", "params": {}}, None, r"`optimizer.type='AdamX'` is not a type lzero builds.*'Adam"),
        ({"type": "Muon", "params": {"lr": 0.02}}, None,
         r"`optimizer.type='Muon'` is DeepSpeed's MuonWithAuxAdam.*HINT: drop the `optimizer` block.*torch.optim.Muon"),
        ({"type": "AdamW", "params": {"betas2": 0.9}}, None, r"`optimizer.params.betas2`.*did you mean `betas`"),
        ({"type": "AdamW", "params": {"amsgrad": "auto"}}, None, r"`optimizer.params.amsgrad=\"auto\"`.* only for lr"),
        (None, {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, r"`scheduler.params.total_num_steps`"),
    ]
    for optimizer, scheduler, match in cases:
        block = {"zero_optimization": {"stage": 2}, **({"optimizer": optimizer} if optimizer else {}),
                 **({"scheduler": scheduler} if scheduler else {})}
        with pytest.raises(ZeroConfigError, match=match):
            translate(block)
    from lightning.pytorch import Trainer

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule

    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(config=dict(BF16_WITH_BLOCKS)), max_steps=1,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=0,
                      default_root_dir=tmp_path)
    with pytest.raises(ZeroConfigError, match=r"Both the DeepSpeed configuration .* and `configure_optimizers`"):
        trainer.fit(DemoGPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16),
                    datamodule=TextDataModule(block_size=8, batch_size=2, steps_per_epoch=1))


def test_warmup_schedulers_set_deepspeeds_rates_with_its_timing() -> None:
    """DeepSpeed's formulas and timing, by hand ([Note: DeepSpeed's scheduler timing]): the rate before optimizer
    step k is the one for DeepSpeed's iteration L = k - 1 (L = -1: the warmup's bottom; 0 for WarmupCosineLR).
    (benchmarks/peers/check_deepspeed_schedules.py compares with DeepSpeed's own classes: bitwise equal.)"""
    import math

    from lzero.deepspeed.optim import build_optimizer, check
    from lzero.deepspeed.schedules import build_scheduler

    def rates(kind: str, steps: int, **params: Any) -> list[float]:
        opt = build_optimizer(check("optimizer", {"type": "SGD", "params": {"lr": 0.5}}), [torch.nn.Parameter(torch.zeros(1))])
        sched = build_scheduler(check("scheduler", {"type": kind, "params": params}), opt)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    # WarmupLR "log" from 0.01 to 0.1 over 10 iterations: 0.01 at L = -1, log(L + 1) / log(10) of the way, then 0.1
    log = rates("WarmupLR", 12, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    assert log == pytest.approx([0.01] + [0.01 + 0.09 * math.log(L + 1) / math.log(10) for L in range(10)] + [0.1])
    # warmup_num_steps 1 runs as 2 (DeepSpeed's clamp); warmup_max_lr defaults to the optimizer's lr (0.5)
    assert rates("WarmupLR", 4, warmup_num_steps=1, warmup_type="linear") == [0.0, 0.0, 0.25, 0.5]
    # WarmupDecayLR from 0.1 to 1.0 over 2 (linear), then down to warmup_min_lr (not 0) at L = 5, held there
    decay = rates("WarmupDecayLR", 8, warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear",
                  total_num_steps=5)
    assert decay == pytest.approx([0.1, 0.1, 0.55, 1.0, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1, 0.1])
    # WarmupCosineLR relative to 0.5: 0 at L = -1, linear from 0.2 over 2, cosine with progress (L - 1) / 4 to 0.1
    cos = rates("WarmupCosineLR", 8, warmup_min_ratio=0.2, warmup_num_steps=2, warmup_type="linear",
                cos_min_ratio=0.1, total_num_steps=6)
    expected = [0.0, 0.2, 0.6] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1, (L - 1) / 4))) for L in range(2, 7)]
    assert cos == pytest.approx([0.5 * r for r in expected])
    with pytest.raises(ZeroConfigError, match=r"`scheduler.params.warmup_type='cosine'` is not one of log, linear"):
        check("scheduler", {"type": "WarmupLR", "params": {"warmup_type": "cosine"}})
    with pytest.raises(ZeroConfigError, match=r"`scheduler.params.warmup_num_steps=0` must be a whole number >= 1"):
        check("scheduler", {"type": "WarmupLR", "params": {"warmup_num_steps": 0}})


HF_AUTO_ZERO3 = {"fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 3},
                 "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto"}}


def test_hidden_size_auto_sizes_follow_the_model_or_are_refused_naming_the_keys(tmp_path: Path) -> None:
    """Hugging Face's formulas (h*h, 0.9*h*h, 10*h) from a `config.hidden_size` on any module, else the
    LightningModule's `n_embd`-like hyperparameters; a model that says neither is refused naming the fields.
    `convert-config --hidden-size` writes the numbers."""
    from lightning.pytorch import LightningModule

    from lzero import auto_sizes
    from lzero.deepspeed.convert import to_yaml

    t = translate(HF_AUTO_ZERO3)
    assert {k: t.options[k] for k in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold")} \
        == dict.fromkeys(("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"), "auto")
    config = ZeroConfig(**t.options)

    class WithConfig(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"hidden_size": 1024})()

    class Module(LightningModule):
        def __init__(self, inner: torch.nn.Module, **hparams: Any) -> None:
            super().__init__()
            self.inner = inner
            self.save_hyperparameters(hparams)

    filled, values = auto_sizes.fill(config, Module(torch.nn.Sequential(WithConfig())))
    assert values == {"reduce_bucket_size": 1024 * 1024, "prefetch_bucket_size": 943718,
                      "param_persistence_threshold": 10240}
    assert (filled.reduce_bucket_size, filled.prefetch_bucket_size, filled.stage) == (1048576, 943718, 3)
    assert auto_sizes.fill(config, Module(torch.nn.Linear(2, 2), d_model=64))[1]["reduce_bucket_size"] == 4096
    with pytest.raises(ZeroConfigError, match=r"reduce_bucket_size, prefetch_bucket_size, param_persistence_threshold"
                                              r" = \"auto\" is filled from the model's hidden size, but the model"
                                              r" does not say it"):
        auto_sizes.fill(config, Module(torch.nn.Linear(2, 2)))
    with pytest.raises(DeepSpeedConfigError, match=r"`zero_optimization.stage3_max_live_parameters=\"auto\"`:"
                                                   r" nothing fills it"):
        translate({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}})
    written = yaml.safe_load(to_yaml(t, hidden_size=64))["trainer"]["strategy"]["init_args"]["config"]
    assert (written["reduce_bucket_size"], written["prefetch_bucket_size"], written["param_persistence_threshold"]) \
        == (4096, 3686, 640)


def test_fp16_auto_takes_the_blocks_loss_scaling_when_the_trainer_says_16_mixed() -> None:
    """`fp16.enabled: "auto"` with loss-scaling knobs: they apply once the Trainer's precision is known to be
    16-mixed (Lightning hands the strategy its generic plugin), and not under bf16."""
    from types import SimpleNamespace

    from lzero import ZeroStrategy

    strategy = ZeroStrategy(config=HF_AUTO_ZERO3)
    assert strategy._deepspeed.loss_scaling_if_fp16 == {"loss_scale": 0, "initial_scale_power": 8, "hysteresis": 3}
    strategy.precision_plugin = SimpleNamespace(precision="16-mixed")
    config = strategy.precision_plugin.scaler.config
    assert (config.initial_scale_power, config.hysteresis) == (8, 3) and strategy.precision_plugin.loss_scale == 2.0 ** 8
    strategy.precision_plugin = SimpleNamespace(precision="bf16-mixed")
    assert strategy.precision_plugin.precision == "bf16-mixed"


def test_readme_migration_table_names_every_key_lzero_reads() -> None:
    """README point of issue 15 (the table now lives in docs/deepspeed.md): it covers every key the translation knows."""
    from lzero.deepspeed.keys import FP16_KEYS, TOP_KEYS, ZERO_KEYS

    readme = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed.md").read_text()
    section = readme[readme.index("## Migrating from DeepSpeed"):]
    table = section[section.index("| DeepSpeed key | lzero |"):]
    table = table.split("\n\n")[0]
    missing = [key for key in (*TOP_KEYS, *ZERO_KEYS, *FP16_KEYS) if f"`{key}`" not in table and key != "enabled"]
    assert missing == []


DEEPSPEED_TOP_KEYS = (  # what DeepSpeed 0.19's DeepSpeedConfig._initialize_params reads at the top level
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "dump_state", "disable_allgather", "communication_data_type", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "sparse_gradients", "zero_optimization", "activation_checkpointing", "comms_logger",
    "tensorboard", "wandb", "csv_monitor", "comet", "gradient_clipping", "fp16", "bf16", "amp", "torch_autocast",
    "compression_training", "graph_harvesting", "optimizer", "scheduler", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "flops_profiler", "memory_breakdown", "autotuning", "eigenvalue",
    "use_data_before_expert_parallelism", "hybrid_engine", "sparse_attention", "pipeline", "progressive_layer_drop",
    "curriculum_learning", "data_efficiency", "aio", "dataloader_drop_last", "log_level", "nebula", "datastates",
    "checkpoint", "data_types", "compile", "timers", "tensor_parallel", "expert_parallel", "elasticity",
    "wall_clock_breakdown", "managed_gradient_accumulation", "fp32_allreduce", "sequence_parallel_size")


@pytest.mark.parametrize("key", DEEPSPEED_TOP_KEYS)
def test_every_deepspeed_top_level_key_is_known(key: str) -> None:
    """A key DeepSpeed reads is never refused as unknown: it is honoured, noticed, or refused naming it."""
    from lzero.deepspeed.keys import TOP_KEYS

    assert key in TOP_KEYS
    try:
        block = {"autotp_size": 2, "tp_overlap_comm": True} if key == "tensor_parallel" else \
            {"stages": 2, "partition": "uniform"} if key == "pipeline" else {"enabled": True}
        translate({"zero_optimization": {"stage": 2}, key: block} if key != "zero_optimization" else
                  {"zero_optimization": {"stage": 2}})
    except ZeroConfigError as err:
        assert "Unknown DeepSpeed key" not in str(err) and key in str(err), str(err)


def test_the_seeds_tp_size_and_autotp_size_become_tensor_parallel_size() -> None:
    """DeepSpeed AutoTP's ``autotp_size``, and the seeds' ``tp_size`` read as it with a notice (DeepSpeed's own config
    refuses that key): ``tensor_parallel_size`` with the model's own plan (``tp_plan: auto``), or AutoTP's
    ``partition_config`` as ``re:`` patterns. tests/lightning/test_tp_plan.py trains with them."""
    seeds = translate({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                       "tensor_parallel": {"tp_size": 8}}, world_size=16)
    kwargs = seeds.strategy_kwargs()
    assert kwargs["tensor_parallel_size"] == 8 and kwargs["tp_plan"] == "auto"
    assert any(n.key == "tensor_parallel.tp_size" and "autotp_size" in n.text for n in seeds.notes)
    specs = [{"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
             {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"}]
    autotp = translate({"zero_optimization": {"stage": 2}, "tensor_parallel": {
        "autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": specs}}})
    assert autotp.strategy_kwargs()["tp_plan"] == {r"re:.*\.o_proj\.weight$": "rowwise",
                                                   r"re:.*\.[qkv]_proj\.weight$": "colwise"}
    off = translate({"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 0}})  # AutoTP's "disabled"
    assert "tensor_parallel_size" not in off.strategy_kwargs()


@pytest.mark.parametrize("block, message", [
    ({"autotp_size": 2, "tp_size": 4}, r"`tensor_parallel.tp_size=4` and `tensor_parallel.autotp_size=2` disagree"),
    ({"autotp_size": 2, "dtype": "bf16"}, r"`tensor_parallel.dtype`: the model's dtype comes from.*HINT"),
    ({"autotp_size": 2, "preset_model": "llama"}, r"`tensor_parallel.preset_model`.*HINT"),
    ({"autotp_size": 2, "tp_overlap_comm": True}, r"`tensor_parallel.tp_overlap_comm=True`.*not built.*HINT"),
    ({"autotp_sise": 2}, r"Unknown DeepSpeed key `tensor_parallel.autotp_sise`.*did you mean `tensor_parallel.autotp_size`"),
    ({"partition_config": {"layer_specs": []}}, r"`tensor_parallel.partition_config` without a tensor-parallel size"),
    ({"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "column",
                                                              "shape": [2, -1]}]}},
     r"`tensor_parallel.partition_config.layer_specs\[0\].shape`: fused layers.*HINT"),
    ({"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}},
     r"partition_type='diagonal'` is not 'row' or 'column'"),
    ({"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["(x"], "partition_type": "row"}]}},
     r"'\(x' is not a regex.*HINT"),
])
def test_a_bad_tensor_parallel_block_is_refused_by_name(block: dict, message: str) -> None:
    with pytest.raises(ZeroConfigError, match=message):
        translate({"zero_optimization": {"stage": 2}, "tensor_parallel": block}, world_size=4)


def test_the_seeds_pipeline_block_becomes_the_pipeline_options() -> None:
    """The seeds' ``pipeline: {pp_size, micro_batch_size}`` and ``gradient_accumulation_steps``: the stage count, the
    micro batch and the schedule's micro-batches (the Trainer accumulating nothing), each with a notice."""
    seeds = translate({"train_batch_size": 1024, "zero_optimization": {"stage": 2}, "tensor_parallel": {"tp_size": 8},
                       "pipeline": {"pp_size": 4, "micro_batch_size": 8}, "gradient_accumulation_steps": 4})
    assert seeds.options["pipeline_parallel_size"] == 4 and seeds.options["pipeline_microbatches"] == 4
    assert seeds.batch == BatchTriple(1024, 8, 4)
    assert seeds.origins["pipeline_parallel_size"] == "pipeline.pp_size"
    assert {n.key for n in seeds.notes} >= {"pipeline.pp_size", "pipeline.micro_batch_size", "gradient_accumulation_steps"}
    own = translate({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2, "partition": "parameters",
                                                                    "activation_checkpoint_interval": 0}})
    assert own.options["pipeline_parallel_size"] == 2 and "pipeline_microbatches" not in own.options


@pytest.mark.parametrize("block, match", [
    ({"stages": 2, "partition": "uniform"}, r"`pipeline.partition='uniform'`.*`pipeline_split_points`"),
    ({"stages": 2, "activation_checkpoint_interval": 1},
     r"`pipeline.activation_checkpoint_interval=1`.*activation_checkpointing=True"),
    ({"stages": 2, "pipe_partitioned": True}, r"`pipeline.pipe_partitioned=True`"),
    ({"stages": 2, "seed_layers": True}, r"`pipeline.seed_layers=True`"),
    ({"stages": 2, "pp_size": 4}, r"`pipeline.stages=2` and `pipeline.pp_size=4` disagree"),
    ({"partition": "parameters"}, r"`pipeline` without a stage count"),
    ({"stages": 2, "num_stages": 2}, r"Unknown DeepSpeed key `pipeline.num_stages`"),
])
def test_what_the_pipeline_block_cannot_run_is_refused_by_name(block: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        translate({"zero_optimization": {"stage": 2}, "pipeline": block})
