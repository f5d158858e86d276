"""Reading a checkpoint by pieces (:class:`PiecedCheckpoint`, see [Note: a checkpoint read by pieces]), whatever
format holds them: lzero's own sharded directory (reader.py) and a DeepSpeed folder (deepspeed_checkpoint.py) build
their pieces from their files; the reading, and the matching of saved names to a module's (:func:`prefix_renaming`),
is here. Storage only: no Lightning, no torch.distributed, nothing of the engine.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from lzero.checkpoint.files import CheckpointError
from lzero.engine.tensor_layout import TensorLayout


class RangeSource(Protocol):
    """Where one piece's elements are stored: reads them by offset from the piece's first element."""

    def read_flat_range(self, start: int, end: int) -> Tensor: ...


class Piece(NamedTuple):
    """Elements ``[start, end)`` of a flattened tensor, held by ``source`` (its element 0 is element ``start``)."""

    start: int
    end: int
    source: RangeSource


class _Shifted:
    """A piece's source read from ``offset`` elements into another source."""

    def __init__(self, source: RangeSource, offset: int) -> None:
        self.source, self.offset = source, offset

    def read_flat_range(self, start: int, end: int) -> Tensor:
        return self.source.read_flat_range(start + self.offset, end + self.offset)


def whole_pieces(piece: Piece, layout: TensorLayout, rank: int) -> list[Piece]:
    """A piece of tensor rank ``rank``'s flattened local tensor as the pieces of the whole flattened tensor it covers
    (one per contiguous run). See [Note: tensor-parallel checkpoints] in lzero/engine/tensor_layout.py."""
    return [Piece(whole, whole + hi - lo,
                  _Shifted(piece.source, lo - piece.start) if lo != piece.start else piece.source)
            for lo, hi, whole in layout.runs(rank, piece.start, piece.end)]


def param_of(key: str) -> str:
    """The parameter a piece key belongs to: ``param/<name>``, ``average/<name>``, ``optim/<k>/<name>/<state>``."""
    parts = key.split("/")  # names use dots, never slashes
    return parts[1] if parts[0] in ("param", "average") else parts[2]


