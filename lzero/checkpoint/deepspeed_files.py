"""A DeepSpeed checkpoint's files, found and unpickled without DeepSpeed (:class:`DeepSpeedFiles`): the tag
folder (from ``latest``, a Lightning ``DeepSpeedStrategy`` ``.ckpt`` directory, or the tag folder itself), every
rank's model and optimizer states, and the refusals by file name of what lzero cannot take over. The layout they
hold is read by deepspeed_checkpoint.py.

[Note: unpickling DeepSpeed's files]
DeepSpeed's files are pickles that name a few of its classes (loss scalers, ``ZeroStageEnum``,
``fragment_address``). They are read with ``torch.load(weights_only=True, mmap=True)``: torch's restricted
unpickler, with :data:`STAND_INS` allowed under DeepSpeed's class paths, small classes of ours that keep only the
fields (nothing of DeepSpeed's code runs, and DeepSpeed need not be installed). Any other class is refused naming it
and the file. ``mmap`` maps the tensors' bytes without reading them: a rank slices its pieces and reads only those.
"""

from __future__ import annotations

import enum
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lzero.checkpoint.files import CheckpointError
from lzero.checkpoint.reader import is_sharded_checkpoint


class LossScalerFields:
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` as pickled: their attributes only (``cur_scale``,
    ``dynamic``; dynamic: ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``...)."""


class ZeroStage(enum.IntEnum):
    """DeepSpeed's ``ZeroStageEnum``, pickled as its value."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class FragmentAddress:
    """DeepSpeed's ``fragment_address``: where a parameter's part starts in a rank's partition, and its size."""

    numel: int = 0
    start: int = 0


STAND_INS = [
    (LossScalerFields, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerFields, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
"""The DeepSpeed classes a checkpoint may name, each with the class that stands in for it. See [Note: unpickling
DeepSpeed's files]."""

_MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM_FILE = re.compile(r"((?:bf16_|fp16_)?zero_pp_rank_)(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MOE_FILE = re.compile(r"(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt"
                       r"|expp_rank_\d+_mp_rank_\d+_optim_states\.pt")
_PIPELINE_FILE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")


def deepspeed_tag_folder(path: Any) -> Optional[Path]:
    """The folder of DeepSpeed files that ``path`` names (a save directory with ``latest``, a Lightning
    ``DeepSpeedStrategy`` ``.ckpt`` directory, or the tag folder itself), or None if ``path`` is no DeepSpeed folder."""
    path = Path(path)
    if not path.is_dir() or is_sharded_checkpoint(path):
        return None
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text(errors="replace").strip()
        if not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
            raise CheckpointError(f"`{latest}` names the tag {tag!r}, which is not a folder name. HINT: it should hold"
                                  " the name of the folder DeepSpeed saved into (`global_step1000`); fix or delete it.")
        if not (path / tag).is_dir():
            raise CheckpointError(f"`{latest}` names the tag `{tag}`, but `{path / tag}` is no folder. HINT: the save"
                                  " did not finish, or the folder was moved; name a tag folder that exists.")
        return path / tag
    for folder in (path, path / "checkpoint"):
        if folder.is_dir() and any(_MODEL_FILE.fullmatch(f.name) or _OPTIM_FILE.fullmatch(f.name)
                                   for f in folder.iterdir()):
            return folder
    return None


def load_deepspeed_file(path: Path) -> Any:
    """One of DeepSpeed's files, unpickled as [Note: unpickling DeepSpeed's files] says: tensors mapped, not read."""
    with torch.serialization.safe_globals(STAND_INS):
        try:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:  # a file of torch's legacy (non-zip) format cannot be mapped
                if "mmap" not in str(err):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err)) or re.search(r"got <class '([\w.]+)'>", str(err))
            what = f"the class `{found.group(1)}`" if found else f"something off the allow-list ({err})"
            raise CheckpointError(
                f"`{path}` names {what}, which lzero does not unpickle: it reads DeepSpeed's files with"
                f" torch.load(weights_only=True) and stand-ins for {sorted({name for _, name in STAND_INS})} only."
                " HINT: a file DeepSpeed wrote names no other class; if you trust this one, convert it with DeepSpeed's"
                " own tools (zero_to_fp32.py) or load it with torch.load(weights_only=False) yourself.") from None


class DeepSpeedFiles:
    """The files of one tag folder, checked by name and unpickled (tensors mapped, not read): rank 0's model
    states, every rank's at stage 3, and every rank's optimizer states. What lzero cannot take over (tensor or
    pipeline parallel, experts, stage 0) and a rank's missing file are refused by name before any file is read."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        model_files, optim_files, prefix = _inventory(folder)
        self.model_path = model_files[0]
        self.model_states: dict[str, Any] = load_deepspeed_file(self.model_path)
        _check_parallelism(self.model_states, self.model_path)
        first = _optimizer_state(load_deepspeed_file(optim_files[0]), optim_files[0])
        self.stage, world = _stage_and_world(first, optim_files[0])
        self.optim_paths = [folder / f"{prefix}{r}_mp_rank_00_optim_states.pt" for r in range(world)]
        _check_rank_files(folder, self.optim_paths, optim_files)
        self.optim = [first] + [_optimizer_state(load_deepspeed_file(f), f) for f in self.optim_paths[1:]]
        """Every rank's ``optimizer_state_dict``."""
        self.rank_models = [self.model_states]
        """Every rank's model states at stage 3 (their frozen parameters' parts); rank 0's alone at stages 1-2."""
        if self.stage == 3:
            expected = [folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
            _check_rank_files(folder, expected, model_files)
            self.rank_models += [load_deepspeed_file(f) for f in expected[1:]]
        if not isinstance(self.model_states.get("param_shapes"), list):
            raise CheckpointError(f"`{self.model_path}` has no `param_shapes`. HINT: it was not written by a ZeRO run.")

    @property
    def world_size(self) -> int:
        return len(self.optim)


def _inventory(folder: Path) -> tuple[list[Path], list[Path], str]:
    """The model states files (rank 0's first), the optimizer states files by rank, and their name's prefix; what
    lzero cannot take over refused by the name of its file, before any file is read."""
    model, optim, prefixes = {}, {}, set()
    for f in sorted(folder.iterdir()):
        if _MOE_FILE.fullmatch(f.name):
            raise CheckpointError(f"`{f}` is a mixture-of-experts file: lzero does not shard experts across ranks."
                                  " HINT: convert the checkpoint with DeepSpeed's own tools and load its weights only.")
        if _PIPELINE_FILE.fullmatch(f.name):
            raise CheckpointError(f"`{f}` is a pipeline-parallel layer file: lzero is data parallel only. HINT:"
                                  " convert the checkpoint with DeepSpeed's ds_to_universal.py, then load its weights.")
        m, o = _MODEL_FILE.fullmatch(f.name), _OPTIM_FILE.fullmatch(f.name)
        mp = (m and m.group(2)) or (o and o.group(3))
        if mp and int(mp) != 0:
            raise CheckpointError(f"`{f}` belongs to tensor- or pipeline-parallel rank {int(mp)}: lzero is data"
                                  " parallel only. HINT: merge the model-parallel ranks with DeepSpeed's"
                                  " ds_to_universal.py first.")
        if m:
            model[int(m.group(1) or 0)] = f
        elif o:
            optim[int(o.group(2))] = f
            prefixes.add(o.group(1))
    if 0 not in model:
        raise CheckpointError(f"`{folder}` has no `mp_rank_00_model_states.pt` (stages 1-2) nor"
                              " `zero_pp_rank_0_mp_rank_00_model_states.pt` (stage 3). HINT: the save did not finish"
                              " on rank 0; resume from another tag.")
    if not optim:
        raise CheckpointError(f"`{folder}` has no `*zero_pp_rank_*_optim_states.pt`: a checkpoint without ZeRO"
                              " (stage 0) or saved without its optimizer. HINT: lzero resumes ZeRO stages 1-3.")
    if len(prefixes) > 1:
        raise CheckpointError(f"`{folder}` mixes optimizer files of several precisions ({sorted(prefixes)}). HINT:"
                              " remove the files of the other run.")
    if 0 not in optim:
        raise CheckpointError(f"`{folder / (prefixes.pop() + '0_mp_rank_00_optim_states.pt')}` is missing. HINT: the"
                              " save did not finish on rank 0; resume from another tag.")
    return [model[r] for r in sorted(model)], [optim[r] for r in sorted(optim)], prefixes.pop()


def _check_rank_files(folder: Path, expected: list[Path], found: list[Path]) -> None:
    missing = [f.name for f in expected if f not in found]
    extra = [f.name for f in found if f not in expected]
    if missing:
        raise CheckpointError(f"`{folder}` lacks {missing}, of the {len(expected)} ranks that saved it. HINT: a rank's"
                              " save did not finish or the file was not copied; resume from another tag.")
    if extra:
        raise CheckpointError(f"`{folder}` holds {extra}, beyond the {len(expected)} ranks its files name. HINT: files"
                              " of another run were copied in; remove them.")


def _check_parallelism(states: dict[str, Any], path: Path) -> None:
    dims = states.get("checkpoint_parallel_dimensions") or {}
    tp, pp = int(dims.get("tp_degree", 1)), int(dims.get("pp_degree", 1))
    if int(states.get("mp_world_size") or 1) > 1 or tp > 1 or pp > 1:
        raise CheckpointError(f"`{path}` was saved with model parallelism (mp_world_size="
                              f"{states.get('mp_world_size')}, tp_degree={tp}, pp_degree={pp}): lzero is data parallel"
                              " only. HINT: merge the model-parallel ranks with DeepSpeed's ds_to_universal.py first.")


def _optimizer_state(loaded: Any, path: Path) -> dict[str, Any]:
    state = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"`{path}` holds no `optimizer_state_dict`. HINT: it is not a ZeRO optimizer file.")
    return state


def _stage_and_world(state: dict[str, Any], path: Path) -> tuple[int, int]:
    stage = state.get("zero_stage")
    if stage is None and "single_partition_of_fp32_groups" in state:
        stage = 1  # DeepSpeed's BF16_Optimizer: the stage-1 layout without the stage's name
    if stage not in (1, 2, 3):
        raise CheckpointError(f"`{path}` has zero_stage {stage!r}. HINT: lzero resumes ZeRO stages 1, 2 and 3.")
    count = state.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    if not counts or not all(isinstance(c, int) and c >= 1 for c in counts) or len(set(counts)) > 1:
        raise CheckpointError(f"`{path}` partitions its groups over {count} ranks: groups of mixture-of-experts"
                              " parameters partitioned over their own ranks. HINT: lzero does not shard experts.")
    return int(stage), counts[0]
