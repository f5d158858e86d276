"""A meta model's recorded construction, replayed, as the engine reads a checkpoint (``WeightSource`` in
materialize.py): :func:`from_replay` runs the record ([Note: replayed construction] in replay.py), each rank keeping
its shard of every unit (:class:`ReplayedWeights`), under a state being loaded when there is one
(:class:`LoadedOverReplay`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lzero.engine.partition import UnitSpec
from lzero.engine.recording import recorder_for
from lzero.engine.replay import Ref, Replay, leave_rng_as_eager, start_state, storage_key


class ReplayedWeights:
    """A replayed construction as the engine reads a checkpoint (``WeightSource`` in materialize.py): each unit's
    shard built by the replay (``unit_values``), and the whole of every other tensor."""

    def __init__(self, replay: Replay, names: set[str], shards: dict[int, Tensor]) -> None:
        self._replay = replay
        self._names = names
        self._shards = shards  # unit index -> this rank's shard (1D)

    def holds(self, name: str) -> bool:
        return name in self._names

    def unit_values(self, spec: UnitSpec, rank: int) -> Optional[Tensor]:
        return self._shards.pop(spec.index, None)

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        def read(name: str, start: int, end: int, out: Tensor) -> None:
            out.copy_(self._replay.whole[name].reshape(-1)[start:end])

        yield read

    def finish(self, root: nn.Module, all_reduce_max: Callable[[Tensor], None], device: torch.device) -> None:
        self._replay.whole.clear()


def from_replay(root: nn.Module, units: Sequence[UnitSpec], rank: int, device: torch.device,
                broadcast: Callable[[Tensor], None], provided: Any = None) -> tuple[Optional[Any], str]:
    """``root``'s meta tensors replayed from their recording (rank 0's RNG state, shared with ``broadcast``), this
    rank keeping its shard of every unit and the whole of the other tensors; or None and why not. A collective (the
    broadcast) when a recording covers the model. ``provided``: a source (a state dict being loaded) whose tensors
    win over the replay's; the replay gives only the others (non-persistent buffers, say), and what neither wrote is
    left to the modules' ``reset_parameters()`` (materialize.py), as FSDP materializes a meta model."""
    every = [(n, t) for n, t in [*root.named_parameters(), *root.named_buffers()] if t.is_meta]
    named = every
    if provided is not None:  # the tensors the load gives are not the record's to cover
        named = [(n, t) for n, t in named if not provided.holds(n)]
    recorder, why = recorder_for([t for _, t in named], [n for n, _ in named], among=[t for _, t in every])
    if recorder is None:
        return None, why
    if provided is not None:  # what neither the load nor the record wrote: the modules' reset_parameters(), as FSDP
        unwritten = set(recorder.unwritten(named))
        named = [(n, t) for n, t in named if n not in unwritten]
    else:
        recorder.refuse_unwritten(named)
    # every shard allocated before the replay: its short-lived whole tensors then reuse the same freed memory
    shards, pieces = {}, {}
    for spec in units:
        dtype = root.get_parameter(spec.params[0].name).dtype
        shard = shards[spec.index] = torch.empty(spec.shard_numel, dtype=dtype, device=device)
        for a, b in spec.padding(rank):
            shard[a:b].zero_()
        for param, start, end, at in spec.owned_pieces(rank):
            pieces.setdefault(param.name, []).append((start, end, shard[at : at + end - start]))
    in_units = {p.name for spec in units for p in spec.params}
    wanted: dict[int, list[tuple[str, Ref, Optional[list[tuple[int, int, Tensor]]]]]] = {}
    for name, t in named:
        ranges = pieces.get(name, []) if name in in_units else None
        if ranges == []:
            continue  # this rank owns nothing of it
        wanted.setdefault(storage_key(t), []).append((name, Ref.of(t), ranges))
    state = start_state(recorder.start_states, device).clone()
    broadcast(state)
    loads = provided.storage_loads() if hasattr(provided, "storage_loads") else None
    replay = Replay(recorder, wanted, device, loads)
    leave_rng_as_eager(recorder.final_states, device, replay.run(state))
    replayed = ReplayedWeights(replay, {name for name, _ in named}, shards)
    return (replayed if provided is None else LoadedOverReplay(provided, replayed, units)), ""


class LoadedOverReplay:
    """A state being loaded into a meta model, over its replayed construction for what that state does not hold
    (``WeightSource`` in materialize.py): each unit's shard from the replay with the loaded pieces written over it."""

    def __init__(self, loaded: Any, replayed: ReplayedWeights, units: Sequence[UnitSpec]) -> None:
        self._loaded, self._replayed = loaded, replayed
        self._units = {spec.index: spec for spec in units}

    def holds(self, name: str) -> bool:
        return self._loaded.holds(name) or self._replayed.holds(name)

    def unit_values(self, spec: UnitSpec, rank: int) -> Optional[Tensor]:
        shard = self._replayed.unit_values(spec, rank)
        with self._loaded.reading() as read, torch.no_grad():
            for param, start, end, at in spec.owned_pieces(rank):
                if self._loaded.holds(param.name):
                    read(param.name, start, end, shard[at: at + end - start])
        return shard

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        with self._loaded.reading() as loaded, self._replayed.reading() as replayed:
            yield lambda name, a, b, out: (loaded if self._loaded.holds(name) else replayed)(name, a, b, out)

    def finish(self, root: nn.Module, all_reduce_max: Callable[[Tensor], None], device: torch.device) -> None:
        self._loaded.finish(root, all_reduce_max, device)
        self._replayed.finish(root, all_reduce_max, device)
