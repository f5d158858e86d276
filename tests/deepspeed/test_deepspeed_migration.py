"""Migrating from DeepSpeed (issue 15, acceptance 1 and 3): each realistic DeepSpeed configuration either trains the
demo model for a few steps, with parameters equal to the same configuration written in Python, or is refused with
the expected message; every configuration that trains survives ``lzero convert-config`` and LightningCLI unchanged.

The fits are in process at world size 1 (the demo GPT, two blocks of width 16, 2 optimizer steps)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import pytest
import torch
import yaml

from lzero import ZeroConfigError
from test_deepspeed_config import TUTORIAL_BF16, TUTORIAL_ZERO3  # the two tutorial files

WIDTH = 16  # the demo model's n_embd: the hidden size "auto" sizes follow (h*h = 256, 0.9*h*h = 230, 10*h = 160)


@dataclass
class Case:
    ds: dict
    """The DeepSpeed configuration (``{nvme}`` in a string: a folder of the test's own)."""

    python: dict = field(default_factory=dict)
    """The same configuration as ``ZeroStrategy`` arguments; None for a refused configuration."""

    trainer: dict = field(default_factory=dict)
    """Trainer arguments of both runs (what the Trainer says: precision, clipping, accumulation)."""

    python_trainer: dict = field(default_factory=dict)
    """Trainer arguments of the Python run only (what the configuration set on the Trainer)."""

    batch_size: int = 2
    """The DataLoader's batch size."""

    refused: Optional[str] = None
    """For a refused configuration: a regex of the message."""

    steps: int = 2
    """Optimizer steps of each fit."""

    blocks: bool = False
    """The configuration has ``optimizer``/``scheduler`` blocks: its model's ``configure_optimizers`` returns
    nothing, the Python model's returns the same optimizer and schedule."""


HF_TOP = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "steps_per_print": 2000, "wall_clock_breakdown": False,
          "bf16": {"enabled": "auto"}}
"""The top level of Hugging Face's DeepSpeed templates: batch, clipping and precision left to the Trainer."""

