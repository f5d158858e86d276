"""The ZeRO engine, in plain torch (no Lightning): how a model's parameters are cut into units and shards
(``partition``, ``units``, ``flat_unit``), gathered and released at stage 3 (``gather``, its ``blocks`` and
``unit_order`` check, ``parameters``),
reduced (``reducer``, ``collectives``), built from the meta device (``materialize``), cast (``mixed_precision``,
``loss_scale``), recomputed (``activation_checkpointing``), and driven step by step (``engine.ZeroEngine``).

Its modules import only each other, ``lzero.offload`` (where shards live) and the configuration. This file imports
nothing, so that code needing one part (the checkpoint reader needs ``partition``) does not pay for the rest.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("ZeroEngine", "ZeroEngineError"):
        from lzero.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'lzero.engine' has no attribute {name!r}")
