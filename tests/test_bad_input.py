"""Bad input gets an error that names the value and the fix."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lzero import ZeroConfig, ZeroConfigError, ZeroOptimizerError
from lzero.optimizer import check_optimizer


@pytest.mark.parametrize("stage", [5, -1, "two", True])
def test_unknown_stage(stage) -> None:
    with pytest.raises(ZeroConfigError, match=re.escape(f"`stage={stage!r}` is not a ZeRO stage") + ".*HINT"):
        ZeroConfig(stage=stage)


def test_stage_0_points_to_ddp() -> None:
    with pytest.raises(ZeroConfigError, match="stage 0 .*HINT: .*use `strategy='ddp'`"):
        ZeroConfig(stage=0)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_prefetch_must_be_whole_and_non_negative(value) -> None:
    with pytest.raises(ZeroConfigError, match=f"`prefetch={value!r}`"):
        ZeroConfig(stage=3, prefetch=value)


@pytest.mark.parametrize("field", ["reduce_bucket_size", "allgather_bucket_size"])
@pytest.mark.parametrize("value", [0, -5, 2.5, "big"])
def test_bucket_size_must_be_positive(field: str, value) -> None:
    with pytest.raises(ZeroConfigError, match=f"`{field}={value!r}` must be a positive whole number"):
        ZeroConfig(**{field: value})


def test_deepspeed_style_float_bucket_accepted() -> None:
    assert ZeroConfig(reduce_bucket_size=5e8).reduce_bucket_size == 500_000_000


def test_unknown_option_suggests_the_field() -> None:
    from lzero import ZeroStrategy

    with pytest.raises(ZeroConfigError, match="Unknown lzero strategy option `reduce_bucket`.*reduce_bucket_size"):
        ZeroStrategy(reduce_bucket=10)


def test_unknown_config_field_suggests_the_field() -> None:
    with pytest.raises(ZeroConfigError, match=r"Unknown ZeroConfig field `prefetch_block`\. HINT: did you mean `prefetch`\?"):
        ZeroConfig(stage=3, prefetch_block=2)
    with pytest.raises(ZeroConfigError, match="Unknown ZeroConfig field `zzz`. HINT: the options are: stage, "):
        ZeroConfig(zzz=1)
    assert ZeroConfig(stage=3, prefetch=2).prefetch == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"checkpoint_format": "zip"}, "`checkpoint_format='zip'` is not one of 'sharded', 'full'"),
    ({"async_save": "yes"}, "`async_save='yes'` must be true or false"),
    ({"async_save": True, "checkpoint_format": "full"}, "`async_save=True` needs `checkpoint_format='sharded'`"),
])
def test_bad_checkpoint_options_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**kwargs)


def test_keep_fp32_modules_must_name_model_classes() -> None:
    from lzero import ZeroEngine, ZeroEngineError
    from lzero.engine.mixed_precision import PrecisionPolicy

    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    with pytest.raises(ZeroEngineError, match=r"keep_fp32_modules names \['LayerNrom'\].*HINT.*LayerNorm"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=2),
                   PrecisionPolicy(torch.bfloat16, keep_fp32_modules=["LayerNrom"]))


def test_batchnorm_under_bf16_params_is_refused_unless_kept_in_fp32() -> None:
    from lzero import ZeroEngine, ZeroEngineError
    from lzero.engine.mixed_precision import PrecisionPolicy

    def engine(keep):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        return ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=2),
                          PrecisionPolicy(torch.bfloat16, keep_fp32_modules=keep))

    with pytest.raises(ZeroEngineError, match=r"(?s)BatchNorm1d.*keep_fp32_modules=\['BatchNorm1d'\]"):
        engine(())
    kept = engine(["BatchNorm1d"])
    assert {str(p.dtype) for p in kept.units[0].params} | {str(p.dtype) for p in kept.units[-1].params} == {
        "torch.bfloat16", "torch.float32"}
    kept.remove()


def test_nvme_paths_of_the_two_blocks_must_agree() -> None:
    with pytest.raises(ZeroConfigError, match=r"`offload_optimizer.nvme_path` and `offload_param.nvme_path` differ"):
        ZeroConfig(stage=3, offload_optimizer={"device": "nvme", "nvme_path": "/a"},
                   offload_param={"device": "nvme", "nvme_path": "/b"})


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SparseAdam(ps),
    lambda ps: type("Shampoo", (torch.optim.SGD,), {})(ps, lr=0.1),
])
def test_optimizer_off_the_allow_list(make) -> None:
    opt = make([nn.Parameter(torch.zeros(3))])
    with pytest.raises(ZeroOptimizerError, match=f"`.*{type(opt).__qualname__}` element by element.*Muon, Adafactor.*"
                                                 "optimizer_partition='per_tensor'.*allow_untested_optimizer=True"):
        check_optimizer(opt, allow_untested=False)
    check_optimizer(opt, allow_untested=True)
    check_optimizer(opt, allow_untested=False, partition="per_tensor")  # each parameter stepped whole by its owner


def test_lbfgs_is_refused_with_its_reason_whatever_the_flags() -> None:
    opt = torch.optim.LBFGS([nn.Parameter(torch.zeros(3))])
    for allow, partition in ((False, "auto"), (True, "auto"), (True, "per_tensor")):
        with pytest.raises(ZeroOptimizerError, match="`torch.optim.lbfgs.LBFGS`: L-BFGS keeps one history.*closure"
                                                     ".*HINT: train with DDP"):
            check_optimizer(opt, allow_untested=allow, partition=partition)


def test_matrix_optimizers_pass_by_class() -> None:
    opt = torch.optim.Muon([nn.Parameter(torch.zeros(3, 3))])
    check_optimizer(opt, allow_untested=False)
    check_optimizer(torch.optim.Adafactor([nn.Parameter(torch.zeros(3))]), allow_untested=False)


def test_allow_listed_optimizers_pass() -> None:
    p = [nn.Parameter(torch.zeros(3))]
    for opt in (torch.optim.AdamW(p), torch.optim.SGD(p, lr=0.1), torch.optim.Adagrad(p), torch.optim.RMSprop(p)):
        check_optimizer(opt, allow_untested=False)


@pytest.mark.parametrize("precision", ["16-true", "64-true", "transformer-engine"])
def test_unsupported_precision_is_refused_by_name(precision: str) -> None:
    from lzero import ZeroPrecision, ZeroPrecisionError

    with pytest.raises(ZeroPrecisionError, match=f"precision='{precision}' is not supported.*HINT"):
        ZeroPrecision(precision)


def test_trainer_precision_becomes_zero_precision() -> None:
    from lightning.pytorch import Trainer

    from lzero import ZeroPrecision, ZeroPrecisionError, ZeroStrategy

    plugin = Trainer(strategy="zero2", accelerator="cpu", devices=1, precision="bf16-mixed",
                     logger=False).strategy.precision_plugin
    assert isinstance(plugin, ZeroPrecision) and plugin.param_dtype == torch.bfloat16
    assert plugin.reduce_dtype == torch.float32
    with pytest.raises(ZeroPrecisionError, match="precision='64-true' is not supported"):
        Trainer(strategy="zero2", accelerator="cpu", devices=1, precision="64-true", logger=False)
    explicit = ZeroStrategy(stage=2, precision="bf16-true")  # the strategy's own precision wins
    trainer = Trainer(strategy=explicit, accelerator="cpu", devices=1, precision="32-true", logger=False)
    assert trainer.strategy.precision_plugin.precision == "bf16-true"
    # fp16 on CPU: Lightning rewrites Trainer(precision="16-mixed") to bf16-mixed, so fp16 is asked for
    # through the strategy or an explicit plugin, and either wins over the Trainer's flag
    fp16 = Trainer(strategy=ZeroStrategy(stage=3, precision="16-mixed"), accelerator="cpu", devices=1,
                   precision="bf16-mixed", logger=False).strategy.precision_plugin
    assert fp16.precision == "16-mixed" and fp16.param_dtype == torch.float16 and fp16.loss_scale == 2.0**16
    fp16 = Trainer(strategy="zero1", plugins=[ZeroPrecision("16-mixed")], accelerator="cpu", devices=1,
                   logger=False).strategy.precision_plugin
    assert fp16.precision == "16-mixed" and fp16.reduce_dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    ({"precision": "32-true", "param_dtype": torch.bfloat16}, "`param_dtype` applies to precision='bf16-mixed' or"),
    ({"precision": "16-mixed", "param_dtype": torch.bfloat16}, "`param_dtype=torch.bfloat16` under precision='16-mixed'"),
    ({"precision": "16-mixed", "reduce_dtype": torch.float16}, "`reduce_dtype=torch.float16` is not supported"),
    ({"precision": "bf16-mixed", "loss_scaling": "x"}, "`loss_scaling` applies to precision='16-mixed' only"),
    ({"precision": "bf16-mixed", "nonfinite_grads": "ignore"}, "`nonfinite_grads='ignore'`"),
    ({"precision": "bf16-mixed", "keep_fp32_modules": "LayerNorm"}, "must be a list of class names"),
    ({"precision": "32-true", "keep_fp32_modules": ["LayerNorm"]}, "`keep_fp32_modules` applies to 16-bit"),
])
def test_bad_precision_options_are_named(kwargs: dict, match: str) -> None:
    from lzero import ZeroPrecision, ZeroPrecisionError

    with pytest.raises(ZeroPrecisionError, match=match):
        ZeroPrecision(**kwargs)


def test_foreign_checkpoint_needing_pickle_is_refused_with_a_hint(tmp_path) -> None:
    import argparse

    from lzero import ZeroStrategy

    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(ValueError, match=r"(?s)needs pickle to load.*weights_only=False"):
        ZeroStrategy(stage=2).load_checkpoint(path)
    assert "state_dict" in ZeroStrategy(stage=2).load_checkpoint(path, weights_only=False)  # the user's own call


@pytest.mark.parametrize("content", [b"not a checkpoint at all", None])
def test_resume_from_something_that_is_not_a_checkpoint(tmp_path, content) -> None:
    from lzero import ZeroStrategy

    path = tmp_path / "bogus.ckpt"
    if content is not None:
        path.write_bytes(content)
        match = "(?s)is not a readable Lightning checkpoint.*HINT"
    else:
        match = "does not exist"
    strategy = ZeroStrategy(stage=2)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        strategy.load_checkpoint(path)


def test_resume_from_a_file_without_state_dict(tmp_path) -> None:
    from lzero import ZeroStrategy

    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="holds no 'state_dict'"):
        ZeroStrategy(stage=1).load_checkpoint(path)


def test_add_param_group_after_setup_is_refused() -> None:
    from lzero import ZeroEngine, ZeroOptimizer

    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=1))
    zopt = ZeroOptimizer(opt, engine, 0)
    with pytest.raises(ZeroOptimizerError, match="add_param_group.*HINT"):
        zopt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    engine.remove()


def test_meta_module_without_reset_parameters_is_named() -> None:
    from lzero import ZeroEngine
    from lzero.engine.materialize import UninitializedModuleError

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UninitializedModuleError, match=r"Module `1` \(Scale\).*reset_parameters.*init_fn"):
        ZeroEngine(model, [opt], ZeroConfig(stage=3, unit_modules=("Linear",)))


def test_meta_parameter_no_initializer_wrote_is_named() -> None:
    """An ``init_fn`` that skips a module without ``reset_parameters()``: the unwritten tensor is named
    instead of training from uninitialized memory (see [Note: meta-device initialization])."""
    from lzero import ZeroEngine
    from lzero.engine.materialize import UninitializedModuleError

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    def init_linear_only(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UninitializedModuleError, match=r"Module `1` \(Scale\).*nothing wrote `1.gain`.*the `init_fn`.*HINT"):
        ZeroEngine(model, [opt], ZeroConfig(stage=3, unit_modules=("Linear",)), init_fn=init_linear_only)


def test_unknown_unit_module_class_is_named() -> None:
    from lzero import ZeroEngine

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"unit_modules names \['Block'\].*HINT.*Linear"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3, unit_modules=["Block"]))


def _tiny_fit(strategy, accumulate: int, batch_size: int = 4):
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), batch_size=batch_size)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=accumulate,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)
    return trainer


def test_inconsistent_global_batch_is_refused_with_the_three_numbers(in_process_fit) -> None:
    from lzero import ZeroStrategy

    with pytest.raises(ZeroConfigError, match=r"train_batch_size=16 but micro batch 4 x accumulate_grad_batches 2"
                                              r" x world size 1 = 8\. HINT"):
        _tiny_fit(ZeroStrategy(stage=2, train_batch_size=16), accumulate=2)
    trainer = _tiny_fit(ZeroStrategy(stage=2, train_batch_size=8), accumulate=2)
    assert trainer.strategy.global_batch_size == 8


def test_whole_tensor_optimizer_on_a_tensor_parallel_cut_is_refused() -> None:
    from lzero.engine.engine import _refuse_cut_whole_tensors
    from lzero.engine.partition import ParamSpec
    from lzero.engine.tensor_layout import TensorLayout
    from lzero.errors import ZeroEngineError

    cut = ParamSpec("mlp.up.weight", (8, 4), (0, 0), whole=TensorLayout((16, 4), 0, 2), tensor_rank=1)
    _refuse_cut_whole_tensors([cut], frozenset({(1, 0)}))  # an elementwise group: fine
    with pytest.raises(ZeroEngineError, match=r"`mlp.up.weight` is cut by tensor parallel.*HINT: use an elementwise"):
        _refuse_cut_whole_tensors([cut], frozenset({(0, 0)}))
