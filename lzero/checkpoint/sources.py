"""Where a meta model's values come from when its first use is a load (Fabric's ``model.load_state_dict``,
``fabric.load_raw``, ``fabric.load``): the state being loaded, read by flat range as the engine reads a pretrained
checkpoint into shards (``WeightSource`` in lzero/engine/materialize.py); what the state does not hold comes from the
model's replayed construction (``over_replay``, see ``LoadedOverReplay`` in lzero/engine/replayed_weights.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from lzero.checkpoint.pieces import PiecedCheckpoint


class LoadedState(Mapping):
    """A state dict whose tensors may be Lightning's lazily loaded ones (``lazy_load``, litgpt's reader): each is read
    when asked for."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self._state = state_dict

    def __getitem__(self, key: str) -> Any:
        value = self._state[key]
        return value._load_tensor() if hasattr(value, "_load_tensor") else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class StateDictWeights:
    """A plain state dict being loaded, as the engine reads a checkpoint into a meta model's shards (``WeightSource``
    in materialize.py)."""

    over_replay = True  # what it does not hold comes from the model's replayed construction (replay.py)

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self._state = state_dict

    def holds(self, name: str) -> bool:
        return name in self._state

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        def read(name: str, start: int, end: int, out: Tensor) -> None:
            out.copy_(self._state[name].detach().reshape(-1)[start:end])

        yield read

    def finish(self, root: nn.Module, all_reduce_max: Callable[[Tensor], None], device: torch.device) -> None:
        pass


class ShardedCheckpointWeights(StateDictWeights):
    """A checkpoint directory being loaded (lzero's sharded one, a DeepSpeed folder), read by range."""

    def __init__(self, reader: PiecedCheckpoint) -> None:
        self._reader = reader
        self._names = set(reader.manifest["params"]) | set(reader.lightning_state()["lzero/module_state"])

    def holds(self, name: str) -> bool:
        return name in self._names

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        rest = self._reader.lightning_state()["lzero/module_state"]

        def read(name: str, start: int, end: int, out: Tensor) -> None:
            if name in rest:
                out.copy_(rest[name].reshape(-1)[start:end])
            else:
                out.copy_(self._reader.read_range(self._reader.model_key(name), start, end))

        yield read

    def base_tensor(self, name: str, dtype: Optional[torch.dtype] = None,
                    saved: Optional[torch.dtype] = None) -> Optional[Any]:
        """Where the checkpoint read ``name`` from, when it read it from pretrained files into the same dtypes as the
        engine now keeps: the loaded values are then the files' ([Note: a checkpoint without its frozen base] in
        base_files.py), and the next save may leave them out too."""
        base = getattr(self._reader, "base", {}).get(name)
        if base is None or (dtype is not None and (base.dtype, base.saved) != (dtype, saved or dtype)):
            return None
        return base

    def take_storage_loads(self, pretrained: Any) -> None:
        """The loaded storages of the pretrained models inside the module (``PretrainedWeights.storage_loads``), for a
        replay of their construction that reads them ([Note: replayed construction] in lzero/engine/replay.py)."""
        self.storage_loads = pretrained.storage_loads
