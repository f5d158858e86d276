"""A model built on the meta device under zero3 starts from the weights the same code gives eagerly under DDP, with the
same seed, and trains as DDP does: [Note: replayed construction] in lzero/engine/replay.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import run_script


DDP = ["mlp:ddp:32-true", "llama:ddp:32-true", "gpt2:ddp:32-true", "t5:ddp:32-true", "lora:ddp:32-true",
       "branchy:ddp:32-true", "llama:ddp:bf16-true", "pre_lora:ddp:32-true", "pre_head:ddp:32-true",
       "pre_resize:ddp:32-true"]
LZERO = ["mlp:zero3:32-true", "mlp:zero3_offload:32-true", "mlp:zero3_offload_nvme:32-true",
         "mlp:zero3:32-true:init_module", "mlp:zero3:bf16-mixed", "llama:zero3:32-true", "llama:zero3_offload:bf16-mixed",
         "gpt2:zero3:32-true", "gpt2:zero3_offload_nvme:32-true", "t5:zero3:32-true", "lora:zero3:32-true",
         "lora:zero3_offload:32-true", "llama:zero3:bf16-true",
         # a pretrained base read into shards, with what its files do not hold drawn as eager code draws it
         "pre_lora:zero3:32-true", "pre_lora:zero3_offload:bf16-mixed", "pre_head:zero3:32-true",
         "pre_head:zero3_offload:32-true", "pre_resize:zero3:32-true", "pre_resize:zero3_offload:bf16-mixed"]


# a fresh process of their own, the Llama first: transformers is imported by the build inside `configure_model`, after
# lzero's meta context opened (the record once patched transformers only when it was imported before: 7 of 30 tensors
# were eager's); then a module whose `reset_parameters` skips its draw on the meta device
FRESH = ["llama:zero3:32-true", "branchy:zero3:32-true", "branchy:zero3_offload:bf16-mixed",
         "branchy:zero3:32-true:init_module"]
FRESH_ALONE = ["gpt2:zero3:32-true", "t5:zero3:32-true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("replay_runs")
    base = out / "pretrained"
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64, pad_token_id=0)).save_pretrained(base)
    run_script("replay_runs.py", str(out), *DDP, *LZERO, ranks=2, timeout=900, env={"REPLAY_PRETRAINED": str(base)})
    fresh = out / "fresh"
    fresh.mkdir()
    run_script("replay_runs.py", str(fresh), *FRESH, ranks=2, timeout=600)
    for run in FRESH_ALONE:  # each the first import of transformers in its process
        run_script("replay_runs.py", str(fresh), run, ranks=2, timeout=300)
    return out


def _load(runs: Path, run: str) -> dict[str, Any]:
    return torch.load(runs / f"{run.replace(':', '-')}.pt", weights_only=True)


@pytest.mark.parametrize("run", LZERO + [f"fresh/{run}" for run in FRESH + FRESH_ALONE])
def test_initial_state_is_the_eager_models_and_training_is_ddps(runs: Path, run: str) -> None:
    kind, _, precision, *_ = run.removeprefix("fresh/").split(":")
    # bf16-true builds in bf16, as Lightning's DDP does; the mixed precisions build the fp32 model
    got, want = _load(runs, run), _load(runs, f"{kind}:ddp:{'bf16-true' if precision == 'bf16-true' else '32-true'}")
    assert got["initial"].keys() == want["initial"].keys()
    for name, value in want["initial"].items():
        mine = got["initial"][name]
        # bf16-mixed: the gathered parameters are the masters' bf16 rounding; bf16-true: the fp32 model cast
        assert torch.equal(mine, value.to(mine.dtype)), name
    assert any(value.std() > 0 for value in want["initial"].values())  # random draws, not constants alone
    if kind.startswith("pre_"):  # what the files do not hold: drawn, and as eager code drew it
        new = [k for k in want["initial"] if "lora_A" in k or k.startswith("net.score") or
               (kind == "pre_resize" and k.endswith("embed_tokens.weight"))]
        assert new and all(want["initial"][k].std() > 0 for k in new)
    assert torch.equal(got["rng"], want["rng"])  # the global RNG continues where eager construction left it
    if precision in ("32-true", "bf16-true"):
        assert got["losses"] == want["losses"] and len(got["losses"]) == 10


def _engine(model: torch.nn.Module) -> Any:
    from lzero import ZeroConfig, ZeroEngine

    return ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))


def _assert_replayed_as_eager(model: torch.nn.Module, eager: dict, rng_after_eager: torch.Tensor) -> None:
    """The engine (world size 1) materializes ``model`` to the ``eager`` state dict and leaves the RNG where eager
    construction did."""
    engine = _engine(model)
    try:
        assert torch.equal(torch.get_rng_state(), rng_after_eager)
        with engine.gathered(model):
            assert all(torch.equal(v, eager[k]) for k, v in model.state_dict().items())
    finally:
        engine.remove()


def test_replayed_in_one_process_with_the_rng_where_eager_leaves_it() -> None:
    """The engine alone (world size 1): a model built in lzero's meta context materializes to the eager weights."""
    from lzero.lightning.wiring import meta_device
    from replay_runs import build

    torch.manual_seed(0)
    eager = build("mlp").state_dict()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_device():
        model = build("mlp")
    _assert_replayed_as_eager(model, eager, after_eager)


def test_a_model_built_outside_the_record_falls_back_with_a_warning() -> None:
    with torch.device("meta"):  # the user's own meta context: nothing recorded
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.warns(UserWarning, match=r"(?s)block by block: .*built outside lzero's meta context.*draws differ"):
        engine = _engine(model)
    try:
        with engine.gathered(model):
            assert all(p.std() > 0 for n, p in model.named_parameters() if n.endswith("weight"))
    finally:
        engine.remove()


