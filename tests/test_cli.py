"""The ``lzero`` console script: LightningCLI for any model, plus the checkpoint commands."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

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
