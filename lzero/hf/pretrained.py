"""``from_pretrained`` inside a stage-3 ``configure_model``: the model built without weights, read into shards.

[Note: from_pretrained under zero3]
Under zero3 ``configure_model`` runs inside ``torch.device("meta")`` so that no rank builds the whole
model. transformers refuses ``from_pretrained`` there ("meta device context manager"). While lzero's
meta context is open, ``PreTrainedModel.from_pretrained`` (which the ``AutoModel*`` classes call) is
replaced by :func:`from_pretrained_into_shards`:

- the configuration and the dtype are resolved as transformers does (``dtype="auto"``: the
  configuration's, else the first floating tensor's in the files);
- the model is built with its parameters on the meta device and its buffers real, on the CPU: buffers
  that are computed rather than loaded (rotary ``inv_freq``, causal masks) hold the module's own values;
- the checkpoint's headers are read (no tensor) and compared with the model: a shape mismatch is refused
  naming the key and both shapes, missing and unexpected keys are reported as transformers reports them;
- the model is remembered with its checkpoint; the engine later reads each rank's shard of every unit
  straight from the files ([Note: reading a pretrained checkpoint into shards] in weights.py), and
  initializes the missing parameters with the model's ``_init_weights`` (as transformers does).

Outside lzero's meta context (zero1/zero2, or a model built in ``__init__``) ``from_pretrained`` is
transformers' own.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lzero.checkpoint.base_files import BaseTensor
from lzero.engine import packed_weights
from lzero.engine.quantized_read import table_dtype
from lzero.hf import quantize_on_read
from lzero.hf.weights import CheckpointFiles, OpenFiles, PretrainedLoadError, find_files

# from_pretrained arguments that change only where files come from: handed to the Hub download
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
# arguments that only steer how transformers finds or loads files, which lzero does itself
_LOADER_ONLY = ("trust_remote_code", "code_revision", "_from_auto", "_from_pipeline", "_commit_hash",
                "low_cpu_mem_usage", "adapter_kwargs", "use_auth_token", "mirror", "disable_mmap")
# arguments lzero cannot honour while building into shards: refused by name rather than ignored
_REFUSED = {
    "device_map": "lzero places every shard itself",
    "max_memory": "lzero places every shard itself",
    "offload_folder": "use the zero3_offload_nvme strategy",
    "tp_plan": "lzero shards by data parallelism only",
    "distributed_config": "lzero shards by data parallelism only",
    "device_mesh": "lzero shards by data parallelism only",
    "state_dict": "pass the folder, or load the state dict after fit",
    "gguf_file": "convert the GGUF file to safetensors first",
    "from_tf": "convert the checkpoint to safetensors first",
    "from_flax": "convert the checkpoint to safetensors first",
    "adapter_name": "load the base model, then add adapters with peft",
    "key_mapping": "rename the checkpoint's keys with `save_pretrained` first",
    "load_in_8bit": "pass `quantization_config=BitsAndBytesConfig(load_in_8bit=True)` instead",
    "load_in_4bit": "pass `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` instead",
}


@dataclass
class PretrainedSource:
    """A model built by :func:`from_pretrained_into_shards` and the checkpoint its weights come from."""

    files: CheckpointFiles
    by_tensor: dict[int, tuple[Tensor, str]] = field(default_factory=dict)  # id(tensor) -> (tensor, checkpoint key)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    quantized: dict[int, Any] = field(default_factory=dict)  # id(weight) -> its QuantizedRead (hf/quantize_on_read.py)
    # storage (``_cdata``) -> (checkpoint key, numel, dtype) of each matched tensor as it was matched: code after
    # ``from_pretrained`` may give a parameter new data (a resized embedding), the storage stays the checkpoint's
    by_storage: dict[int, tuple[str, int, torch.dtype]] = field(default_factory=dict)
    storages: list = field(default_factory=list)  # those storages, kept alive so that their keys stay theirs


_SOURCES: "weakref.WeakKeyDictionary[nn.Module, PretrainedSource]" = weakref.WeakKeyDictionary()


def source_of(model: nn.Module) -> Optional[PretrainedSource]:
    return _SOURCES.get(model)


@contextlib.contextmanager
def intercept() -> Iterator[None]:
    """Inside the block, ``PreTrainedModel.from_pretrained`` builds into shards (see [Note: from_pretrained under
    zero3]); a no-op when transformers is not installed."""
    base = pretrained_class()
    if base is None:
        yield
        return
    from lzero.engine.recording import read_values_from_files

    read_values_from_files(_all_storage_loads)  # a construction reading loaded values: [Note: a fake device]
    original = base.__dict__["from_pretrained"]

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        from lzero.engine.recording import real_construction

        with real_construction():  # meta parameters and real buffers, as built below
            return from_pretrained_into_shards(cls, *args, **kwargs)

    base.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        base.from_pretrained = original


def pretrained_class() -> Optional[type]:
    if "transformers" not in sys.modules:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return None
    from transformers import PreTrainedModel

    return PreTrainedModel


def from_pretrained_into_shards(cls: type, pretrained_model_name_or_path: Any, *model_args: Any,
                                config: Any = None, dtype: Any = None, torch_dtype: Any = None,
                                use_safetensors: Optional[bool] = None, weights_only: bool = True,
                                ignore_mismatched_sizes: bool = False, output_loading_info: bool = False,
                                **kwargs: Any) -> Any:
    """``cls.from_pretrained(...)`` with the parameters on the meta device and the checkpoint remembered for the
    engine, which reads each rank's shards at setup. See [Note: from_pretrained under zero3]."""
    quantization_config = kwargs.pop("quantization_config", None)
    _refuse(cls, kwargs, weights_only)
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    for key in _LOADER_ONLY:
        kwargs.pop(key, None)
    folder = _local_folder(pretrained_model_name_or_path, hub)
    config, kwargs = _config(cls, folder, config, kwargs)
    files = find_files(folder, use_safetensors)
    dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, config, files)
    quantizer = quantize_on_read.quantizer_for(config, quantization_config, dtype)  # [Note: quantize on read]
    from lzero.engine.recording import as_fakes, unrecorded

    with unrecorded():  # built as transformers builds it, on the meta device: no draw to replay
        model = _build(cls, config, dtype, model_args, kwargs)
        reads = quantize_on_read.lay_out(model, quantizer, dtype) if quantizer is not None else {}
    as_fakes(model, skip=set(reads))  # like the rest of the construction (see [Note: a fake device])
    source = _match(model, files, ignore_mismatched_sizes, {i: r.shape for i, r in reads.items()})
    source.quantized = reads
    _initialize_missing(model, source)
    if quantizer is not None:
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)  # is_loaded_in_4bit/8bit, config.quantization_config: what peft reads
    _report(model, folder, source)
    _SOURCES[model] = source
    _load_generation_config(model, folder)
    model.eval()  # as transformers returns it
    if output_loading_info:
        info = {"missing_keys": set(source.missing), "unexpected_keys": set(source.unexpected),
                "mismatched_keys": set(source.mismatched), "error_msgs": []}
        return model, info
    return model