def test_fabric_init_module_then_init_equals_ddp(tmp_path: Path) -> None:
    """Fabric, ``init_module(empty_init=True)`` then initialization after it (litgpt's pattern), at stage 3: a module
    whose ``reset_parameters`` branches on the meta device and a Llama imported inside the build, bitwise DDP's."""
    for strategy in ("ddp", "zero3"):
        run_script("fabric_replay_runs.py", strategy, str(tmp_path / strategy), ranks=2, timeout=300)
    ours, ddp = torch.load(tmp_path / "zero3", weights_only=True), torch.load(tmp_path / "ddp", weights_only=True)
    assert ours["state"].keys() == ddp["state"].keys() and len(ddp["state"]) > 20
    for key, value in ddp["state"].items():
        assert torch.equal(ours["state"][key], value), key
    assert ddp["state"]["branchy.w"].std() > 0
    assert torch.equal(ours["rng"], ddp["rng"])


def test_exact_init_turns_the_fallback_into_an_error_naming_the_tensor() -> None:
    """``exact_init: true``: a tensor the record cannot replay (built outside lzero's context) stops setup, naming it;
    by default the same is a warning and the model is initialized block by block."""
    from lzero import ZeroConfig, ZeroEngine
    from lzero.engine.engine import ZeroEngineError
    from lzero.lightning.wiring import meta_device

    with meta_device():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with torch.device("meta"):  # added outside the record
        model.append(torch.nn.Linear(8, 4))
    with pytest.raises(ZeroEngineError, match=r"(?s)`1.weight` \(shape \(4, 8\)\) was built outside lzero's meta"
                                              r" context.*`exact_init: true`"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3, exact_init=True))


def test_construction_that_branches_on_values_is_replayed_as_eager() -> None:
    """Control flow on values (``bool(tensor)``): the record so far is replayed on real memory to read them, so the
    construction takes eager's branch; the setup's replay then gives eager's weights and RNG."""
    from lzero.lightning.wiring import meta_device

    def build() -> torch.nn.Module:
        layer = torch.nn.Linear(8, 8)
        if (layer.weight > 0.3).any():  # true for this seed: the clamp happens, eagerly and replayed
            layer.weight.data.clamp_(max=0.3)
        return torch.nn.Sequential(layer, torch.nn.Linear(8, 4))

    torch.manual_seed(0)
    eager = build().state_dict()
    after_eager = torch.get_rng_state()
    assert eager["0.weight"].max() == 0.3
    torch.manual_seed(0)
    with meta_device():
        model = build()
    _assert_replayed_as_eager(model, eager, after_eager)


def test_a_shape_that_depends_on_values_is_refused_with_a_hint() -> None:
    from lzero.engine.replay import ReplayError
    from lzero.lightning.wiring import meta_device

    with pytest.raises(ReplayError, match=r"(?s)shape depends on values.*not known until setup.*HINT: build that part"
                                          r" in `__init__`"):
        with meta_device():
            layer = torch.nn.Linear(8, 8)
            layer.register_buffer("big", torch.nonzero(layer.weight > 0))


def test_a_tensor_nothing_wrote_is_named() -> None:
    from lzero.engine.materialize import UninitializedModuleError
    from lzero.lightning.wiring import meta_device

    with meta_device():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        model.register_parameter("scale", torch.nn.Parameter(torch.empty(8)))
    with pytest.raises(UninitializedModuleError, match=r"(?s)`scale` was allocated on the meta device.*HINT.*init_fn"):
        _engine(model)


def test_seeding_and_cpu_draws_inside_the_build_are_replayed_where_they_happened() -> None:
    """``torch.manual_seed`` inside ``configure_model``, and a real CPU draw between two layers: eager construction's
    RNG sequence, so the eager weights and the RNG after them."""
    from lzero.lightning.wiring import meta_device

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        first = torch.nn.Linear(8, 8)
        torch.rand(5, device="cpu")  # a real draw the record does not replay, but must not lose
        return torch.nn.Sequential(first, torch.nn.Linear(8, 8))

    torch.manual_seed(123)
    eager = build().state_dict()
    after_eager = torch.get_rng_state()
    torch.manual_seed(123)
    with meta_device():
        model = build()
    _assert_replayed_as_eager(model, eager, after_eager)


def test_a_cuda_replay_starts_from_a_cuda_generator_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first GPU run: a model built on the meta device before CUDA had started recorded no CUDA state, and the
    replay on CUDA was handed the CPU generator's (5056 bytes: "RNG state is wrong size"). It now starts from the
    CUDA generator as it is (nothing has drawn from it since it started at its seed)."""
    import torch

    from lzero.engine import replay

    cpu_state, cuda_state, now = torch.get_rng_state(), torch.arange(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)
    monkeypatch.setattr(replay, "_get_state", lambda device: now if device.type == "cuda" else torch.get_rng_state())
    cuda = torch.device("cuda", 0)
    assert replay.start_state((cpu_state, None), cuda) is now
    assert replay.start_state((cpu_state, cuda_state), cuda) is cuda_state
    assert replay.start_state((cpu_state, cuda_state), torch.device("cpu")) is cpu_state
    assert replay._cuda_started_since((torch.get_rng_state(), None), cuda)  # the CPU generator did not draw either
    recorded = torch.get_rng_state()
    torch.rand(1)
    assert not replay._cuda_started_since((recorded, None), cuda)
    assert not replay._cuda_started_since((torch.get_rng_state(), cuda_state), cuda)
