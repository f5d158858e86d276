"""Where a model is cut into pipeline stages (``plan_pipeline``), what a rank keeps of it (``Split``), the step replayed
as one stage in one process, and the pipeline options refused by name. The multi-process runs are in
tests/lightning/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lzero import ZeroConfig, ZeroConfigError
from lzero.engine.mesh import Mesh
from lzero.engine.pipeline import Placeholder, Split, StageOutput, local_stages, plan_pipeline, split_batch
from lzero.errors import ZeroEngineError


def gpt(layers: int = 4) -> nn.Module:
    from lzero.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=layers, n_head=2, n_embd=16))


def test_a_decoder_is_cut_along_its_layer_list_with_embeddings_first_and_head_last() -> None:
    plan = plan_pipeline(gpt(), 2)
    assert plan.layers == "blocks" and plan.bounds == (0, 2, 4)
    assert plan.first == ("wte", "wpe") and plan.last == ("ln_f", "lm_head")
    assert plan.tied == (("wte.weight", "lm_head.weight"),)


def test_stages_are_balanced_by_parameters_and_keep_a_layer_each() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(32, 32), nn.Linear(8, 8)])
    assert plan_pipeline(model, 2).bounds == (0, 2, 4)  # 144 | 1128: the big layer's middle lies past half of 1272
    model.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])
    assert plan_pipeline(model, 2).bounds == (0, 1, 4)  # 1056 | 216
    assert plan_pipeline(model, 4).bounds == (0, 1, 2, 3, 4)


def test_split_points_name_the_first_layer_of_each_later_stage() -> None:
    assert plan_pipeline(gpt(), 2, ["blocks.1"]).bounds == (0, 1, 4)
    with pytest.raises(ZeroConfigError, match=r"names 2 layers for 2 stages"):
        plan_pipeline(gpt(), 2, ["blocks.1", "blocks.2"])
    with pytest.raises(ZeroConfigError, match=r"`blocks.0`, which is not a layer of `blocks` past the first"):
        plan_pipeline(gpt(), 2, ["blocks.0"])
    with pytest.raises(ZeroConfigError, match=r"`wte`, which is not a layer"):
        plan_pipeline(gpt(), 2, ["wte"])
    with pytest.raises(ZeroConfigError, match="not in increasing layer order"):
        plan_pipeline(gpt(), 3, ["blocks.3", "blocks.1"])


def test_more_stages_than_layers_or_no_layer_list_are_refused() -> None:
    with pytest.raises(ZeroConfigError, match=r"4 pipeline stages for the 2 layers of `blocks`"):
        plan_pipeline(gpt(2), 4)
    with pytest.raises(ZeroConfigError, match="no layer list"):
        plan_pipeline(nn.Sequential(nn.Linear(2, 2)), 2)


def _owner(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def test_a_rank_keeps_its_stages_only_under_the_whole_model_names() -> None:
    whole = dict(gpt().named_parameters(remove_duplicate=False))  # the tied weight under both names
    for rank, kept in ((0, {"wte", "wpe", "blocks.0", "blocks.1"}), (1, {"blocks.2", "blocks.3", "ln_f", "lm_head"})):
        model = gpt()
        Split(model, plan_pipeline(model, 2), local_stages(rank, 2, 2))
        names = dict(model.named_parameters())
        assert {_owner(n) for n in names} == kept
        for name, p in names.items():
            assert torch.equal(p, whole[name]), name
    assert local_stages(1, 2, 4) == (1, 3)


def test_stages_replayed_in_one_process_give_the_whole_model() -> None:
    """Stage 0 ends where stage 1's first layer would be called; stage 1 takes that activation: the logits are the
    whole model's."""
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    want = gpt()(tokens)
    first, last = gpt(), gpt()
    plan = plan_pipeline(first, 2)
    splits = [Split(first, plan, (0,)), Split(last, plan, (1,))]
    with splits[0].replay(0, None), pytest.raises(StageOutput) as ended:
        first(tokens)
    with splits[1].replay(1, ended.value.value):
        got = last(tokens)
    assert torch.equal(got, want)