CASES = {
    # the two tutorial configurations of ../shared/deepspeed-config-keys.md
    "tutorial_bf16_zero2": Case(
        TUTORIAL_BF16,
        python=dict(stage=2, precision="bf16-mixed"), python_trainer=dict(accumulate_grad_batches=16), batch_size=1),
    "tutorial_fp16_zero3_offload": Case(
        TUTORIAL_ZERO3,
        python=dict(stage=3, offload_optimizer={"device": "cpu", "pin_memory": True},
                    offload_param={"device": "cpu", "pin_memory": True}, overlap_comm=True, reduce_bucket_size=50_000_000,
                    prefetch_bucket_size=50_000_000, param_persistence_threshold=1_000_000, precision="16-mixed",
                    loss_scaling=dict(loss_scale=0, initial_scale_power=16, loss_scale_window=1000)),
        python_trainer=dict(accumulate_grad_batches=8), batch_size=4),
    # Hugging Face's zero2 template: "auto" everywhere, filled from the Trainer, the DataLoader and the model
    "hf_auto_zero2_cpu_offload": Case(
        {**HF_TOP,
         "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                  "hysteresis": 2, "min_loss_scale": 1},
         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                               "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                               "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True}},
        python=dict(stage=2, offload_optimizer={"device": "cpu", "pin_memory": True}, allgather_bucket_size=200_000_000,
                    overlap_comm=True, reduce_bucket_size=WIDTH * WIDTH),
        trainer=dict(precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.5)),
    # Hugging Face's zero3 template: hidden-size "auto" sizes, DeepSpeed's 1e9 live/reuse limits (every block of
    # this small model stays gathered across the forward-backward turn), the precision chosen by the Trainer
    "hf_auto_zero3_cpu_offload": Case(
        {**HF_TOP,
         "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000,
                  "hysteresis": 2, "min_loss_scale": 1},
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                               "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                               "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                               "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                               "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                               "stage3_gather_16bit_weights_on_model_save": True}},
        python=dict(stage=3, offload_optimizer={"device": "cpu", "pin_memory": True},
                    offload_param={"device": "cpu", "pin_memory": True}, overlap_comm=True, sub_group_size=10**9,
                    reduce_bucket_size=WIDTH * WIDTH, prefetch_bucket_size=int(0.9 * WIDTH * WIDTH),
                    param_persistence_threshold=10 * WIDTH, max_live_parameters=10**9, max_reuse_distance=10**9,
                    precision="bf16-mixed"),
        trainer=dict(precision="bf16-mixed")),  # Lightning turns Trainer(precision="16-mixed") into bf16 on CPU
    "stage3_explicit_batch_triple": Case(
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_max_live_parameters": 20000,
                               "stage3_max_reuse_distance": 0}},
        python=dict(stage=3, overlap_comm=False, train_batch_size=8, max_live_parameters=20000, max_reuse_distance=0),
        python_trainer=dict(accumulate_grad_batches=2), batch_size=4),
    # DeepSpeed's rule, given two: train_batch_size 8 and micro 2 at world size 1 make accumulation 4
    "batch_accumulation_derived": Case(
        {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}},
        python=dict(stage=1, train_batch_size=8), python_trainer=dict(accumulate_grad_batches=4)),
    "stage3_nvme_offload": Case(
        {"zero_optimization": {"stage": 3, "sub_group_size": 1e8,
                               "offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "pipeline_read": True,
                                                     "pipeline_write": True},
                               "offload_param": {"device": "nvme", "nvme_path": "{nvme}", "buffer_count": 6,
                                                 "buffer_size": 1e6, "max_in_cpu": 0}},
         "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2}},
        python=dict(stage=3, sub_group_size=10**8,
                    offload_optimizer={"device": "nvme", "nvme_path": "{nvme}", "pipeline_read": True,
                                       "pipeline_write": True},
                    offload_param={"device": "nvme", "nvme_path": "{nvme}", "buffer_count": 6, "buffer_size": 10**6,
                                   "max_in_cpu": 0},
                    aio={"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2})),
    "fp16_dynamic_loss_scaling": Case(
        {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                  "hysteresis": 3, "min_loss_scale": 0.5},
         "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5}, "gradient_clipping": 1.0},
        python=dict(stage=2, reduce_bucket_size=500_000, precision="16-mixed",
                    loss_scaling=dict(loss_scale=0, initial_scale_power=12, loss_scale_window=500, hysteresis=3,
                                      min_loss_scale=0.5)),
        python_trainer=dict(gradient_clip_val=1.0)),
    "bf16_optimizer_and_scheduler_blocks": Case(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": 2, "warmup_type": "linear",
                                                           "total_num_steps": 5}}},
        python=dict(stage=2, precision="bf16-mixed"), blocks=True, steps=4),  # DeepSpeed's first 2 steps: lr 0
    "deprecated_spellings": Case(
        {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                               "cpu_offload_use_pin_memory": False,
                               "stage3_gather_fp16_weights_on_model_save": True},
         "bfloat16": {"enabled": True}},
        python=dict(stage=3, offload_optimizer={"device": "cpu", "pin_memory": False},
                    offload_param={"device": "cpu", "pin_memory": False}, precision="bf16-mixed")),
    # refused, each with the message that says what and how to fix it
    "batch_triple_inconsistent_with_world_size": Case(
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "zero_optimization": {"stage": 2}}, batch_size=4,
        refused=r"train_batch_size 16 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x world size"
                r" 1 = 8\. HINT: DeepSpeed's rule"),
    "zero_plus_plus_key": Case(
        {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True, "zeropp_loco_param": {}}},
        refused=r"2 keys of the DeepSpeed configuration are refused:\n- `zero_optimization.zero_quantized_nontrainable_"
                r"weights=True`: not built in lzero \(ZeRO\+\+'s hpZ, qwZ and qgZ are\)\. HINT: remove"
                r" `zero_quantized_nontrainable_weights` or set it to false\.\n"
                r"- `zero_optimization.zeropp_loco_param=\{\}`: not built"),
    "unknown_key": Case(
        {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 5e7}, "bf16": {"enabled": True}},
        refused=r"Unknown DeepSpeed key `zero_optimization.stage3_prefetch_bucket`\. HINT: did you mean"
                r" `zero_optimization.stage3_prefetch_bucket_size`\?"),
    "stage3_knob_at_stage2": Case(
        {"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9}},
        refused=r"`zero_optimization.stage3_max_live_parameters=1000000000.0` at stage 2: it schedules stage 3's"
                r" parameter gathers"),
}
TRAINED = [name for name, case in CASES.items() if case.refused is None]
REFUSED = [name for name, case in CASES.items() if case.refused is not None]