def _initialize_missing(model: nn.Module, source: PretrainedSource) -> None:
    """What transformers' ``from_pretrained`` draws: every tensor the files hold marked initialized
    (``_is_hf_initialized``, the flag transformers' initializers skip), then the model's ``initialize_weights()``,
    which draws for the others (a new head, keys missing from the files) in transformers' order. Inside lzero's meta
    context the draws are recorded and replayed at setup in eager order ([Note: replayed construction])."""
    initialize = getattr(model, "initialize_weights", None)
    if initialize is None:  # an older transformers: the engine initializes the missing keys block by block
        return
    loaded = {id(tensor) for tensor, _ in source.by_tensor.values()}
    for module in model.modules():  # the build's own initialization (unrecorded) flagged them all
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(tensor) in loaded:
                tensor._is_hf_initialized = True
            else:
                tensor.__dict__.pop("_is_hf_initialized", None)
    with torch.device("cpu"):  # as `_build`: computed buffers (rotary inv_freq) are real, on the CPU
        initialize()


def _refuse(cls: type, kwargs: dict[str, Any], weights_only: bool) -> None:
    for key, why in _REFUSED.items():
        if kwargs.get(key) not in (None, False):
            raise PretrainedLoadError(
                f"`{cls.__name__}.from_pretrained(..., {key}={kwargs[key]!r})` inside a zero3 `configure_model`: {why}."
                f" HINT: remove `{key}`; lzero reads each rank's shard of the weights at setup.")
    if not weights_only:
        raise PretrainedLoadError(
            f"`{cls.__name__}.from_pretrained(..., weights_only=False)`: lzero reads checkpoints with"
            " `weights_only=True` only. HINT: remove the argument; a .bin file that needs more than tensors must be"
            " converted to safetensors first.")


