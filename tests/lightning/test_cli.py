"""The ``lzero`` console script: LightningCLI for any model, plus the checkpoint commands."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from lzero.cli import main

USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from lightning.pytorch import LightningModule


    class UserLM(LightningModule):
        """A user's model whose defaults share names with the demo GPT's (vocab_size, n_embd, lr)."""

        last = None

        def __init__(self, vocab_size: int = 50, n_embd: int = 8, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.emb = nn.Embedding(vocab_size, n_embd)
            self.head = nn.Linear(n_embd, vocab_size)
            UserLM.last = self

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.head(self.emb(batch[0])), batch[0])

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randint(0, self.hparams.vocab_size, (8,))), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
''')


@pytest.fixture(autouse=True)
def bare_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """main(argv) as the console script sees it: no pytest arguments in sys.argv for LightningCLI to warn about."""
    monkeypatch.setattr("sys.argv", ["lzero"])


@pytest.fixture
def user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config naming only the class of a model in a module of the user's (importable from tmp_path)."""
    (tmp_path / "lzero_test_user_module.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  class_path: lzero_test_user_module.UserLM\n")
    return config


def test_print_config_shows_the_user_model_defaults(user_config: Path, capsys: pytest.CaptureFixture) -> None:
    import yaml

    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(user_config), "--print_config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"] == {"class_path": "lzero_test_user_module.UserLM",
                                "init_args": {"vocab_size": 50, "n_embd": 8, "lr": 0.05}}
    assert printed["data"] is None  # no datamodule slipped in: the model's own dataloaders are used


def test_fit_a_user_model_with_its_defaults(user_config: Path, tmp_path: Path, in_process_fit) -> None:
    assert main(["fit", "--config", str(user_config), "--trainer.strategy", "zero2", "--trainer.accelerator", "cpu",
                 "--trainer.devices", "1", "--trainer.fast_dev_run", "true",
                 "--trainer.default_root_dir", str(tmp_path)]) == 0
    import lzero_test_user_module

    model = lzero_test_user_module.UserLM.last
    own = {k: v for k, v in model.hparams.items() if not k.startswith("_")}  # LightningCLI adds _class_path...
    assert own == {"vocab_size": 50, "n_embd": 8, "lr": 0.05}
    assert type(model.trainer.strategy).__name__ == "ZeroStrategy" and model.trainer.global_step == 1


def test_help_lists_the_checkpoint_commands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: lzero ")
    for command in ("fit", "validate", "consolidate", "inspect", "estimate"):
        assert f"\n    {command} " in out or f"\n  {command} " in out, command


ROOT = Path(__file__).resolve().parents[2]


def test_a_demo_config_per_registered_name_differing_only_in_the_strategy() -> None:
    import yaml

    from lzero.presets import PRESET_CONFIGS

    ddp = yaml.safe_load((ROOT / "configs/demo_ddp.yaml").read_text())
    for name in PRESET_CONFIGS:
        assert (ROOT / "strategies" / f"{name}.yaml").is_file(), name
        config = yaml.safe_load((ROOT / "configs" / f"demo_{name}.yaml").read_text())
        assert config["trainer"].pop("strategy") == name
        assert config == {**ddp, "trainer": {k: v for k, v in ddp["trainer"].items() if k != "strategy"}}, name


class RecordTrainer(Callback):
    """A callback (given by class path) that keeps the Trainer it ran in."""

    last = None

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        RecordTrainer.last = trainer


def test_one_argument_switches_the_demo_from_ddp_to_zero3(tmp_path: Path, in_process_fit) -> None:
    """`lzero fit --config configs/demo_ddp.yaml --trainer.strategy zero3` (shrunk to one process, two steps)."""
    from lzero import ZeroStrategy

    assert main(["fit", "--config", str(ROOT / "configs/demo_ddp.yaml"), "--trainer.strategy", "zero3",
                 "--trainer.devices", "1", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                 "--trainer.logger", "false", "--trainer.callbacks", "test_cli.RecordTrainer",
                 "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
                 "--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "2", "--model.block_size", "8",
                 "--data.block_size", "8", "--data.batch_size", "2"]) == 0
    trainer = RecordTrainer.last
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.stage == 3
    assert trainer.global_step == 2


def test_print_config_comments_show_every_strategy_field_with_its_docstring(capsys: pytest.CaptureFixture) -> None:
    """`--print_config=comments` with `trainer.strategy: strategies/zero3.yaml` lists every ZeroConfig field under
    `config`, each under a comment that starts with the first words of its docstring, with the preset's values."""
    import ast
    import inspect
    from dataclasses import fields

    from lzero import ZeroConfig

    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(ROOT / "configs/demo_ddp.yaml"), "--trainer.strategy",
              str(ROOT / "strategies/zero3.yaml"), "--print_config=comments"])
    assert done.value.code == 0
    printed = capsys.readouterr().out.splitlines()
    docs = {}
    for section in ZeroConfig.__mro__[:-1]:  # ZeroConfig and the sections it takes its fields from, each in its module
        tree = ast.parse(Path(inspect.getsourcefile(section)).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == section.__name__)
        for field_node, doc in zip(cls.body, cls.body[1:]):
            if isinstance(field_node, ast.AnnAssign) and isinstance(doc, ast.Expr) and \
                    isinstance(doc.value, ast.Constant):
                docs[field_node.target.id] = " ".join(doc.value.value.split())
    start = printed.index("      config:")
    for f in fields(ZeroConfig):
        line = next(i for i in range(start, len(printed)) if printed[i].strip().startswith(f"{f.name}:"))
        comment = []
        i = line - 1
        while printed[i].strip().startswith("#"):
            comment.insert(0, printed[i].strip().lstrip("#").strip())
            i -= 1
        assert " ".join(comment).startswith(docs[f.name][:40]), f.name
    assert printed[start + 3].strip() == "stage: 3"


def test_a_matrix_optimizer_from_the_command_line(tmp_path: Path, in_process_fit) -> None:
    """`lzero fit --config configs/demo_zero3.yaml --optimizer torch.optim.Adafactor` (one process, two steps): the
    LightningCLI optimizer runs whole tensor by whole tensor (its factored state per matrix), with no flag."""
    from lzero import ZeroOptimizer

    assert main(["fit", "--config", str(ROOT / "configs/demo_zero3.yaml"), "--optimizer", "torch.optim.Adafactor",
                 "--optimizer.lr", "0.01", "--trainer.devices", "1", "--trainer.max_steps", "2",
                 "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
                 "--trainer.callbacks", "test_cli.RecordTrainer", "--trainer.enable_progress_bar", "false",
                 "--trainer.default_root_dir", str(tmp_path), "--model.n_layer", "1", "--model.n_embd", "16",
                 "--model.n_head", "2", "--model.block_size", "8", "--data.block_size", "8",
                 "--data.batch_size", "2"]) == 0
    (optimizer,) = RecordTrainer.last.optimizers
    assert isinstance(optimizer, ZeroOptimizer) and type(optimizer.optimizer).__name__ == "Adafactor"
    state = optimizer.state_dict()["state"]  # torch's format, every matrix's factored statistics
    matrices = [p for group in optimizer.param_groups for p in group["params"] if p.dim() == 2]
    assert matrices and {"row_var", "col_var", "step"} <= set().union(*(s.keys() for s in state.values()))
    assert all(optimizer.engine.units[i].spec.per_tensor for i in range(len(optimizer.engine.units))
               if not optimizer.engine.units[i].spec.frozen)
