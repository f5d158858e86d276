"""Resuming: opening a checkpoint (a sharded directory, a DeepSpeed checkpoint folder, or a full DDP-format file
under a policy that never unpickles unless asked to), checking that it fits the model, and loading it into a rank's
shards. What ``ZeroStrategy.load_checkpoint`` / ``load_model_state_dict`` /
``load_optimizer_state_dict`` run; no Lightning here (the strategy hands in Lightning's file reader).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping, Optional, Sequence

from torch import Tensor, nn

from lzero.checkpoint.rank_state import ShardedOptimizer
from lzero.checkpoint.deepspeed_checkpoint import PRECISION_STATE
from lzero.checkpoint.formats import is_checkpoint_directory, open_reader
from lzero.checkpoint.pieces import PiecedCheckpoint
from lzero.checkpoint.sharded import load_optimizer_shards, restore_rng
from lzero.checkpoint.state_dict import fetch_full, load_params

if TYPE_CHECKING:
    from lzero.engine.engine import ZeroEngine

READER = "lzero/reader"
"""The checkpoint dict's key for the :class:`PiecedCheckpoint` it was opened from (checkpoint directories only)."""

_NOT_A_CHECKPOINT = "HINT: pass a `.ckpt` file written by `trainer.save_checkpoint` or `ModelCheckpoint`."