class PiecedCheckpoint:
    """[Note: a checkpoint read by pieces]
    What loading into shards reads of any checkpoint, whoever wrote it: every parameter (``param/<name>``, the fp32
    master) and every per-element optimizer state (``optim/<k>/<name>/<state>``) held as pieces, each a flat range of
    the flattened parameter and the source that reads it, so that a rank reads only the elements it owns whatever
    partition wrote them; 0-dim optimizer state (``step``) whole per parameter; ``manifest`` describes the model
    (``params``: name -> shape and numel, ``state_dict_keys`` in order, ``aliases``: tied key -> parameter name,
    ``world_size``, ``stage``, ``global_step``, ``epoch``, ``weights_only``); ``lightning_state()`` is everything else,
    with ``lzero/module_state`` (the tensors outside every unit: buffers, frozen parameters) and ``lzero/param_groups``
    (each optimizer's groups, hyperparameters and parameter names). ``ShardedCheckpoint`` (reader.py, lzero's own) and
    ``DeepSpeedCheckpoint`` (deepspeed_checkpoint.py) build the pieces from their files; the reading is here."""

    path: Path
    manifest: dict[str, Any]

    def _index(self, pieces: dict[str, list[Piece]], scalars: dict[str, Callable[[], Tensor]]) -> None:
        """Take the pieces and the 0-dim entries (read when asked for), and check that they cover every parameter."""
        self._pieces = {key: sorted(found, key=lambda p: p.start) for key, found in pieces.items()}
        self._reach: dict[str, list[int]] = {}  # key -> the furthest end among its first i+1 pieces, when first read
        self._scalars = scalars
        self._optimizer_keys: dict[tuple[str, str], set[str]] = defaultdict(set)  # (k, name) -> state keys
        for key in list(self._pieces) + list(self._scalars):
            parts = key.split("/")  # optim/<k>/<name>/<state>; names use dots, never slashes
            if parts[0] == "optim":
                self._optimizer_keys[(parts[1], parts[2])].add(parts[3])
        self._check_coverage()

    def _check_coverage(self) -> None:  # noqa: C901 - one pass over the pieces
        """Every parameter, and every per-element optimizer state, is covered from 0 to its numel."""
        params = self.manifest["params"]
        for name in params:
            if f"param/{name}" not in self._pieces:
                raise CheckpointError(f"`{self.path}`: no file holds `param/{name}`. HINT: a shard file is missing"
                                      " or from another save.")
        for key, pieces in self._pieces.items():
            name = param_of(key)
            covered = 0
            for a, b, _ in pieces:  # sorted by start
                if a > covered:
                    break
                covered = max(covered, b)
            if name not in params or covered < params[name]["numel"]:
                raise CheckpointError(f"`{self.path}`: the shards hold elements [0, {covered}) of `{key}`, which has"
                                      f" {params.get(name, {}).get('numel', '?')}. HINT: a shard file is missing or from"
                                      " another save.")

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def from_deepspeed(self) -> bool:
        """Whether this holds a DeepSpeed run: its folder, or an lzero checkpoint ``lzero import-deepspeed`` wrote
        from one. Its names are matched to the module's by one prefix (:func:`prefix_renaming`), and Fabric's
        ``load`` puts its one module and optimizer into the state's."""
        imported = self.manifest.get("imported_from") or {}
        return self.manifest.get("format") == "deepspeed" or imported.get("format") == "deepspeed"

    def dtype(self, key: str) -> torch.dtype:
        """The dtype ``key``'s pieces hold, without reading an element."""
        return self._pieces[key][0].source.read_flat_range(0, 0).dtype

    def read_range(self, key: str, start: int, end: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Elements [start, end) of the flattened ``key``, assembled from the pieces that hold them."""
        pieces = self._pieces.get(key)
        if not pieces:
            raise CheckpointError(f"`{self.path}` holds no `{key}`. HINT: the checkpoint belongs to another model"
                                  " or optimizer setup.")
        out: Optional[Tensor] = None
        reach = self._reach.get(key)
        if reach is None:  # pieces sorted by start: skip those that end before ``start`` (a tensor-parallel
            reach = self._reach[key] = list(itertools.accumulate((p.end for p in pieces), max))  # read: many runs)
        for a, b, source in pieces[bisect.bisect_right(reach, start):]:
            if a >= end:
                break
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            chunk = source.read_flat_range(lo - a, hi - a)
            if out is None:
                out = torch.empty(end - start, dtype=dtype or chunk.dtype)
            out[lo - start : hi - start].copy_(chunk)
        if out is None:
            out = torch.empty(0, dtype=dtype or torch.float32)
        return out

    def is_scalar(self, key: str) -> bool:
        return key in self._scalars

    def scalar(self, key: str) -> Tensor:
        return self._scalars[key]()

    def optimizer_keys(self, index: int, name: str) -> list[str]:
        return sorted(self._optimizer_keys.get((str(index), name), ()))

    def lightning_state(self) -> dict[str, Any]:
        """Everything besides the model and optimizer tensors, as Lightning's checkpoint dict has it (read once)."""
        raise NotImplementedError

    def rng_state(self, rank: int) -> Optional[dict[str, Any]]:
        """``rank``'s RNG states (``torch``, ``numpy``, ``python``, maybe ``cuda``), None when not saved."""
        return None

    def module_state_numel(self) -> int:
        """Elements of the module's tensors outside every unit (frozen parameters, buffers), a tensor shared by
        several keys counted once."""
        tensors = self.lightning_state()["lzero/module_state"]
        return sum(t.numel() for t in {id(t): t for t in tensors.values()}.values()) + self._derived_numel()

    def _derived_numel(self) -> int:
        return sum(math.prod(self.derived_layout(k)[1]) for k in self.derived_keys())

    def holds(self, key: str) -> bool:
        """Whether pieces of ``key`` were saved."""
        return key in self._pieces

    @property
    def has_average(self) -> bool:
        """Whether a weight-averaging run saved its averages (``average/<name>``): [Note: averages in a sharded
        checkpoint] in averages.py."""
        return any(key.startswith("average/") for key in self._pieces)

    def model_key(self, name: str) -> str:
        """The pieces holding parameter ``name`` as the checkpoint's model state: its average when Lightning's
        ``WeightAveraging`` saved it (the average is then the state dict, as in DDP's file), else ``param/<name>``.
        See [Note: averages in a sharded checkpoint] in averages.py."""
        average = f"average/{name}"
        if self.has_average and self.holds(average) and "averaging_state" in self.lightning_state():
            return average
        return f"param/{name}"

    def full_param(self, name: str) -> Tensor:
        info = self.manifest["params"][name]
        return self.read_range(self.model_key(name), 0, info["numel"]).view(info["shape"])

    def saved_name(self, name: str) -> str:
        """The name a parameter's pieces are saved under: its own, or for a tied key the parameter it shares (the last
        pipeline stage's copy of a tied embedding: [Note: pipeline checkpoints] in sharded.py)."""
        return self.manifest.get("aliases", {}).get(name, name)

    def param_name(self, key: str) -> Optional[str]:
        """The sharded parameter a state-dict key holds (tied keys name the same one), or None for a
        tensor outside every unit (a buffer, a frozen parameter)."""
        name = self.manifest.get("aliases", {}).get(key, key)
        return name if name in self.manifest["params"] else None

    def state_tensor(self, key: str) -> Tensor:
        """The whole tensor of one state-dict key."""
        name = self.param_name(key)
        if name is not None:
            return self.full_param(name)
        rest = self.lightning_state()["lzero/module_state"]
        return rest[key] if key in rest else self.derived_tensor(key)

    def derived_keys(self) -> dict[str, Any]:
        """State-dict keys outside every unit that the checkpoint computes rather than holds (the quantization state
        of a QLoRA base it reads from pretrained files: base_files.py), each to what the reader knows of it."""
        return {}

    def derived_tensor(self, key: str) -> Tensor:
        raise KeyError(key)

    def derived_digest(self, key: str) -> Optional[str]:
        """The SHA-256 of a derived tensor's bytes, as recorded (no computation)."""
        return None

    def derived_layout(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        raise KeyError(key)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The module's whole state dict in its saved key order; tied keys share one tensor."""
        by_name: dict[str, Tensor] = {}
        out = {}
        for key in self.manifest["state_dict_keys"]:
            name = self.param_name(key)
            if name is None:
                out[key] = self.state_tensor(key)
                continue
            if name not in by_name:
                by_name[name] = self.full_param(name)
            out[key] = by_name[name]
        return out


def prefix_renaming(saved: list[str], names: set[str]) -> Optional[Callable[[str], str]]:
    """How the saved parameter names become the module's, when they are not all among ``names``: the one prefix
    that, added to every saved name (DeepSpeed trained ``GPT()``, Lightning holds it as ``self.model``) or removed
    from every one (the reverse), makes each of them one of ``names``. None when no prefix, or several, do."""
    if not saved or all(n in names for n in saved):
        return None
    first = saved[0]
    added = {t[: len(t) - len(first)] for t in names if t.endswith("." + first)}
    removed = {first[: i + 1] for i, c in enumerate(first) if c == "."}
    fits = [(lambda n, p=p: p + n) for p in sorted(added) if all(p + n in names for n in saved)]
    fits += [(lambda n, p=p: n[len(p):] if n.startswith(p) else n) for p in sorted(removed)
             if all(n.startswith(p) and n[len(p):] in names for n in saved)]
    return fits[0] if len(fits) == 1 else None