def _with_nvme(value: Any, nvme: str) -> Any:
    if isinstance(value, dict):
        return {k: _with_nvme(v, nvme) for k, v in value.items()}
    return value.replace("{nvme}", nvme) if isinstance(value, str) else value


def _models() -> tuple[type, type]:
    """The demo model whose ``configure_optimizers`` returns nothing, and one returning the blocks' optimizer and
    schedule written in Python (AdamW; DeepSpeed's WarmupDecayLR rates: linear warmup over 2 steps, decay to 0
    at step 5, with DeepSpeed's timing: the rate before step k is the one for its iteration k - 1)."""
    from lzero.demo import DemoGPT

    class NoOptimizer(DemoGPT):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return None

    class Python(DemoGPT):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = torch.optim.AdamW(self.parameters(), lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            factor = lambda s: [0.0, 0.0, 5e-4, 1e-3, 2e-3 / 3, 1e-3 / 3, 0.0][min(s, 6)]  # noqa: E731
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor),
                                                        "interval": "step"}}

    return NoOptimizer, Python


def fit(tmp_path: Path, strategy: Any, case: Case, model_cls: Optional[type] = None,
        **trainer_kwargs: Any) -> tuple[dict[str, torch.Tensor], Any]:
    from lightning.pytorch import Trainer, seed_everything

    from lzero.demo import DemoGPT, TextDataModule

    seed_everything(0)
    model = (model_cls or DemoGPT)(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=WIDTH)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=case.steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0, default_root_dir=tmp_path, **{**case.trainer, **trainer_kwargs})
    trainer.fit(model, datamodule=TextDataModule(block_size=8, batch_size=case.batch_size, steps_per_epoch=64))
    import lzero

    lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op otherwise)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, trainer


@pytest.mark.parametrize("name", TRAINED)
def test_config_trains_like_the_same_configuration_in_python(tmp_path: Path, in_process_fit, name: str) -> None:
    from lzero import ZeroStrategy

    case = CASES[name]
    nvme = str(tmp_path / "nvme")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_with_nvme(case.ds, nvme)))
    no_optimizer, python_optimizer = _models() if case.blocks else (None, None)
    ours, trainer = fit(tmp_path / "ds", ZeroStrategy(config=str(path)), case, no_optimizer)
    reference, ref_trainer = fit(tmp_path / "py", ZeroStrategy(**_with_nvme(case.python, nvme)), case,
                                 python_optimizer, **case.python_trainer)
    assert trainer.global_step == ref_trainer.global_step == case.steps
    assert trainer.strategy.config == ref_trainer.strategy.config  # every field, "auto" sizes included
    for attr in ("accumulate_grad_batches", "gradient_clip_val"):
        assert getattr(trainer, attr) == getattr(ref_trainer, attr), attr
    plugins = (trainer.strategy.precision_plugin, ref_trainer.strategy.precision_plugin)
    assert plugins[0].precision == plugins[1].precision
    assert getattr(plugins[0].scaler, "config", None) == getattr(plugins[1].scaler, "config", None)
    assert ours.keys() == reference.keys()
    for key in reference:
        assert torch.equal(ours[key], reference[key]), key
    from lzero.demo import DemoGPT

    torch.manual_seed(0)
    untrained = DemoGPT(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=WIDTH).state_dict()
    assert all(not torch.equal(ours[k], v.float()) for k, v in untrained.items() if k.endswith("weight"))


@pytest.mark.parametrize("name", REFUSED)
def test_config_is_refused_with_the_expected_message(tmp_path: Path, in_process_fit, name: str) -> None:
    from lzero import ZeroStrategy

    case = CASES[name]
    with pytest.raises(ZeroConfigError, match=case.refused):
        fit(tmp_path, ZeroStrategy(config=dict(case.ds)), case)


def convert(path: Path, *args: str) -> tuple[int, str]:
    from lzero.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["convert-config", str(path), *args])
    return code, out.getvalue()


