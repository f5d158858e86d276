"""DeepSpeed JSON configurations (lzero/deepspeed_config.py): each realistic config translates to the expected
lzero arguments or is refused with the expected message; one trains and equals the same strategy written in Python;
``lzero convert-config`` output builds the same strategy."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any, Union

import pytest
import torch
import yaml

from lzero import ZeroConfig, ZeroConfigError
from lzero.deepspeed_config import DeepSpeedConfigError, translate

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
                      "offload_optimizer": {"device": "cpu", "pin_memory": True},
                      "offload_param": {"device": "cpu", "pin_memory": True}, "precision": "16-mixed",
                      "loss_scaling": {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000}}
    assert notes(t) == {"zero_optimization.stage3_prefetch_bucket_size": "notice",
                        "zero_optimization.stage3_param_persistence_threshold": "notice"}
    from lzero import ZeroStrategy

    strategy = ZeroStrategy(config=TUTORIAL_ZERO3)
    assert strategy.config.offload_param.device == "cpu" and strategy.config.offload_optimizer.device == "cpu"
    assert strategy.config.reduce_bucket_size == 50_000_000 and strategy.precision_plugin.scaler.scale == 2.0 ** 16


def test_tutorial_config_trains_like_the_same_strategy_in_python(tmp_path: Path, in_process_fit) -> None:
    """The bf16 zero2 tutorial (accumulation 16 from the config, micro batch 1 from the DataLoader) against
    ZeroStrategy(stage=2, precision="bf16-mixed") with Trainer(accumulate_grad_batches=16): equal parameters."""
    from lightning.pytorch import Trainer, seed_everything

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(TUTORIAL_BF16))

    def fit(strategy, **trainer_kwargs) -> tuple[dict, Trainer]:
        seed_everything(0)
        model = DemoGPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                          limit_val_batches=0, default_root_dir=tmp_path, **trainer_kwargs)
        trainer.fit(model, datamodule=TextDataModule(block_size=8, batch_size=1, steps_per_epoch=64))
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, trainer

    ours, trainer = fit(ZeroStrategy(config=str(path)))
    assert trainer.accumulate_grad_batches == 16 and trainer.global_step == 2
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed" and trainer.strategy.config.stage == 2
    reference, _ = fit(ZeroStrategy(stage=2, precision="bf16-mixed"), accumulate_grad_batches=16)
    assert ours.keys() == reference.keys()
    for k in reference:
        assert torch.equal(ours[k], reference[k]), k
    seed_everything(0)
    initial = DemoGPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)  # trained != untrained
    assert any(not torch.equal(ours[k], v.float()) for k, v in initial.state_dict().items())


def test_hf_auto_zero2_cpu_offload_fills_from_the_callers_numbers() -> None:
    t = translate(HF_AUTO_ZERO2, world_size=2, micro_batch=2, accumulate=4, trainer_precision="bf16-mixed")
    assert (t.batch.train_batch_size, t.batch.micro, t.batch.accumulate) == (16, 2, 4)
    assert t.strategy_kwargs() == {"stage": 2, "allgather_bucket_size": 200_000_000, "overlap_comm": True,
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


def test_zero_plus_plus_key_is_refused_as_not_built() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"`zero_optimization.zero_quantized_weights=True`: ZeRO\+\+/MiCS"
                                                   r" is not built"):
        translate({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert translate({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}).options == {"stage": 3}


def test_unknown_key_under_zero_optimization_names_it_and_a_suggestion() -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        translate({"zero_optimization": {"stage": 2, "overlap_com": True}, "optimiser": {}})
    assert err.value.errors == [
        "Unknown DeepSpeed key `optimiser`. HINT: did you mean `optimizer`?",
        "Unknown DeepSpeed key `zero_optimization.overlap_com`. HINT: did you mean `zero_optimization.overlap_comm`?",
    ]


def test_contradictions_and_unbuilt_blocks_are_refused_by_name() -> None:
    with pytest.raises(ZeroConfigError, match=r"`offload_param=\{'device': 'cpu'\}` at stage 2"):
        translate({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ZeroConfigError, match=r"`scheduler.type='LRRangeTest'` is not built in lzero"):
        translate({"zero_optimization": {"stage": 2}, "scheduler": {"type": "LRRangeTest", "params": {}}})
    with pytest.raises(ZeroConfigError, match=r"`zero_optimization.contiguous_gradients=False`: lzero's gradients"):
        translate({"zero_optimization": {"stage": 2, "contiguous_gradients": False}})


def convert(path: Path) -> tuple[int, str]:
    from lzero.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["convert-config", str(path)])
    return code, out.getvalue()


@pytest.mark.parametrize("name", ["TUTORIAL_BF16", "TUTORIAL_ZERO3", "HF_AUTO_ZERO2", "FP16_DYNAMIC", "NVME",
                                  "DEPRECATED"])
def test_convert_config_output_builds_the_same_strategy(tmp_path: Path, name: str) -> None:
    from lzero import ZeroStrategy

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(globals()[name]))
    code, text = convert(path)
    assert code == 0
    section = yaml.safe_load(text)["trainer"]
    assert section["strategy"]["class_path"] == "lzero.ZeroStrategy"
    ours, direct = _through_lightning_cli(section["strategy"]), ZeroStrategy(config=str(path))
    assert ours.config == direct.config
    assert ours.precision_plugin.precision == direct.precision_plugin.precision
    scalers = [getattr(s.precision_plugin.scaler, "config", None) for s in (ours, direct)]
    assert scalers[0] == scalers[1]
    assert {k: v for k, v in section.items() if k != "strategy"} == direct._deepspeed.trainer_kwargs()
    assert text.count("\n# ") + text.startswith("# ") == len(direct._deepspeed.notes)  # one comment per note


def _through_lightning_cli(strategy: dict) -> Any:
    """``trainer.strategy`` parsed and instantiated by jsonargparse as LightningCLI does it."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Union[Strategy, str])
    return parser.instantiate_classes(parser.parse_object({"strategy": strategy})).strategy


