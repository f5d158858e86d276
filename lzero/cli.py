"""The ``lzero`` console script: LightningCLI with the lzero strategies registered.

``lzero fit --config configs/demo_zero2.yaml`` trains the demo GPT with
``trainer.strategy: zero2``. Model and data default to :class:`DemoGPT` and
:class:`TextDataModule`; any other LightningModule/LightningDataModule can be chosen by
``class_path``. Subcommands that are not Lightning's (``EXTRA_COMMANDS``) are dispatched
before LightningCLI parses anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override



def _consolidate(argv: list[str]) -> int:
    from lzero.checkpoint.consolidate import consolidate_command

    return consolidate_command(argv)


def _inspect(argv: list[str]) -> int:
    from lzero.checkpoint.consolidate import inspect_command

    return inspect_command(argv)


# Extra subcommands, name -> handler(argv after the name) returning an exit code.
EXTRA_COMMANDS: dict[str, Callable[[list[str]], int]] = {"consolidate": _consolidate, "inspect": _inspect}

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


class DemoCLI(LightningCLI):
    """LightningCLI whose model and data default to the demo GPT on the bundled corpus."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {
                "model": {"class_path": "lzero.demo.DemoGPT"},
                "data": {"class_path": "lzero.demo.TextDataModule"},
            }
        )


def main(argv: list[str] | None = None) -> int:
    import lzero  # noqa: F401  registers the lzero strategy names with Lightning

    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else None
    if command in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[command](args[1:])
    if command is not None and not command.startswith("-") and command not in LIGHTNING_COMMANDS:
        known = ", ".join([*LIGHTNING_COMMANDS, *sorted(EXTRA_COMMANDS)])
        print(f"lzero: unknown command {command!r}. HINT: use one of: {known}.", file=sys.stderr)
        return 2
    DemoCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=argv,  # None: LightningCLI reads sys.argv itself
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
