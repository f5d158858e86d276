"""``tp_plan``: tensor parallel without user code (issue 58, slice 2). The strategy applies ``"auto"`` (a Hugging Face
model's ``base_model_tp_plan``) or a dict of module-name patterns to ``"colwise"``/``"rowwise"``; the tiny Llama so
planned trains bitwise as under the user-written plan over q/k/v/o and gate/up/down (same styles on the same modules),
at zero1 and zero2, tp2 x dp2 and tp2 x dp1, and within tensor_parallel_runs' tolerance of one process. Each refusal is
tested on the plan's own functions, without a process group. See [Note: the tensor-parallel plan] in
lzero/engine/tensor_parallel_plan.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from _launch import run_script
from lzero import ZeroConfig, ZeroConfigError, ZeroStrategy
from lzero.engine.tensor_parallel_plan import matches, resolve_plan
from lzero.hf.tensor_parallel_plan import auto_plan, plan_for
from test_tensor_parallel import _close, _load, printed_config


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tensor_parallel_runs import save_llama

    folder = tmp_path_factory.mktemp("tp_plan_llama")
    save_llama(folder)
    return folder


@pytest.fixture(scope="module")
def runs(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp_plan_runs")
    run_script("tp_plan_runs.py", str(out), str(llama), ranks=4)
    run_script("tp_plan_runs.py", str(out), str(llama), ranks=2)
    return out


def _bitwise(one: dict, two: dict) -> None:
    assert one["losses"] == two["losses"] and one["norms"] == two["norms"] and one["val_loss"] == two["val_loss"]
    assert one["params"].keys() == two["params"].keys()
    for name, value in one["params"].items():
        assert torch.equal(value, two["params"][name]), name


@pytest.mark.parametrize("dp", [2, 1])
@pytest.mark.parametrize("stage", [1, 2])
def test_auto_plan_equals_the_user_plan_and_one_process(runs: Path, stage: int, dp: int) -> None:
    auto = _load(runs, f"auto_zero{stage}_dp{dp}")
    _bitwise(auto, _load(runs, f"user_zero{stage}_dp{dp}"))
    _close(auto, _load(runs, f"reference_llama_dp{dp}"))


@pytest.mark.parametrize("dp", [2, 1])
def test_dict_plan_built_in_configure_model_equals_the_user_plan(runs: Path, dp: int) -> None:
    _bitwise(_load(runs, f"dict_zero2_dp{dp}"), _load(runs, f"user_zero2_dp{dp}"))


@pytest.mark.parametrize("dp", [2, 1])
@pytest.mark.parametrize("how", ["auto", "partition", "user"])
def test_a_deepspeed_tensor_parallel_block_equals_the_user_plan(runs: Path, dp: int, how: str) -> None:
    """The seeds' ``{"tensor_parallel": {"tp_size": 2}}`` (the model's own plan), AutoTP's ``partition_config``
    regexes, and the block beside a ``configure_model`` that parallelizes (the user's plan first): each bitwise the
    user-written plan's run."""
    _bitwise(_load(runs, f"deepspeed_{how}_zero2_dp{dp}"), _load(runs, f"user_zero2_dp{dp}"))


def test_a_plan_beside_a_parallelized_model_is_refused(runs: Path) -> None:
    message = _load(runs, "refused_twice")["message"]
    assert message is not None and "`tp_plan='auto'` on a model already parallelized" in message and "HINT" in message


def test_patterns_match_one_component_per_star() -> None:
    assert matches("layers.*.mlp.up_proj", "layers.0.mlp.up_proj")
    assert matches("layers.*.mlp.*_proj", "layers.11.mlp.gate_proj")
    assert not matches("layers.*.up_proj", "layers.0.mlp.up_proj")  # `*` is one component, not several
    assert not matches("layers.*", "layers.0.mlp")


def _llama(llama: Path) -> nn.Module:
    from tensor_parallel_runs import Module

    return Module(llama=llama)


def test_auto_reads_the_base_model_plan_under_its_prefix(llama: Path) -> None:
    plan = auto_plan(_llama(llama))  # LightningModule.model (LlamaForCausalLM).model (LlamaModel)
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise" and len(plan) == 7
    resolved = plan_for(_llama(llama), "auto", 2)
    assert len(resolved) == 14 and resolved["model.model.layers.1.self_attn.o_proj"] == "rowwise"


@pytest.mark.parametrize("plan, match", [
    ({"model.model.layers.*.mlp.up_proj": "colwise_rep"}, r"style 'colwise_rep' .* is not built.*HINT.*configure_model"),
    ({"model.model.layers.*.mlp.up_proj": "sequence_parallel"}, r"style 'sequence_parallel' .* is not built.*HINT"),
    ({"model.layers.*.mlp.up_proj": "colwise"}, r"pattern 'model.layers.\*.mlp.up_proj' matches no module.*HINT"),
    ({"model.model.embed_tokens": "colwise"}, r"`model.model.embed_tokens`, of type Embedding: .*nn.Linear only.*HINT"),
])
def test_a_plan_that_cannot_be_applied_is_refused_by_name(llama: Path, plan: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        plan_for(_llama(llama), plan, 2)


def test_sizes_the_tensor_dimension_does_not_divide_are_refused(llama: Path) -> None:
    odd = nn.Sequential(nn.Linear(6, 9), nn.Linear(9, 6))
    with pytest.raises(ZeroConfigError, match=r"'colwise' on `0`, whose out_features=9 is not divisible by"
                                              r" tensor_parallel_size=2.*HINT"):
        resolve_plan(odd, {"0": "colwise"}, 2)
    with pytest.raises(ZeroConfigError, match=r"'rowwise' on `1`, whose in_features=9 .*tensor_parallel_size=2"):
        resolve_plan(odd, {"1": "rowwise"}, 2)
    assert resolve_plan(odd, {"0": "colwise", "1": "rowwise"}, 3) == {"0": "colwise", "1": "rowwise"}
    with pytest.raises(ZeroConfigError, match=r"LlamaForCausalLM: tensor_parallel_size=4 does not divide its"
                                              r" num_key_value_heads=2.*HINT"):
        plan_for(_llama(llama), "auto", 4)  # every Linear divides by 4: the heads do not
    with pytest.raises(ZeroConfigError, match=r"tensor_parallel_size=8 does not divide its num_attention_heads=4"):
        plan_for(_llama(llama), "auto", 8)


def test_auto_on_a_model_without_a_plan_is_refused(llama: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    holder = nn.Module()
    holder.model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(ZeroConfigError, match=r"`tp_plan='auto'`: GPT2LMHeadModel \(`model`\) has no"
                                              r" `config.base_model_tp_plan`.*HINT"):
        plan_for(holder, "auto", 2)
    with pytest.raises(ZeroConfigError, match=r"`tp_plan='auto'` on Sequential, which holds no Hugging Face.*HINT"):
        plan_for(nn.Sequential(nn.Linear(4, 4)), "auto", 2)


@pytest.mark.parametrize("options, match", [
    ({"tp_plan": "auto"}, r"`tp_plan='auto'` with `tensor_parallel_size=1`.*HINT"),
    ({"tp_plan": {"up": "colwise"}}, r"`tp_plan=\{'up': 'colwise'\}` with `tensor_parallel_size=1`.*HINT"),
    ({"tp_plan": "yes", "tensor_parallel_size": 2}, r"`tp_plan='yes'` is not None, 'auto' or .*HINT"),
    ({"tp_plan": {}, "tensor_parallel_size": 2}, r"`tp_plan=\{\}` is not None, 'auto' or .*HINT"),
    ({"tp_plan": {"up": "rowwise_rep"}, "tensor_parallel_size": 2}, r"style 'rowwise_rep' for 'up' is not built.*HINT"),
])
def test_the_config_refuses_a_plan_it_cannot_apply(options: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**options)


def test_the_strategy_and_yaml_take_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ZeroStrategy(stage=2, tensor_parallel_size=2, tp_plan="auto").config.tp_plan == "auto"
    printed = printed_config(tmp_path, capsys, "    stage: 2\n    tensor_parallel_size: 2\n    tp_plan:\n"
                                               "      model.up: colwise\n      model.down: rowwise\n")
    assert "model.up: colwise" in printed and "tensor_parallel_size: 2" in printed