def test_convert_config_prints_refusals_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "mics_shard_size": 8, "overlap_com": True}}))
    code, text = convert(path)
    assert code == 1
    assert text.splitlines() == [
        "# refused: Unknown DeepSpeed key `zero_optimization.overlap_com`. HINT: did you mean"
        " `zero_optimization.overlap_comm`?",
        "# refused: `zero_optimization.mics_shard_size=8`: ZeRO++/MiCS is not built in lzero. HINT: remove"
        " `mics_shard_size` or set it to -1.",
    ]


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


def test_optimizer_and_scheduler_blocks_train_like_python(tmp_path: Path, in_process_fit) -> None:
    """bf16 zero2 with an AdamW `optimizer` block and a WarmupDecayLR `scheduler` block, on a model whose
    `configure_optimizers` returns nothing, against the same optimizer and schedule written in Python: the learning
    rate of every step is DeepSpeed's (linear warmup over 2 steps from 0 to 1e-3, then linear decay to 0 at step 5)
    and the parameters are equal."""
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lzero import ZeroStrategy
    from lzero.demo import DemoGPT, TextDataModule

    class NoOptimizer(DemoGPT):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return None

    class Python(DemoGPT):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = torch.optim.AdamW(self.parameters(), lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            factor = lambda s: [0.0, 5e-4, 1e-3, 2e-3 / 3, 1e-3 / 3, 0.0][min(s, 5)]  # noqa: E731  DeepSpeed's rates
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor),
                                                        "interval": "step"}}

    class Rates(Callback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
            self.seen.append(optimizer.param_groups[0]["lr"])

    def fit(cls, strategy) -> tuple[dict, list[float]]:  # type: ignore[no-untyped-def]
        seed_everything(0)
        model, rates = cls(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16), Rates()
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                          limit_val_batches=0, default_root_dir=tmp_path, callbacks=[rates])
        trainer.fit(model, datamodule=TextDataModule(block_size=8, batch_size=2, steps_per_epoch=4))
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, rates.seen

    ours, ours_rates = fit(NoOptimizer, ZeroStrategy(config=dict(BF16_WITH_BLOCKS)))
    reference, reference_rates = fit(Python, ZeroStrategy(stage=2, precision="bf16-mixed"))
    assert ours_rates == pytest.approx([0.0, 5e-4, 1e-3, 2e-3 / 3], rel=1e-12)
    assert ours_rates == reference_rates
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def test_bad_optimizer_and_scheduler_blocks_are_named(tmp_path: Path, in_process_fit) -> None:
    cases = [
        ({"type": "AdamX", "params": {}}, None, r"`optimizer.type='AdamX'` is not a type lzero builds.*'Adam"),
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


def test_warmup_lr_and_warmup_cosine_lr_rates() -> None:
    """DeepSpeed's formulas, by hand: WarmupLR "log" from 0.01 to 0.1 over 10 steps (log(s + 1) / log(10)), then 0.1;
    WarmupCosineLR relative to the optimizer's 0.5: linear warmup from 0.2 over 2 steps, cosine to 0.1 at step 6."""
    import math

    from lzero.deepspeed_optim import build_optimizer, build_scheduler, check

    def rates(scheduler_block: dict, steps: int) -> list[float]:
        opt = build_optimizer(check("optimizer", {"type": "SGD", "params": {"lr": 0.5}}), [torch.nn.Parameter(torch.zeros(1))])
        sched = build_scheduler(check("scheduler", scheduler_block), opt)
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    log = rates({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}}, 12)
    assert log == pytest.approx([0.01 + 0.09 * math.log(s + 1) / math.log(10) for s in range(10)] + [0.1, 0.1])
    cos = rates({"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.2, "warmup_num_steps": 2,
                                                       "warmup_type": "linear", "cos_min_ratio": 0.1,
                                                       "total_num_steps": 6}}, 7)
    expected = [0.2, 0.6] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) for s in range(2, 7)]
    assert cos == pytest.approx([0.5 * r for r in expected])
