"""The ``lzero`` console script: LightningCLI with the lzero strategy names registered, plus the
checkpoint commands ``consolidate``, ``inspect``, ``export-hf`` and ``import-deepspeed``, the memory estimate
``estimate`` and ``convert-config`` (a DeepSpeed JSON configuration as LightningCLI YAML).

``lzero fit --config configs/demo_zero2.yaml`` trains the demo GPT with ``trainer.strategy: zero2``.
Models and datamodules are chosen by ``class_path`` exactly as with plain ``LightningCLI``: the
console script sets no defaults of its own, so a model of yours gets its own defaults (the demo's
model and data are named in ``configs/``). Subcommands that are not Lightning's (``EXTRA_COMMANDS``)
are dispatched before LightningCLI parses anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningCLI


def _consolidate(argv: list[str]) -> int:
    from lzero.checkpoint.consolidate import consolidate_command

    return consolidate_command(argv)


def _inspect(argv: list[str]) -> int:
    from lzero.checkpoint.consolidate import inspect_command

    return inspect_command(argv)


def _export_hf(argv: list[str]) -> int:
    from lzero.hf.export import export_command

    return export_command(argv)


def _import_deepspeed(argv: list[str]) -> int:
    from lzero.checkpoint.deepspeed_import import import_command

    return import_command(argv)


def _estimate(argv: list[str]) -> int:
    from lzero.hf.tensor_parallel_plan import plan_for
    from lzero.memory.estimate_command import estimate_command

    return estimate_command(argv, plan_for)


def _convert_config(argv: list[str]) -> int:
    from lzero.deepspeed.convert import convert_command

    return convert_command(argv)


# Extra subcommands, name -> (handler(argv after the name) returning an exit code, one line of help).
EXTRA_COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "consolidate": (_consolidate, "write a sharded checkpoint directory as one .ckpt/.pt/.pth/.safetensors file"),
    "export-hf": (_export_hf, "write a checkpoint as a Hugging Face folder (sharded safetensors, config, index)"),
    "inspect": (_inspect, "print a sharded checkpoint's step, stage, parameter counts and files"),
    "import-deepspeed": (_import_deepspeed, "write a DeepSpeed ZeRO checkpoint folder as an lzero sharded checkpoint"
                                            " (weights, optimizer state, step)"),
    "convert-config": (_convert_config, "print the LightningCLI strategy YAML for a DeepSpeed JSON config"),
    "estimate": (_estimate, "model-state memory per device, host and NVMe disk of each strategy (no model allocated)"),
}

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

DESCRIPTION = "Lightning's command line (LightningCLI) with the lzero strategies: trainer.strategy: zero1|zero2|zero3."


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the epilog (the extra commands) kept line by line."""


def _epilog() -> str:
    width = max(map(len, EXTRA_COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in EXTRA_COMMANDS.items()]
    return "other commands (lzero COMMAND --help for details):\n" + "\n".join(lines)


def _show_field_docstrings() -> None:
    """``--help`` and ``--print_config=comments`` show each ZeroConfig field's docstring (jsonargparse reads
    attribute docstrings only when asked)."""
    import jsonargparse

    if hasattr(jsonargparse, "set_parsing_settings"):
        jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    else:  # jsonargparse < 4.41
        jsonargparse.set_docstring_parse_options(attribute_docstrings=True)


def main(argv: list[str] | None = None) -> int:
    import lzero  # noqa: F401  registers the lzero strategy names with Lightning

    _show_field_docstrings()

    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else None
    if command in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[command][0](args[1:])
    if command is not None and not command.startswith("-") and command not in LIGHTNING_COMMANDS:
        known = ", ".join([*LIGHTNING_COMMANDS, *EXTRA_COMMANDS])
        print(f"lzero: unknown command {command!r}. HINT: use one of: {known}.", file=sys.stderr)
        return 2
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lzero", "description": DESCRIPTION, "epilog": _epilog(),
                       "formatter_class": _HelpFormatter},
        args=argv,  # None: LightningCLI reads sys.argv itself
    )
    _destroy_process_group()
    return 0


def _destroy_process_group() -> None:
    """After a successful run, the default process group is destroyed while the interpreter is still whole: a gloo
    group left to interpreter finalization can abort the finished process (SIGABRT, "terminate called without an
    active exception"; pytorch/pytorch#179291 describes the race)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
