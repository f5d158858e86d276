"""The model a stage-3 run leaves sharded on its module, and the ways back to whole tensors. See
[Note: the model stays sharded after fit] below."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from lzero.checkpoint.state_dict import restore_masters
from lzero.engine.engine import ZeroEngine

_KEPT = "_lzero_engine"


def kept_engine(module: Optional[torch.nn.Module]) -> Optional[ZeroEngine]:
    """[Note: the model stays sharded after fit]
    At stage 3 the end of a clean ``fit`` (or ``validate``/``test``/``predict``) leaves the model as it trained:
    each rank holds its shards (in the stores the preset names), the gather hooks stay on the blocks, and every
    parameter outside a gather is a guarded placeholder, so no rank ever holds the whole model. The engine is kept
    on the module (``module.__dict__``, so it lives and dies with it). A later ``validate``/``test``/``predict`` on
    the same world size, in this Trainer or a new one, runs on that engine; ``gathered_parameters()``,
    ``generation()`` and ``trainer.save_checkpoint`` use it too. Reading a parameter directly
    (``model.state_dict()``, ``torch.save``, ``save_pretrained``) raises an error naming those ways out. A later
    ``fit`` or a stage 1-2 run first gathers the model back into whole tensors (``gather_back``, the whole model
    on every rank), as does ``lzero.unshard(model)`` and, at the end of every run, ``gather_after_fit=True``."""
    return module.__dict__.get(_KEPT) if module is not None else None


def keep(module: torch.nn.Module, engine: ZeroEngine) -> None:
    engine.wait()
    engine.release_all()
    module.__dict__[_KEPT] = engine
    # the stores' files (NVMe offload) go with the module, or at exit
    engine.__dict__["_kept_finalizer"] = weakref.finalize(module, _close_stores, list(engine.stores))


def take_kept(module: Optional[torch.nn.Module]) -> Optional[ZeroEngine]:
    engine = module.__dict__.pop(_KEPT, None) if module is not None else None
    if engine is not None:
        engine.__dict__.pop("_kept_finalizer").detach()
    return engine


def _close_stores(stores: list[Any]) -> None:
    for store in stores:
        store.close()


def gather_back(engine: ZeroEngine) -> None:
    """Every parameter a standalone whole tensor again (the fp32 masters under mixed precision, as DDP leaves the
    model), and the engine detached from the module. A collective."""
    if engine.mixed:
        restore_masters(engine)
    else:
        engine.unshard()
    engine.remove()


def unshard(module: torch.nn.Module) -> torch.nn.Module:
    """Gather a model that a stage-3 run left sharded (see [Note: the model stays sharded after fit]) back into
    whole tensors on every rank, for good: afterwards it is a plain module, as DDP leaves it, and costs the whole
    model on every rank. A collective: call it on every rank. A model that is not sharded is returned as it is."""
    engine = take_kept(module)
    if engine is not None:
        gather_back(engine)
    return module
