"""``lzero convert-config ds_config.json``: a DeepSpeed JSON configuration as the LightningCLI ``trainer:`` section
(``lzero.ZeroStrategy`` and the Trainer settings it implies), one ``#`` comment per filled, renamed or noticed key,
or the refusals. See [Note: reading a DeepSpeed configuration] in config.py."""

from __future__ import annotations

import sys
from dataclasses import fields
from typing import Any, Optional

from lzero.auto_sizes import sizes_for
from lzero.config import AUTO, BY_HIDDEN_SIZE, ZeroConfig, ZeroConfigError
from lzero.deepspeed.config import DeepSpeedConfigError, Translated, translate


def to_yaml(translated: Translated, hidden_size: Optional[int] = None) -> str:
    """The LightningCLI ``trainer:`` section, with one ``#`` comment per filled, renamed or noticed key. With
    ``hidden_size``, the ``"auto"`` sizes that follow it are written as numbers."""
    import yaml

    kwargs = translated.strategy_kwargs()
    if hidden_size is not None:
        kwargs.update(sizes_for(tuple(k for k in BY_HIDDEN_SIZE if kwargs.get(k) == AUTO), hidden_size))
    known = {f.name for f in fields(ZeroConfig)}
    # ZeroConfig's fields under `config` (LightningCLI builds the dataclass from it); the strategy's own next to it
    init_args = {"config": {k: v for k, v in kwargs.items() if k in known},
                 **{k: v for k, v in kwargs.items() if k not in known}}
    trainer: dict[str, Any] = {"strategy": {"class_path": "lzero.ZeroStrategy", "init_args": init_args}}
    trainer.update(translated.trainer_kwargs())
    comments = [f"# {note.kind}: {note.key}: {note.text}" for note in translated.notes]
    return "\n".join([*comments, yaml.safe_dump({"trainer": trainer}, sort_keys=False).rstrip()]) + "\n"


def convert_command(argv: list[str]) -> int:
    """Print the YAML, or the refusals (exit 1)."""
    import argparse

    parser = argparse.ArgumentParser(prog="lzero convert-config", description="Print the LightningCLI `trainer:`"
                                     " section (lzero.ZeroStrategy and Trainer settings) for a DeepSpeed JSON config.")
    parser.add_argument("config", help="the DeepSpeed JSON file")
    parser.add_argument("--world-size", type=int, help="check the batch keys against this many ranks")
    parser.add_argument("--micro-batch", type=int, help="the DataLoader's batch size (fills \"auto\")")
    parser.add_argument("--accumulate", type=int, help="accumulate_grad_batches (fills \"auto\")")
    parser.add_argument("--precision", help="the Trainer's precision (fills \"auto\", checked against fp16/bf16)")
    parser.add_argument("--hidden-size", type=int, help="the model's hidden size: writes numbers for the \"auto\""
                        " bucket sizes and persistence threshold, as the Hugging Face integration fills them (without"
                        " it they stay \"auto\", filled at setup from the model)")
    args = parser.parse_args(argv)
    try:
        translated = translate(args.config, world_size=args.world_size, micro_batch=args.micro_batch,
                               accumulate=args.accumulate, trainer_precision=args.precision)
    except DeepSpeedConfigError as err:
        print("\n".join(f"# refused: {line}" for line in err.errors))
        print(f"lzero convert-config: {len(err.errors)} key(s) of {args.config} refused (see above).", file=sys.stderr)
        return 1
    except ZeroConfigError as err:
        print(f"# refused: {err}")
        return 1
    print(to_yaml(translated, args.hidden_size), end="")
    return 0