def open_checkpoint(path: Any, rank: int, world_size: int, weights_only: Optional[bool],
                    load_file: Callable[[bool], Any], names: Optional[Collection[str]] = None) -> dict[str, Any]:
    """The checkpoint at ``path`` as Lightning's dict. A directory (lzero's sharded checkpoint, or a DeepSpeed
    folder whose names are matched to ``names``) is validated in full and read lazily (tensors are read when loaded
    into the shards); this rank's RNG states are restored when the world size is unchanged and the checkpoint holds
    them. A full file is read by ``load_file(weights_only)``, with ``weights_only`` unless the caller passed
    ``weights_only=False``: a foreign file is unpickled only when the user says so."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint `{path}` does not exist. HINT: check `ckpt_path`.")
    if is_checkpoint_directory(path):
        return _open_sharded(open_reader(path, names), rank, world_size)
    safe = weights_only is None or weights_only
    try:
        checkpoint = load_file(safe)
    except pickle.UnpicklingError as err:
        if "Unsupported global" not in str(err):  # not a torch file, rather than one needing pickle
            raise ValueError(f"`{path}` is not a readable Lightning checkpoint (UnpicklingError). {_NOT_A_CHECKPOINT}"
                             ) from err
        raise ValueError(
            f"`{path}` needs pickle to load ({err}). HINT: if you trust this file, pass"
            " `trainer.fit(..., weights_only=False)`; lzero never unpickles files of its own checkpoints."
        ) from err
    except Exception as err:
        raise ValueError(
            f"`{path}` is not a readable Lightning checkpoint ({type(err).__name__}: {err}). {_NOT_A_CHECKPOINT}"
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"`{path}` holds no 'state_dict', so it is not a Lightning checkpoint. {_NOT_A_CHECKPOINT}")
    return checkpoint


def _open_sharded(reader: PiecedCheckpoint, rank: int, world_size: int) -> dict[str, Any]:
    checkpoint = {k: v for k, v in reader.lightning_state().items()
                  if not k.startswith("lzero/") or k == PRECISION_STATE}
    checkpoint[READER] = reader
    checkpoint["state_dict"] = LazyStateDict(reader)
    if not reader.manifest.get("weights_only"):
        checkpoint["optimizer_states"] = [{"lzero": "read from the shards"}] * len(
            reader.lightning_state()["lzero/param_groups"])
    restore_rng(reader, rank, world_size)
    return checkpoint


class LazyStateDict(Mapping):
    """The module's state dict of a sharded checkpoint, for ``on_load_checkpoint`` hooks that look at
    it: keys at once, each tensor read (whole) only when asked for."""

    def __init__(self, reader: PiecedCheckpoint) -> None:
        self._reader = reader
        self._keys = list(reader.manifest["state_dict_keys"])

    def __getitem__(self, key: str) -> Tensor:
        return self._reader.state_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def load_module_state(engine: Optional["ZeroEngine"], module: nn.Module, checkpoint: Mapping[str, Any],
                      strict: bool) -> None:
    """The checkpoint's module state into ``module``: while fitting (an ``engine``) into the shards, each
    rank reading only the pieces it owns, from a sharded checkpoint or a full (DDP/Lightning) one;
    otherwise into the module as it is."""
    reader: Optional[PiecedCheckpoint] = checkpoint.get(READER)
    if engine is None:
        module.load_state_dict(reader.full_state_dict() if reader is not None else checkpoint["state_dict"],
                               strict=strict)
        return
    specs = {spec.name: spec for unit in engine.units for spec in unit.spec.params}
    if reader is not None:
        # A frozen parameter is sharded at stage 3 and a whole tensor of the module state elsewhere: read it
        # from wherever the saving run kept it.
        rest = reader.lightning_state()["lzero/module_state"]
        sharded = reader.manifest["params"]
        saved_shapes = {**{k: tuple(v.shape) for k, v in rest.items()}, **{n: tuple(p["shape"]) for n, p in sharded.items()}}
        whole = fetch_full(rest)
        # with its averaging callback a run resumes its current masters (the average goes to its own shards);
        # without, the model state: the average where WeightAveraging saved one, as DDP resumes
        key = (lambda name: f"param/{name}") if engine.average is not None else reader.model_key
        saved = reader.saved_name
        saved_shapes.update({n: saved_shapes[saved(n)] for n in specs if n not in saved_shapes and saved(n) in sharded})
        fetch = lambda name, a, b: (reader.read_range(key(saved(name)), a, b) if saved(name) in sharded  # noqa: E731
                                    else whole(name, a, b))
        managed_now = {id(p) for unit in engine.units for p in unit.params}
        rest = {**rest, **{k: reader.state_tensor(k) for k, v in module.state_dict(keep_vars=True).items()
                           if k not in rest and id(v) not in managed_now and reader.param_name(k)}}
    else:
        state = checkpoint["state_dict"]
        saved_shapes = {k: tuple(v.shape) for k, v in state.items()}
        fetch = fetch_full(state)
        rest = {k: v for k, v in state.items() if k not in specs}
    wrong = [f"`{n}` saved {saved_shapes.get(n)} now {s.whole_shape}" for n, s in specs.items()
             if n in saved_shapes and saved_shapes[n] != tuple(s.whole_shape)]
    missing = [n for n in specs if n not in saved_shapes]
    if wrong or (strict and missing):
        raise ValueError(f"The checkpoint does not fit this model: {'; '.join(wrong + [f'`{n}` missing' for n in missing])}."
                         " HINT: resume with the model the checkpoint was saved from.")
    if missing:  # strict=False: the parameters it lacks keep their values
        absent, present = set(missing), fetch
        fetch = lambda name, a, b: None if name in absent else present(name, a, b)  # noqa: E731
    load_params(engine, fetch)
    own = module.state_dict(keep_vars=True)
    managed = {id(p) for unit in engine.units for p in unit.params}
    rest = {k: v for k, v in rest.items() if k in own and id(own[k]) not in managed}
    derived = reader.derived_keys() if reader is not None else {}
    rest.update({k: reader.derived_tensor(k) for k in derived if k in own and not _same_bytes(own[k], reader, k)})
    result = module.load_state_dict(rest, strict=False)
    unexpected_missing = [k for k in result.missing_keys if id(own[k]) not in managed and k not in derived]
    if strict and unexpected_missing:
        raise ValueError(f"The checkpoint lacks {unexpected_missing}. HINT: resume with the model it was saved from.")


def _same_bytes(mine: Any, reader: PiecedCheckpoint, key: str) -> bool:
    """Whether the module's tensor ``key`` already holds what the checkpoint computes for it (a QLoRA base built again
    from the same files holds the same quantization state: not computed again)."""
    from lzero.engine.frozen_base import digest_tensor

    expected = reader.derived_digest(key)
    return isinstance(mine, Tensor) and expected is not None and digest_tensor(mine) == expected


def load_optimizer_states(optimizers: Sequence[ShardedOptimizer], checkpoint: Mapping[str, Any]) -> None:
    """Every optimizer's state into this rank's shards: read from the shards of a sharded checkpoint, or
    sliced from the full per-parameter states of a DDP-format one."""
    reader: Optional[PiecedCheckpoint] = checkpoint.get(READER)
    for k, optimizer in enumerate(optimizers):
        if reader is not None:
            load_optimizer_shards(optimizer, k, reader)
        else:
            optimizer.load_state_dict(checkpoint["optimizer_states"][k])
