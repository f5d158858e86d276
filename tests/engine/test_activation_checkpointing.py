"""Activation checkpointing (lzero/engine/activation_checkpointing.py) against the same training without it.

The world-size-2 runs are tests/engine/ac_runs.py (one launched script: DemoGPT with dropout 0.1, 3 steps,
zero1/zero2/zero3 and zero3 built on the meta device, each plainly and checkpointed). The rest runs in
this process on small modules, without a process group.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from _launch import run_script
from lzero import ZeroConfig, ZeroConfigError
from lzero.engine import activation_checkpointing as ac

LAYERS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ac_runs")
    run_script("ac_runs.py", str(out), ranks=2)
    return out


def load(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero3_meta"])
def test_checkpointed_training_is_bitwise_equal_to_plain(runs: Path, stage: str) -> None:
    plain, ours = load(runs, stage), load(runs, f"{stage}_ac")
    assert ours["params"].keys() == plain["params"].keys()
    for k, v in plain["params"].items():
        assert torch.equal(ours["params"][k], v), f"{k}: max |diff| {(ours['params'][k] - v).abs().max()}"
    assert ours["losses"] == plain["losses"] and len(plain["losses"]) == 3  # dropout 0.1: checkpoint restores RNG
    assert ours["grad_norms"] == plain["grad_norms"]
    blocks = [f"model.blocks.{i}" for i in range(LAYERS)]
    # True means the stage-3 units: the blocks and, at this size, the two Embedding layers (a repeated class)
    expected = blocks + ["model.wpe", "model.wte"] if stage.startswith("zero3") else blocks
    assert ours["names"]["checkpointed_forwards"] == expected
    assert plain["names"]["checkpointed_forwards"] == []
    assert ours["built_on"] == (("cpu", "meta") if stage == "zero3_meta" else ("cpu", "cpu"))


@pytest.mark.parametrize("stage", ["zero3", "zero3_meta"])
def test_zero3_recomputation_runs_on_the_block_regathered_before_its_backward(runs: Path, stage: str) -> None:
    plain, ours = load(runs, stage), load(runs, f"{stage}_ac")
    for step in range(3):
        forward = [(i, "GATHERED", False) for i in range(LAYERS)]
        assert plain["ln_1"][step] == forward
        # checkpointed: each block's LayerNorm runs again inside backward (the recomputation, last block first),
        # and its block is whole then
        assert ours["ln_1"][step] == forward + [(i, "GATHERED", True) for i in reversed(range(LAYERS))]
    # the recomputation needs no gather of its own: the pre-backward gather serves it. 4 units, each gathered in
    # forward and again in backward: 3 blocks and wpe (wte's weight is tied to the head, so it is in the root)
    assert ours["launches"] == plain["launches"] == [8, 8, 8]


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero3_meta"])
def test_names_state_dict_and_checkpoint_keys_are_the_plain_models(runs: Path, stage: str) -> None:
    plain, ours = load(runs, stage), load(runs, f"{stage}_ac")
    reference = ours["reference_keys"]  # a DemoGPT that never met a strategy
    assert ours["names"]["state_dict"] == plain["names"]["state_dict"] == reference
    assert ours["names"]["checkpoint"] == plain["names"]["checkpoint"] == reference
    assert ours["names"]["parameters"] == plain["names"]["parameters"]
    assert not any("_checkpoint_wrapped_module" in k for k in reference)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero3_meta"])
def test_forward_is_restored_after_fit(runs: Path, stage: str) -> None:
    ours = load(runs, f"{stage}_ac")
    assert ours["instance_forwards"] == []
    assert ours["forward_is_class_method"]


# --- in this process -------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return x + scale * self.drop(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, scale=0.5)
        return self.head(x)


def grads_after_backward(model: Net, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    x = torch.randn(4, 8, requires_grad=True)
    model(x).square().sum().backward()
    return x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_apply_recomputes_bitwise_and_remove_restores_forward() -> None:
    torch.manual_seed(0)
    plain, model = Net(), Net()
    model.load_state_dict(plain.state_dict())
    ref = grads_after_backward(plain)
    handle = ac.apply(model, ac.CheckpointPolicy(True), ZeroConfig(stage=2))
    assert sorted(handle.modules) == ["layers.0", "layers.1", "layers.2"]
    assert all("forward" in layer.__dict__ for layer in model.layers)
    got = grads_after_backward(model)
    assert [layer.calls for layer in model.layers] == [2, 2, 2]  # forward, then recomputed in backward
    assert torch.equal(got[0], ref[0])  # dropout 0.2: the recomputation sees the forward's RNG state
    assert all(torch.equal(got[1][n], g) for n, g in ref[1].items())
    with torch.no_grad():  # no backward to come: plain forward, nothing kept for a recomputation
        model(torch.randn(2, 8))
    assert [layer.calls for layer in model.layers] == [3, 3, 3]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    handle.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())
    grads_after_backward(model)
    assert [layer.calls for layer in model.layers] == [4, 4, 4]


def test_cpu_checkpointing_saves_the_inputs_through_save_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[bool] = []
    saved: list[torch.Size] = []

    class Spy(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False) -> None:
            super().__init__(pin_memory=pin_memory)
            entered.append(pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda t: saved.append(t.shape) or pack(t)

    monkeypatch.setattr(ac, "save_on_cpu", Spy)
    torch.manual_seed(0)
    plain, model = Net(), Net()
    model.load_state_dict(plain.state_dict())
    ref = grads_after_backward(plain)
    ac.apply(model, ac.CheckpointPolicy([Layer], cpu=True), ZeroConfig(stage=1))
    got = grads_after_backward(model)
    assert entered == [False] * LAYERS  # CPU tensors: nothing to pin
    assert saved == [torch.Size([4, 8])] * LAYERS  # only each layer's input; the rest is recomputed
    assert all(torch.equal(got[1][n], g) for n, g in ref[1].items())


def test_modules_inside_checkpoint_wrapper_are_skipped_with_a_warning() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Net()
    model.layers[1] = checkpoint_wrapper(model.layers[1])
    with pytest.warns(UserWarning, match=r"skips \['layers.1._checkpoint_wrapped_module'\]: already inside"):
        handle = ac.apply(model, ac.CheckpointPolicy(["Layer"]), ZeroConfig(stage=2))
    assert sorted(handle.modules) == ["layers.0", "layers.2"]


def test_applying_twice_replaces_lzeros_forward_instead_of_stacking() -> None:
    model = Net()
    ac.apply(model, ac.CheckpointPolicy(True), ZeroConfig(stage=1))
    handle = ac.apply(model, ac.CheckpointPolicy(True), ZeroConfig(stage=1))
    grads_after_backward(model)
    assert [layer.calls for layer in model.layers] == [2, 2, 2]
    handle.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("value, match", [
    ("Layer", r"`activation_checkpointing='Layer'` must be True, False/None, or a list.*HINT"),
    (Layer, r"`activation_checkpointing=<class .*Layer'>` must be"),
    (3, r"`activation_checkpointing=3` must be"),
    (["Layer", 3], r"`activation_checkpointing=\['Layer', 3\]` must be"),
    ([], r"`activation_checkpointing=\[\]` names no module"),
])
def test_wrong_types_are_refused_at_construction(value, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ac.CheckpointPolicy(value)


def test_cpu_checkpointing_alone_is_refused() -> None:
    with pytest.raises(ZeroConfigError, match=r"`cpu_checkpointing=True` .* checkpoints no module. HINT: also set"):
        ac.CheckpointPolicy(None, cpu=True)
    with pytest.raises(ZeroConfigError, match=r"`cpu_checkpointing='yes'` must be True or False"):
        ac.CheckpointPolicy(True, cpu="yes")


@pytest.mark.parametrize("value, match", [
    (["Layr"], r"names 'Layr', which Net does not contain. HINT: did you mean 'Layer'\? the model's module classes"
               r" are \['Dropout', 'Layer', 'Linear', 'ModuleList', 'Net'\]"),
    ([nn.LayerNorm], r"names <class 'torch.nn.modules.normalization.LayerNorm'>, which Net does not contain. HINT:"
                     r" did you mean 'Layer'\?"),
    (["some.module.Layer"], r"names 'some.module.Layer', which Net does not contain"),
])
def test_a_name_the_model_does_not_contain_is_refused(value, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ac.apply(Net(), ac.CheckpointPolicy(value), ZeroConfig(stage=2))


def test_true_without_repeated_blocks_asks_for_names() -> None:
    with pytest.raises(ZeroConfigError, match=r"Sequential has no module class with two or more instances.*HINT:"
                                              r" name the modules"):
        ac.apply(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ac.CheckpointPolicy(True), ZeroConfig(stage=2))


@pytest.mark.parametrize("value", [["ModuleList"], ["Net"]])
def test_zero3_refuses_a_module_around_units(value: list[str]) -> None:
    with pytest.raises(ZeroConfigError, match=r"contains the stage-3 units \['layers.0', 'layers.1', 'layers.2'\];"
                                              r" recomputing it .* HINT: checkpoint the units themselves"):
        ac.apply(Net(), ac.CheckpointPolicy(value), ZeroConfig(stage=3))
    ac.apply(Net(), ac.CheckpointPolicy(value), ZeroConfig(stage=2)).remove()  # fine without sharded parameters


def test_a_forward_patched_on_the_instance_is_refused() -> None:
    model = Net()
    model.layers[1].forward = lambda x, scale=1.0: x
    with pytest.raises(ZeroConfigError, match=r"module `layers.1` \(Layer\) already has a `forward` of its own"
                                              r" instance .*HINT: remove that patch"):
        ac.apply(model, ac.CheckpointPolicy(True), ZeroConfig(stage=2))
    assert "forward" not in model.layers[0].__dict__  # nothing applied


def test_a_bad_name_fails_in_setup_before_the_first_step(in_process_fit) -> None:
    from lightning.pytorch import Callback, LightningModule, Trainer

    from lzero import ZeroStrategy

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Steps(Callback):
        started = 0

        def on_train_batch_start(self, *args) -> None:
            Steps.started += 1

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Steps()],
                      strategy=ZeroStrategy(stage=2, activation_checkpointing=["Layers"]))
    with pytest.raises(ZeroConfigError, match=r"names 'Layers', which Module does not contain. HINT: did you mean"
                                              r" 'Layer'\?"):
        trainer.fit(Module(), loader)
    assert Steps.started == 0


# --- DeepSpeed's block -----------------------------------------------------------------------


def test_from_deepspeed_maps_cpu_checkpointing_and_accepts_defaults() -> None:
    defaults = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
                "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}
    assert ac.from_deepspeed(defaults) == {"cpu_checkpointing": False}
    assert ac.from_deepspeed({"cpu_checkpointing": True}) == {"cpu_checkpointing": True}
    assert ac.from_deepspeed({}) == {"cpu_checkpointing": False}


@pytest.mark.parametrize("block, match", [
    ({"partition_activations": True}, r"`partition_activations: true` is not supported: .*tensor \(model\) parallel"),
    ({"contiguous_memory_optimization": True}, r"`contiguous_memory_optimization: true` is not supported: .*buffer"),
    ({"synchronize_checkpoint_boundary": True}, r"`synchronize_checkpoint_boundary: true` is not supported"),
    ({"profile": True}, r"`profile: true` is not supported: .*torch.profiler"),
    ({"number_checkpoints": 4}, r"`number_checkpoints=4` sizes the buffer of `contiguous_memory_optimization`"),
    ({"cpu_checkpoint": True}, r"Unknown DeepSpeed activation_checkpointing key `cpu_checkpoint`. HINT: did you mean"
                               r" `cpu_checkpointing`\?"),
    ({"cpu_checkpointing": "true"}, r"`cpu_checkpointing='true'` must be true or false"),
    (["cpu_checkpointing"], r"must be a JSON object"),
])
def test_from_deepspeed_refuses_what_lzero_does_not_do(block, match: str) -> None:
    with pytest.raises(ZeroConfigError, match=match):
        ac.from_deepspeed(block)
