"""A DeepSpeed ZeRO checkpoint folder read as lzero reads its own checkpoints (:class:`DeepSpeedCheckpoint`, a
:class:`~lzero.checkpoint.pieces.PiecedCheckpoint`), without DeepSpeed (its files: deepspeed_files.py): the fp32
masters, the optimizer's per-element state and step, its param groups, the LR scheduler, the loss scale and the step
count, so that a DeepSpeed run resumes under any lzero stage and world size, each rank reading only the bytes of its
own shard.

[Note: DeepSpeed checkpoint folders]
``engine.save_checkpoint(dir, tag)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``; Lightning's
``DeepSpeedStrategy`` writes the same into ``<name>.ckpt/`` with the tag ``checkpoint`` and its loop, callback and
scheduler state merged into the model states (the client state). In the tag folder:

- ``mp_rank_00_model_states.pt`` (stages 1-2; stage 3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank):
  ``module`` (the module's state dict; stage 3: empty placeholders for the parameters), ``param_shapes`` (per
  group, or per stage-3 sub-group, an ordered ``name -> shape``: the flat order), ``shared_params`` (tied name ->
  the name it shares), ``frozen_param_shapes`` / ``frozen_param_fragments`` (stage 3: each rank's part),
  ``lr_scheduler``, ``global_steps``, ``skipped_steps``, ``dp_world_size``, ``mp_world_size``, ``ds_config``.
- ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank, ``optimizer_state_dict``:
  stages 1-2: ``single_partition_of_fp32_groups`` (rank R's partition of each group, its end padding
  stripped), ``base_optimizer_state`` (the torch optimizer's state dict over those partitions, padding kept; under
  ``elastic_checkpoint`` per-group states without the param groups: refused), ``group_paddings``, ``param_alignment_paddings``,
  ``partition_count``, ``param_slice_mappings``; stage 3: ``fp32_flat_groups`` (per sub-group) and
  ``optimizer_state_dict``; both: ``loss_scaler``, ``zero_stage``.

Stages 1-2: each group's parameters, in ``param_shapes`` order (each followed by its alignment padding, when
``parameter_alignment`` was on), make one flat buffer, padded at its end and cut into contiguous partitions, one per
rank; a parameter may straddle ranks. Stage 3: every parameter is cut on its own into ``ceil(numel / N)`` per rank
(the last part padded); a rank's flat tensors are its parts in ``param_shapes`` order. Padding is never read (at
stage 3 it is uninitialized memory). ``param_slice_mappings``, when present, must agree with the layout computed.

What lzero cannot take over is refused by name before anything is loaded: tensor or pipeline parallel files
(``mp_rank_01``, ``layer_*-model_*``), MoE expert files (``expert_*``, ``expp_rank_*``) or groups, an optimizer
state that is not per element, a stage-0 folder (no ZeRO files), a rank's file missing.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Collection, NamedTuple, Optional

import torch
from torch import Tensor

from lzero.checkpoint.deepspeed_files import DeepSpeedFiles, deepspeed_tag_folder
from lzero.checkpoint.files import CheckpointError
from lzero.checkpoint.pieces import Piece, PiecedCheckpoint, prefix_renaming

_DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
}
"""The model states' keys that DeepSpeed writes; any other key is the client state (Lightning's, under its strategy)."""

PRECISION_STATE = "lzero/precision"
"""Key of :meth:`DeepSpeedCheckpoint.lightning_state` for the precision plugin's state (skipped steps, the fp16 loss
scaler), which the strategy files under its plugin's name."""


class _Slice(NamedTuple):
    """Elements of a rank's flat tensor from ``offset`` on, as a piece's source."""

    flat: Tensor  # 1D
    offset: int

    def read_flat_range(self, start: int, end: int) -> Tensor:
        return self.flat[self.offset + start : self.offset + end]