def through_lightning_cli(section: dict) -> Any:
    """A ``trainer:`` section's strategy and Trainer settings, parsed and instantiated by jsonargparse as
    LightningCLI does it."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Union[Strategy, str])
    parser.add_argument("--accumulate_grad_batches", type=int, default=1)
    parser.add_argument("--gradient_clip_val", type=Optional[float], default=None)
    return parser.instantiate_classes(parser.parse_object(section))


@pytest.mark.parametrize("name", TRAINED)
def test_convert_config_output_builds_the_same_configuration(tmp_path: Path, name: str) -> None:
    """``lzero convert-config`` fed back through LightningCLI builds what ``ZeroStrategy(config=...)`` builds
    (hidden-size "auto" sizes stay "auto" in both, filled at setup): every ZeroConfig field, precision, loss scaling, the optimizer
    and scheduler blocks and the Trainer settings; one comment per filled, renamed or noticed key."""
    from lzero import ZeroStrategy

    case = CASES[name]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_with_nvme(case.ds, str(tmp_path / "nvme"))))
    code, text = convert(path)
    assert code == 0, text
    section = yaml.safe_load(text)["trainer"]
    assert section["strategy"]["class_path"] == "lzero.ZeroStrategy"
    built, direct = through_lightning_cli(section), ZeroStrategy(config=str(path))
    ds = direct._deepspeed
    assert built.strategy.config == direct.config
    assert built.strategy.precision_plugin.precision == direct.precision_plugin.precision
    scalers = [getattr(s.precision_plugin.scaler, "config", None) for s in (built.strategy, direct)]
    assert scalers[0] == scalers[1]
    for kind in ("optimizer", "scheduler"):  # the blocks travel as ZeroStrategy(deepspeed_optimizer=..., ...)
        assert getattr(built.strategy._deepspeed, kind, None) == getattr(ds, kind), kind
    assert built.accumulate_grad_batches == ds.trainer_kwargs().get("accumulate_grad_batches", 1)
    assert built.gradient_clip_val == ds.trainer_kwargs().get("gradient_clip_val")
    assert sum(line.startswith("# ") for line in text.splitlines()) == len(ds.notes)  # one comment per note


def test_converted_file_trains_through_lzero_fit(tmp_path: Path, in_process_fit, monkeypatch) -> None:
    """`lzero convert-config ds.json > strategy.yaml` then `lzero fit --config configs/demo_ddp.yaml --config
    strategy.yaml` (shrunk to one process and two steps): Hugging Face's zero3 template, its "auto" sizes carried
    through the YAML as "auto" and filled from the demo model's n_embd at setup."""
    from lightning.pytorch import Callback

    from lzero.cli import main

    class Record(Callback):
        trainer = None

        def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            Record.trainer = trainer

    monkeypatch.setattr("sys.argv", ["lzero"])
    module = types.ModuleType("lzero_test_record")  # so that LightningCLI finds the callback by class path
    module.Record = Record
    monkeypatch.setitem(sys.modules, "lzero_test_record", module)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CASES["hf_auto_zero3_cpu_offload"].ds))
    code, text = convert(path)
    assert code == 0
    (tmp_path / "strategy.yaml").write_text(text)
    root = Path(__file__).resolve().parents[2]
    assert main(["fit", "--config", str(root / "configs/demo_ddp.yaml"), "--config", str(tmp_path / "strategy.yaml"),
                 "--trainer.devices", "1", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                 "--trainer.logger", "false", "--trainer.callbacks", "lzero_test_record.Record",
                 "--trainer.enable_progress_bar", "false", "--trainer.precision", "bf16-mixed",
                 "--trainer.default_root_dir", str(tmp_path), "--model.n_layer", "2", "--model.n_embd", str(WIDTH),
                 "--model.n_head", "2", "--model.block_size", "8", "--data.block_size", "8",
                 "--data.batch_size", "2"]) == 0
    trainer = Record.trainer
    config = trainer.strategy.config
    assert trainer.global_step == 2 and config.stage == 3 and config.offload_param.device == "cpu"
    assert (config.reduce_bucket_size, config.prefetch_bucket_size, config.param_persistence_threshold) == (
        WIDTH * WIDTH, int(0.9 * WIDTH * WIDTH), 10 * WIDTH)
    assert (config.max_live_parameters, config.max_reuse_distance) == (10**9, 10**9)