def test_a_module_of_another_stage_names_its_stage_when_called_outside_the_schedule() -> None:
    model = gpt()
    Split(model, plan_pipeline(model, 2), (1,))
    assert isinstance(model.wte, Placeholder)
    with pytest.raises(ZeroEngineError, match=r"`wte` is held by pipeline stage 0, not by this rank \(stages \(1,\)\)"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_a_batch_is_cut_into_equal_micro_batches() -> None:
    x, y = torch.arange(8).view(4, 2), torch.arange(4)
    parts = split_batch({"x": x, "y": y, "note": "same"}, 2)
    assert [p["y"].tolist() for p in parts] == [[0, 1], [2, 3]] and parts[1]["note"] == "same"
    with pytest.raises(ZeroConfigError, match=r"A batch of 4 cut into `pipeline_microbatches=3`"):
        split_batch((x, y), 3)


@pytest.mark.parametrize("options, match", [
    ({"pipeline_schedule": "zbv"}, r"`pipeline_schedule='zbv'` is refused: its split of the weight gradient"),
    ({"pipeline_schedule": "pipedream"}, r"`pipeline_schedule='pipedream'` is not a schedule lzero runs"),
    ({"pipeline_parallel_size": 0}, r"`pipeline_parallel_size=0` must be a positive whole number"),
    ({"pipeline_parallel_size": 2, "pipeline_virtual_stages": 2},
     r"`pipeline_virtual_stages=2` with `pipeline_schedule='1f1b'`"),
    ({"pipeline_microbatches": 4}, r"`pipeline_microbatches` with `pipeline_parallel_size=1`"),
    ({"pipeline_parallel_size": 2, "pipeline_split_points": "blocks.2"}, r"must be a list of module names"),
    ({"pipeline_parallel_size": 4, "pipeline_microbatches": 2}, r"1F1B schedules need at least as many micro-batches"),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "pipeline_microbatches": 5},
     r"rounds of equal micro-batches.*a multiple of 2"),
])
def test_pipeline_options_are_checked(options: dict, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**options)


def test_virtual_stages_and_micro_batches_default_to_the_schedule() -> None:
    config = ZeroConfig(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    assert (config.stages_per_rank, config.pipeline_stages, config.microbatches) == (2, 4, 4)
    assert ZeroConfig(pipeline_parallel_size=4, pipeline_microbatches=8).microbatches == 8


def test_the_mesh_lists_a_data_group_per_pipeline_and_tensor_coordinate() -> None:
    mesh = Mesh(world=2, rank=0, local_world=2, shard_size=2, ranks=(0, 2), tensor_size=2, pipeline_size=2)
    assert mesh.layers() == [(0, 2), (1, 3), (4, 6), (5, 7)]  # world 8 = pp2 x dp2 x tp2, pipeline outermost


def test_the_strategy_and_a_yaml_take_the_pipeline_keys(tmp_path, capsys) -> None:  # noqa: ANN001
    """Both doors' options and a LightningCLI strategy YAML: `pipeline_*` beside `stage`, as every ZeroConfig key;
    Fabric's door takes them too, and refuses a joint `fabric.setup(model, optimizer)` by name (lightning runs)."""
    from test_tensor_parallel import printed_config

    from lzero import ZeroFabricStrategy, ZeroStrategy

    strategy = ZeroStrategy(stage=3, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    assert (strategy.config.pipeline_stages, strategy.config.microbatches) == (4, 4)
    printed = printed_config(tmp_path, capsys, "    stage: 2\n    pipeline_parallel_size: 2\n"
                                               "    pipeline_schedule: gpipe\n    pipeline_microbatches: 8\n")
    assert all(line in printed for line in ("pipeline_parallel_size: 2", "pipeline_schedule: gpipe",
                                            "pipeline_microbatches: 8"))
    assert ZeroFabricStrategy(stage=2, pipeline_parallel_size=2).config.pipeline_parallel_size == 2
    with pytest.raises(ZeroConfigError, match=r"`stage='auto'` with `pipeline_parallel_size=2`"):
        ZeroFabricStrategy(stage="auto", pipeline_parallel_size=2)


def test_an_evaluation_batch_they_do_not_divide_runs_in_fewer_micro_batches() -> None:
    """A short last validation batch (6 rows, 4 micro-batches asked) runs as 3 micro-batches of 2; training refuses."""
    batch = (torch.arange(12).view(6, 2),)
    assert [p[0].shape[0] for p in split_batch(batch, 4, fewer=True)] == [2, 2, 2]
    assert len(split_batch((torch.arange(7),), 4, fewer=True)) == 1  # a prime: one micro-batch
    with pytest.raises(ZeroConfigError, match="A batch of 6 cut into `pipeline_microbatches=4`"):
        split_batch(batch, 4)