class _Span(NamedTuple):
    """One rank's part of one parameter: elements ``[start, end)`` of the flattened parameter, at ``offset`` in that
    rank's flat tensor ``flat`` (a group at stages 1-2, a sub-group at stage 3)."""

    start: int
    end: int
    rank: int
    flat: int
    offset: int


class DeepSpeedCheckpoint(PiecedCheckpoint):
    """A DeepSpeed ZeRO checkpoint folder (see [Note: DeepSpeed checkpoint folders]), validated in full on open,
    its tensors mapped and read by range when loaded. ``names``: the module's parameter names, when the saved ones
    may differ from them by a prefix (:func:`prefix_renaming`)."""

    def __init__(self, path: Any, names: Optional[Collection[str]] = None) -> None:
        self.path = Path(path)
        folder = deepspeed_tag_folder(self.path)
        if folder is None:
            raise CheckpointError(f"`{self.path}` is no DeepSpeed checkpoint folder (no `latest` file, no"
                                  " `*_model_states.pt`). HINT: name the folder given to `engine.save_checkpoint`.")
        self.files = DeepSpeedFiles(folder)
        files = self.files
        shapes = files.model_states["param_shapes"]
        if files.stage == 3:
            masters, states, groups_of = _zero3_flats(files.optim, files.optim_paths)
            spans = _zero3_spans(shapes, [m.numel() for m in masters[0]], files.world_size, files.optim_paths[0])
        else:
            masters, states, groups_of, sizes = _zero12_flats(files.optim, files.optim_paths)
            spans = _zero12_spans(shapes, files.optim[0].get("param_alignment_paddings"), sizes)
            _check_slice_mappings(spans, files.optim, files.optim_paths)
        frozen = list(files.model_states.get("frozen_param_shapes") or {}) if files.stage == 3 else []
        saved = [name for name, parts in spans.items() if parts] + frozen
        self._name = (prefix_renaming(saved, set(names)) if names is not None else None) or (lambda name: name)
        """A saved name -> the module's name."""
        self._build(shapes, spans, masters, states, groups_of)
        self._common: Optional[dict[str, Any]] = None

    def _build(self, shapes: list[dict], spans: dict[str, list[_Span]], masters: list[list[Tensor]],
               states: list[list[dict[str, Any]]], groups_of: list[int]) -> None:
        """The manifest and the pieces: masters and per-element state from the flats, ``step`` whole."""
        first, rename = self.files.model_states, self._name
        params = {rename(name): {"shape": list(shape), "numel": math.prod(shape)} for group in shapes
                  for name, shape in group.items()}
        pieces: dict[str, list[Piece]] = defaultdict(list)
        scalars: dict[str, Callable[[], Tensor]] = {}
        self._groups: list[list[str]] = [[] for _ in self._hyperparameters()]
        for saved_name, parts in spans.items():
            name = rename(saved_name)
            if not parts:  # no element: nothing to hold
                del params[name]
                continue
            flat = parts[0].flat
            self._groups[groups_of[flat]].append(name)
            for s in parts:
                pieces[f"param/{name}"].append(Piece(s.start, s.end, _Slice(masters[s.rank][s.flat], s.offset)))
                for key, value in states[s.rank][s.flat].items():
                    if isinstance(value, Tensor) and value.dim() > 0:
                        pieces[f"optim/0/{name}/{key}"].append(Piece(s.start, s.end, _Slice(value, s.offset)))
            for key, value in states[0][flat].items():
                if not (isinstance(value, Tensor) and value.dim() > 0):
                    scalars[f"optim/0/{name}/{key}"] = (lambda v=value: v.clone() if isinstance(v, Tensor)
                                                        else torch.tensor(v, dtype=torch.float32))
        if self.files.stage == 3:
            self._frozen_pieces(params, pieces)
        shared = first.get("shared_params") or {}
        client = {k: v for k, v in first.items() if k not in _DEEPSPEED_KEYS}
        self.manifest = {
            "format": "deepspeed", "tag": self.files.folder.name, "deepspeed_version": first.get("ds_version"),
            "world_size": self.files.world_size, "stage": self.files.stage, "weights_only": False,
            "global_step": int(client.get("global_step", first.get("global_steps") or 0)),
            "epoch": int(client.get("epoch", 0)), "params": params,
            "state_dict_keys": [rename(k) for k in first.get("module") or {}],
            "aliases": {rename(k): rename(v) for k, v in shared.items() if rename(v) in params},
        }
        self._index(pieces, scalars)

    def _frozen_pieces(self, params: dict[str, Any], pieces: dict[str, list[Piece]]) -> None:
        """Stage 3's frozen parameters: each rank's model states hold its ``ceil(numel / N)`` part."""
        world = self.files.world_size
        for saved_name, shape in (self.files.model_states.get("frozen_param_shapes") or {}).items():
            name, numel = self._name(saved_name), math.prod(shape)
            params[name] = {"shape": list(shape), "numel": numel, "frozen": True}
            part = -(-numel // world)
            for r, states in enumerate(self.files.rank_models):
                a, b = r * part, min(numel, (r + 1) * part)
                if a < b:
                    fragment = (states.get("frozen_param_fragments") or {}).get(saved_name)
                    if not isinstance(fragment, Tensor) or fragment.numel() < b - a:
                        raise CheckpointError(f"Rank {r}'s model states in `{self.files.folder}` lack its part of the"
                                              f" frozen parameter `{name}`. HINT: the folder is damaged; resume from"
                                              " another tag.")
                    pieces[f"param/{name}"].append(Piece(a, b, _Slice(fragment.reshape(-1), 0)))

    def _hyperparameters(self) -> list[dict[str, Any]]:
        base = self.files.optim[0]["base_optimizer_state" if self.files.stage < 3 else "optimizer_state_dict"]
        return [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]

    def lightning_state(self) -> dict[str, Any]:
        """Lightning's client state when the folder has it (Lightning's ``DeepSpeedStrategy``), else a state of the
        same shape for the step count (:func:`lightning_loops_after`); with the module's tensors outside the
        parameters, the param groups, and the precision state (:data:`PRECISION_STATE`)."""
        if self._common is not None:
            return self._common
        first = self.files.model_states
        state = {k: v for k, v in first.items() if k not in _DEEPSPEED_KEYS}
        if "loops" not in state:  # a DeepSpeed run's own folder
            steps = int(first.get("global_steps") or 0)
            accumulation = (first.get("ds_config") or {}).get("gradient_accumulation_steps", 1)
            state.update({"global_step": steps, "epoch": 0,
                          "lr_schedulers": [first["lr_scheduler"]] if first.get("lr_scheduler") is not None else []})
            if steps:
                state["loops"] = lightning_loops_after(steps, accumulation if isinstance(accumulation, int) else 1)
            state.setdefault("pytorch-lightning_version", _lightning_version())
        held = set(self.manifest["params"]) | set(self.manifest["aliases"])
        module = first.get("module") or {}
        state["lzero/module_state"] = {self._name(k): v for k, v in module.items() if self._name(k) not in held}
        hyper = self._hyperparameters()
        state["lzero/param_groups"] = [[{**h, "params": names} for h, names in zip(hyper, self._groups)]]
        state[PRECISION_STATE] = _precision_state(self.files.optim[0].get("loss_scaler"), first.get("skipped_steps"))
        self._common = state
        return state


def _elementwise(state: dict[str, Any], size: int, where: str) -> dict[str, Any]:
    """A flat partition's optimizer state: per-element tensors of ``size`` elements and 0-dim values only."""
    for key, value in state.items():
        per_element = isinstance(value, Tensor) and value.dim() > 0
        if (per_element and value.numel() != size) or not (per_element or isinstance(value, (Tensor, int, float))):
            shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise CheckpointError(
                f"{where}: optimizer state `{key}` is {shape}, not one value per element of its {size}-element"
                " partition: an optimizer whose state is not elementwise (factored, matrix-shaped) cannot be re-cut"
                " for another partition. HINT: lzero takes over elementwise optimizers (Adam, AdamW, SGD, Adagrad...).")
    return state


def _zero12_flats(optim: list[dict[str, Any]], files: list[Path]
                  ) -> tuple[list[list[Tensor]], list[list[dict]], list[int], list[list[int]]]:
    """Per rank and group: the master partition, its optimizer state, the group index, and the partition's size."""
    masters, states, sizes = [], [], []
    groups_of: list[int] = []
    for r, (state, path) in enumerate(zip(optim, files)):
        flats = [t.reshape(-1) for t in state["single_partition_of_fp32_groups"]]
        paddings = state.get("group_paddings") or [0] * len(flats)
        base = state.get("base_optimizer_state")
        if not isinstance(base, dict):  # elastic_checkpoint: per-group states, padding stripped, no param groups
            raise CheckpointError(f"`{path}` was saved with `elastic_checkpoint`, which keeps no param groups (learning"
                                  " rates, betas...). HINT: resume it once in DeepSpeed with elastic_checkpoint off and"
                                  " save again.")
        per_group = [base["state"].get(g["params"][0], {}) for g in base["param_groups"]]
        if len(per_group) != len(flats):
            raise CheckpointError(f"`{path}` holds {len(flats)} partitions and state for {len(per_group)} groups."
                                  " HINT: the file is damaged; resume from another tag.")
        masters.append(flats)
        sizes.append([f.numel() + p for f, p in zip(flats, paddings)])
        states.append([_elementwise(s, n, f"`{path}`, group {g}")
                       for g, (s, n) in enumerate(zip(per_group, sizes[-1]))])
        groups_of = list(range(len(flats)))
    return masters, states, groups_of, sizes


def _zero12_spans(shapes: list[dict], alignment: Optional[list[list[int]]], sizes: list[list[int]]
                  ) -> dict[str, list[_Span]]:
    """Stages 1-2: each group flattened in ``param_shapes`` order, cut into the ranks' contiguous partitions."""
    spans: dict[str, list[_Span]] = {}
    for g, group in enumerate(shapes):
        bounds = [0]
        for rank_sizes in sizes:
            bounds.append(bounds[-1] + rank_sizes[g])
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            spans[name] = [_Span(lo - offset, hi - offset, r, g, lo - bounds[r]) for r in range(len(sizes))
                           for lo, hi in [(max(offset, bounds[r]), min(offset + numel, bounds[r + 1]))] if lo < hi]
            offset += numel + (alignment[g][i] if alignment else 0)
        if offset > bounds[-1]:
            raise CheckpointError(f"Group {g}'s parameters take {offset} elements, its partitions hold {bounds[-1]}."
                                  " HINT: the model states and optimizer files are of different saves.")
    return spans


def _check_slice_mappings(spans: dict[str, list[_Span]], optim: list[dict[str, Any]], files: list[Path]) -> None:
    """DeepSpeed's own record of each parameter's part in a rank's partition agrees with the layout computed."""
    for r, (state, path) in enumerate(zip(optim, files)):
        for group in state.get("param_slice_mappings") or []:
            for name, address in group.items():
                mine = [(s.offset, s.end - s.start) for s in spans.get(name, []) if s.rank == r]
                if mine != [(int(address.start), int(address.numel))]:
                    raise CheckpointError(
                        f"`{path}` places `{name}` at {address}, the layout computed at {mine} (offset, numel). HINT:"
                        " this DeepSpeed version lays partitions out in a way lzero does not know; please report it.")


def _zero3_flats(optim: list[dict[str, Any]], files: list[Path]
                 ) -> tuple[list[list[Tensor]], list[list[dict]], list[int]]:
    """Per rank and sub-group: the master partition, its optimizer state; and each sub-group's param group."""
    masters, states = [], []
    groups_of: list[int] = []
    for state, path in zip(optim, files):
        flats = [t.reshape(-1) for t in state["fp32_flat_groups"]]
        base = state["optimizer_state_dict"]
        ids = [(j, i) for j, g in enumerate(base["param_groups"]) for i in g["params"]]  # sub-groups, in order
        if len(ids) != len(flats):
            raise CheckpointError(f"`{path}` holds {len(flats)} sub-groups and state for {len(ids)}. HINT: the file"
                                  " is damaged; resume from another tag.")
        groups_of = [j for j, _ in ids]
        masters.append(flats)
        states.append([_elementwise(base["state"].get(i, {}), f.numel(), f"`{path}`, sub-group {s}")
                       for s, ((_, i), f) in enumerate(zip(ids, flats))])
    return masters, states, groups_of


def _zero3_spans(shapes: list[dict], flat_sizes: list[int], world: int, path: Path) -> dict[str, list[_Span]]:
    """Stage 3: every parameter cut into ``ceil(numel / world)`` per rank, the parts in ``param_shapes`` order."""
    spans: dict[str, list[_Span]] = {}
    starts = [0]
    for n in flat_sizes:
        starts.append(starts[-1] + n)
    offset, flat = 0, 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        part = -(-numel // world)
        while flat < len(flat_sizes) and offset >= starts[flat + 1] and part:
            flat += 1
        if part and (flat == len(flat_sizes) or offset + part > starts[flat + 1]):
            raise CheckpointError(f"`{path}`: `{name}` does not fit its rank's flat tensors ({flat_sizes}). HINT: the"
                                  " model states and optimizer files are of different saves.")
        spans[name] = [_Span(r * part, min(numel, (r + 1) * part), r, flat, offset - starts[flat])
                       for r in range(world) if r * part < numel]
        offset += part
    if offset != starts[-1]:
        raise CheckpointError(f"`{path}`: the parameters take {offset} elements per rank, the flat tensors hold"
                              f" {starts[-1]}. HINT: the model states and optimizer files are of different saves.")
    return spans


def _precision_state(scaler: Any, skipped: Any) -> dict[str, Any]:
    """lzero's precision state: DeepSpeed's skipped steps, and its dynamic fp16 loss scaler's scale and counters."""
    state: dict[str, Any] = {"skipped_steps": int(skipped or 0)}
    fields = getattr(scaler, "__dict__", {})
    if fields.get("dynamic"):
        state["loss_scaler"] = {
            "scale": float(fields.get("cur_scale", 1.0)), "iteration": int(fields.get("cur_iter", 0)),
            "last_overflow_iteration": int(fields.get("last_overflow_iter", -1)),
            "hysteresis_left": int(fields.get("cur_hysteresis", fields.get("delayed_shift", 1))),
            "overflows_at_min_scale": 0}
    return state


def lightning_loops_after(steps: int, accumulation: int) -> dict[str, Any]:
    """Lightning's fit-loop state after optimizer step ``steps`` of epoch 0 (``accumulation`` batches per step), saved
    between two batches, with the epoch's own counters at 0: the resumed run counts its batches, and so its gradient
    accumulation, from the start of its data loader, whose position a DeepSpeed folder does not record; the global
    step (the optimizer steps' total) and the logging step go on from ``steps``."""
    batches = steps * accumulation

    def progress(total: int, **keys: bool) -> dict[str, Any]:
        counts = ["ready", *(k for k, on in keys.items() if on), "completed"]
        return {"total": {k: total for k in counts}, "current": {k: 0 for k in counts}}

    return {"fit_loop": {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": steps},
        "epoch_loop.batch_progress": {**progress(batches, started=True, processed=True), "is_last_batch": False},
        "epoch_loop.scheduler_progress": progress(steps),
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
            "step": progress(steps), "zero_grad": progress(steps, started=True)}},
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": progress(0),
        "epoch_progress": {"total": {"ready": 1, "started": 1, "processed": 0, "completed": 0},
                           "current": {"ready": 1, "started": 1, "processed": 0, "completed": 0}},
    }}


def _lightning_version() -> str:
    try:
        return importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        return "2.0.0"