def _local_folder(name: Any, hub: dict[str, Any]) -> Path:
    path = Path(name)
    if path.is_dir():
        return path / hub["subfolder"] if hub.get("subfolder") else path
    if path.exists() or str(name).startswith((".", "/")) or str(name).count("/") > 1:
        raise PretrainedLoadError(f"`{name}` is not a folder. HINT: pass the folder that `save_pretrained` wrote,"
                                  " or a Hugging Face model id.")
    from huggingface_hub import snapshot_download

    options = {k: v for k, v in hub.items() if k in ("cache_dir", "force_download", "local_files_only", "token",
                                                     "revision", "proxies")}
    folder = Path(snapshot_download(str(name), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"],
                                    **options))
    return folder / hub["subfolder"] if hub.get("subfolder") else folder


def _config(cls: type, folder: Path, config: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model's configuration and the keyword arguments left for its ``__init__``, as transformers splits them."""
    if config is None or isinstance(config, (str, Path)):
        config, kwargs = cls.config_class.from_pretrained(config or folder, return_unused_kwargs=True, **kwargs)
    else:
        config = config.__class__.from_dict(config.to_dict())  # the caller's object stays as it was
        for key in [k for k in kwargs if hasattr(config, k)]:
            setattr(config, key, kwargs.pop(key))
    return config, kwargs


def _resolve_dtype(dtype: Any, config: Any, files: CheckpointFiles) -> torch.dtype:
    """As transformers: an explicit dtype; for None or "auto", the configuration's dtype, else the first floating
    tensor's dtype in the files; float32 when there is neither."""
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    from_config = getattr(config, "dtype", None)
    if isinstance(from_config, str):
        from_config = getattr(torch, from_config)
    if isinstance(from_config, torch.dtype):
        return from_config
    floating = [t.dtype for t in files.tensors.values() if t.dtype.is_floating_point]
    return floating[0] if floating else torch.float32


def _build(cls: type, config: Any, dtype: torch.dtype, model_args: tuple, kwargs: dict[str, Any]) -> nn.Module:
    """The model with meta parameters and real (CPU) buffers; see [Note: from_pretrained under zero3]."""
    if model_args:
        raise PretrainedLoadError(
            f"`{cls.__name__}.from_pretrained(path, *{model_args!r})` inside a zero3 `configure_model`: positional"
            " arguments for the model's `__init__` are not passed on. HINT: pass them as keyword arguments.")
    with torch.device("cpu"), _parameters_on_meta():
        model = cls._from_config(config, dtype=dtype, **kwargs)
    _keep_in_fp32(model, dtype)
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside the block move to the meta device as they are registered (their storage
    from ``torch.empty`` is never written); buffers stay where they were built."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers keeps some modules in float32 when it loads in 16 bits (``_keep_in_fp32_modules``)."""
    names = getattr(model, "_keep_in_fp32_modules", None) or []
    if dtype not in (torch.float16, torch.bfloat16) or not names:
        return
    for name, module in model.named_modules():
        if any(re.search(rf"(^|\.){re.escape(n)}($|\.)", name) for n in names):
            for pname, p in list(module.named_parameters(recurse=False)):
                if p.is_floating_point():
                    setattr(module, pname, nn.Parameter(p.to(torch.float32), requires_grad=p.requires_grad))


def state_keys(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor a state dict of ``model`` holds -> all its names (tied parameters share one entry). Non-persistent
    buffers are left out: they are computed, not loaded."""
    names: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        first.setdefault(id(p), name)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                name = f"{mod_name}.{bname}" if mod_name else bname
                names.setdefault(id(b), []).append(name)
                first.setdefault(id(b), name)
    return {first[i]: aliases for i, aliases in names.items()}


def candidate_keys(key: str, prefix: str) -> list[str]:
    """Checkpoint keys that may hold the model's ``key``: itself, and with/without the base model's prefix."""
    out = [key]
    if prefix:
        out.append(key[len(prefix) + 1:] if key.startswith(prefix + ".") else f"{prefix}.{key}")
    return out


def _match(model: nn.Module, files: CheckpointFiles, ignore_mismatched: bool,
           shapes: Optional[dict[int, tuple[int, ...]]] = None) -> PretrainedSource:
    """Each model tensor's checkpoint key; missing, unexpected and mismatched keys as transformers reports them.
    ``shapes``: id(tensor) -> the shape its checkpoint tensor has (a quantized weight's unquantized shape)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    tensors = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    missing, mismatched, skipped = [], [], set()
    by_tensor: dict[int, tuple[Tensor, str]] = {}
    for first, aliases in state_keys(model).items():
        found = next((c for a in aliases for c in candidate_keys(a, prefix) if c in files.tensors), None)
        if found is None:
            missing.append(first)
            continue
        want, have = (shapes or {}).get(id(tensors[first]), tuple(tensors[first].shape)), files.tensors[found].shape
        if want != have:
            if not ignore_mismatched:
                raise PretrainedLoadError(
                    f"`{found}` has shape {list(have)} in `{files.folder / files.tensors[found].file}`, but the model's"
                    f" `{first}` has shape {list(want)}. HINT: check that `config.json` belongs to these weights; to"
                    " train a new head of another size, pass `ignore_mismatched_sizes=True` (that tensor is then"
                    " initialized, as transformers does).")
            mismatched.append(first)
            skipped.add(found)  # neither loaded nor unexpected: transformers lists it as mismatched
            continue
        by_tensor[id(tensors[first])] = (tensors[first], found)
    by_storage = {_storage(t): (key, t.numel(), t.dtype) for t, key in by_tensor.values()}
    storages = [t.untyped_storage() for t, _ in by_tensor.values()]
    used = {key for _, key in by_tensor.values()} | skipped
    unexpected = [k for k in files.tensors if k not in used]
    missing = _ignored(missing, getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected = _ignored(unexpected, getattr(model, "_keys_to_ignore_on_load_unexpected", None))
    return PretrainedSource(files, by_tensor, missing, unexpected, mismatched, by_storage=by_storage,
                            storages=storages)


def _ignored(keys: list[str], patterns: Optional[list[str]]) -> list[str]:
    if not patterns:
        return keys
    return [k for k in keys if not any(re.search(p, k) for p in patterns)]


def _report(model: nn.Module, folder: Path, source: PretrainedSource) -> None:
    """The two warnings transformers gives for a non-strict load, once (rank 0)."""
    from lightning.fabric.utilities import rank_zero_warn

    name = type(model).__name__
    if source.missing or source.mismatched:
        rank_zero_warn(f"Some weights of {name} were not initialized from the model checkpoint at {folder} and are"
                       f" newly initialized (by the model's _init_weights): {source.missing + source.mismatched}."
                       " You should probably TRAIN this model on a down-stream task.")
    if source.unexpected:
        rank_zero_warn(f"Some weights of the model checkpoint at {folder} were not used when initializing {name}:"
                       f" {source.unexpected}.")


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").exists() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _all_storage_loads() -> dict[int, Callable[[Tensor], None]]:
    """``storage -> fill`` for every tensor of every model built by :func:`from_pretrained_into_shards` (alive)."""
    return {k: v for model in list(_SOURCES.keys()) for k, v in PretrainedWeights(model).storage_loads().items()}


def _casts(files: dict[int, tuple], tensors: list[Tensor]) -> dict[int, tuple]:
    """The storages the recordings of ``tensors`` cast from those of ``files``, as entries of ``files`` in their dtype:
    [Note: a cast of pretrained tensors]."""
    from lzero.engine.recording import casts_of

    return {storage: (*files[origin][:3], dtype) for storage, (origin, dtype) in casts_of(tensors, set(files)).items()}


def _load_whole(source: PretrainedSource, key: str, numel: int, dtype: torch.dtype, out: Tensor) -> None:
    files = OpenFiles(source.files)
    try:
        files.read_flat_into(key, 0, numel, out[: numel * dtype.itemsize].view(dtype))
    finally:
        files.close()


class PretrainedWeights:
    """The engine's view of every pretrained model inside one root module: which tensors (by their names in the
    root) come from a checkpoint, and their flat ranges. See [Note: reading a pretrained checkpoint into shards].

    Tensors are recognized by identity, not by name: wrappers added after ``from_pretrained`` (peft's LoRA
    layers, activation checkpointing) rename the modules but keep the parameter objects. What the files do not hold
    (adapters, a new head, missing keys) comes from the model's replayed construction (``over_replay``).

    [Note: a cast of pretrained tensors]
    bf16-true casts the model after ``configure_model`` (``convert_module``: ``module.to(torch.bfloat16)``), as
    Lightning's DDP casts the model it loaded: each cast tensor gets a new storage, which the model's recording
    records as a ``_to_copy`` of the loaded one (``recording_more`` in lzero/engine/recording.py). Those storages are
    the checkpoint's too, in the cast dtype: recognized here from the recording (``casts_of``), each rank reads its
    pieces of them converted to the parameter's dtype (``copy_`` rounds as ``.to`` does), and the replay, which reads
    the files for them (``storage_loads``), skips the casts whose result it does not need ([Note: replayed
    construction] in lzero/engine/replay.py)."""

    over_replay = True  # what the files do not hold comes from the model's replayed construction (replay.py)

    def __init__(self, root: nn.Module) -> None:
        self._keys: dict[str, tuple[PretrainedSource, str]] = {}  # root name -> (its source, checkpoint key)
        self.sources: list[PretrainedSource] = [s for m in root.modules() if (s := _SOURCES.get(m)) is not None]
        # by storage: a tensor built on lzero's fake device is swapped for a meta tensor over the same storage at
        # setup (lzero.engine.recording.settle), and one whose storage was replaced since (a resized embedding) is no
        # longer the checkpoint's
        named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
        # storage -> (its source, checkpoint key, numel, dtype): the matched tensors and their casts
        self._files = {storage: (source, key, numel, dtype) for source in self.sources
                       for storage, (key, numel, dtype) in source.by_storage.items()}
        self._files.update(_casts(self._files, [t for _, t in named]))
        owner = {storage: (source, key) for storage, (source, key, _, _) in self._files.items()}
        self._quantized: dict[str, quantize_on_read.QuantizedRead] = {}  # root name -> how to quantize it on read
        for name, t in named:
            if _storage(t) in owner:
                self._keys[name] = owner[_storage(t)]
                read = owner[_storage(t)][0].quantized.get(id(t))
                if read is not None:
                    self._quantized[name] = read

    def __bool__(self) -> bool:
        return bool(self._keys)

    def finish(self, root: nn.Module, all_reduce_max: Callable[[Tensor], None], device: torch.device) -> None:
        """Every rank has read its shards: the quantized weights get their whole quantization state (a collective)."""
        quantize_on_read.finish(root, self._quantized, all_reduce_max, device)

    def holds(self, name: str) -> bool:
        """Whether the root's tensor ``name`` is read from a checkpoint."""
        return name in self._keys

    def base_tensor(self, name: str, dtype: Optional[torch.dtype] = None,
                    saved: Optional[torch.dtype] = None) -> Optional[BaseTensor]:
        """Where the root's tensor ``name`` is in a safetensors file, read into ``dtype`` and saved as ``saved``
        ([Note: a checkpoint without its frozen base] in lzero/checkpoint/base_files.py); None when it is not read
        from one (a ``.bin`` checkpoint's tensors are written into checkpoints)."""
        if name not in self._keys or self._keys[name][0].files.kind != "safetensors":
            return None
        source, key = self._keys[name]
        read = self._quantized.get(name)
        if read is not None and read.method == packed_weights.FOUR_BIT:
            read.table = read.table or table_dtype(read.quant_type)  # a rank that quantized none of it: the process's
            if read.table is None:  # codes that could not be quantized again alike: [Note: the process's 4-bit code table]
                return None
        path = (source.files.folder / source.files.tensors[key].file).resolve()
        return BaseTensor(str(path), key, dtype or torch.float32, saved or dtype or torch.float32,
                          read.record() if read is not None else None)

    def storage_loads(self) -> dict[int, Callable[[Tensor], None]]:
        """Storage -> a function that fills a flat byte view of it with the checkpoint tensor it was matched with: for
        a replay that reads a loaded tensor the model no longer holds (a resized embedding copies the old rows)."""
        quantized = {_storage(t) for source in self.sources for t, _ in source.by_tensor.values()
                     if id(t) in source.quantized}
        return {storage: functools.partial(_load_whole, source, key, numel, dtype)
                for storage, (source, key, numel, dtype) in self._files.items() if storage not in quantized}

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[str, int, int, Tensor], None]]:
        """``read(name, start, end, out)``: elements [start, end) of the flattened tensor ``name`` into ``out``
        (converted to its dtype). Files opened inside the block are closed at its end."""
        handles: dict[int, OpenFiles] = {}

        def read(name: str, start: int, end: int, out: Tensor) -> None:
            source, key = self._keys[name]
            if id(source) not in handles:
                handles[id(source)] = OpenFiles(source.files)
            files = handles[id(source)]
            quantizing = self._quantized.get(name)
            if quantizing is None:
                files.read_flat_into(key, start, end, out)
            else:  # packed elements: their weights read and quantized ([Note: quantize on read])
                quantizing.read(lambda a, b, values: files.read_flat_into(key, a, b, values), start, end, out)

        try:
            yield read
        finally:
            for handle in handles.values():
                handle.close()
