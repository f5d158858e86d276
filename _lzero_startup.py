"""Registers lzero's strategy names with Lightning the moment Lightning loads its strategies.

Imported at interpreter start by ``lzero_startup.pth`` (installed next to the package). It imports
neither torch, nor Lightning, nor lzero: it only watches for ``lightning.pytorch.strategies`` to be
imported and then adds names whose factory imports lzero on first use. Any failure is swallowed:
this file must never break ``pip`` or the interpreter.
"""

import sys

PRESETS = {
    "zero1": "ZeRO stage 1 (lzero): optimizer state sharded",
    "zero2": "ZeRO stage 2 (lzero): optimizer state and gradients sharded",
    "zero3": "ZeRO stage 3 (lzero): optimizer state, gradients and parameters sharded",
    "zero2_offload": "ZeRO stage 2 (lzero) with fp32 masters and optimizer state offloaded to CPU memory",
    "zero3_offload": "ZeRO stage 3 (lzero) with parameters, fp32 masters and optimizer state offloaded to CPU memory",
    "zero3_offload_nvme": "ZeRO stage 3 (lzero) with parameters, fp32 masters and optimizer state in NVMe swap files",
    "zero_auto": "ZeRO (lzero) with the stage and offload chosen at setup from the model's size and the memory free",
}
"""Registered strategy names and their descriptions; lzero.presets holds their configurations."""

_TARGET = "lightning.pytorch.strategies"


class _LazyPreset:
    """A registry factory that resolves its name to lzero only when a Trainer asks for it. A plain
    module-level class, so the registry's entries pickle."""

    def __init__(self, name):
        self.name = name

    def __call__(self, **init_params):
        from lzero.strategy import build_preset

        return build_preset(self.name, **init_params)


def register(registry):
    """Add the names to a Lightning StrategyRegistry; harmless to repeat."""
    for name, description in PRESETS.items():
        registry.register(name, _LazyPreset(name), description=description, override=True)


def _register_from(module):
    try:
        register(module.StrategyRegistry)
    except Exception:
        pass
    try:
        guard_checkpoint_loads()
    except Exception:
        pass


_LOADERS = ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io")
"""Lightning modules that bind ``pl_load``: ``load_from_checkpoint`` and every non-lzero strategy
read checkpoints through them."""


def guard_checkpoint_loads():
    """Make Lightning's checkpoint reader, given an lzero checkpoint directory (``load_from_checkpoint``,
    or a DDP run's ``ckpt_path``), say what the directory is and point to ``lzero consolidate``
    instead of a bare "Is a directory"."""
    import os

    for name in _LOADERS:
        module = sys.modules.get(name)
        original = getattr(module, "pl_load", None)
        if original is None or getattr(original, "_lzero_guard", False):
            continue

        def pl_load(path_or_url, *args, _original=original, **kwargs):
            try:
                return _original(path_or_url, *args, **kwargs)
            except IsADirectoryError as err:
                path = os.fspath(path_or_url) if isinstance(path_or_url, (str, os.PathLike)) else None
                if path is None or not os.path.isfile(os.path.join(path, "manifest.json")):
                    raise
                raise IsADirectoryError(
                    f"`{path}` is an lzero sharded checkpoint (a directory written by every rank), which plain"
                    f" Lightning cannot read. HINT: `lzero consolidate {path} model.ckpt` writes one plain file"
                    " for `load_from_checkpoint` and DDP; or resume it with an lzero strategy."
                ) from err

        pl_load._lzero_guard = True
        module.pl_load = pl_load


class _Finder:
    """A meta path finder that only adds a post-import step to Lightning's strategies package."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
            loader = spec.loader
            original = loader.exec_module

            def exec_module(module):
                original(module)
                _register_from(module)

            loader.exec_module = exec_module
            return spec
        except Exception:
            return None


def install():
    if _TARGET in sys.modules:
        _register_from(sys.modules[_TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    install()
except Exception:
    pass
