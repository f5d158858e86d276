"""Registers lzero's strategy names with Lightning (the Trainer's registry and Fabric's) the moment Lightning loads
its strategies.

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

_TRAINER = "lightning.pytorch.strategies"
_FABRIC = "lightning.fabric.strategies"
_FABRIC_CONNECTOR = "lightning.fabric.connector"


class _LazyPreset:
    """A registry factory that resolves its name to lzero only when a Trainer (or, with ``fabric``, a Fabric) asks
    for it. A plain module-level class, so the registry's entries pickle."""

    def __init__(self, name, fabric=False):
        self.name = name
        self.fabric = fabric

    def __call__(self, **init_params):
        from lzero.lightning.wiring import build_preset

        if self.fabric:
            from lzero.lightning.fabric_strategy import ZeroFabricStrategy as strategy
        else:
            from lzero.lightning.trainer_strategy import ZeroStrategy as strategy

        return build_preset(strategy, self.name, **init_params)


def register(registry, fabric=False):
    """Add the names to a Lightning strategy registry (the Trainer's, or with ``fabric`` Fabric's); harmless to
    repeat."""
    for name, description in PRESETS.items():
        registry.register(name, _LazyPreset(name, fabric), description=description, override=True)


def suggest_names(connector_class):
    """Fabric's error for an unknown strategy name, given a name close to an lzero one (``zero_3``, ``zer3``), also
    names that one."""
    original = connector_class._check_config_and_set_final_flags
    if getattr(original, "_lzero_guard", False):
        return

    def check(self, strategy, *args, **kwargs):
        try:
            return original(self, strategy, *args, **kwargs)
        except ValueError as err:
            if not isinstance(strategy, str) or "invalid strategy name" not in str(err):
                raise
            import difflib

            wanted = strategy.lower().replace("-", "_")
            close = difflib.get_close_matches(wanted, list(PRESETS), n=1, cutoff=0.6)
            if not close:
                raise
            raise ValueError(f"{err} HINT: did you mean lzero's `strategy={close[0]!r}`? lzero's names: "
                             f"{', '.join(PRESETS)}.") from None

    check._lzero_guard = True
    connector_class._check_config_and_set_final_flags = check


def _quietly(action, *args):
    try:
        action(*args)
    except Exception:
        pass


def _register_from(module):
    _quietly(register, module.StrategyRegistry)
    _quietly(guard_checkpoint_loads)


def _on_import(name, module):
    if name == _TRAINER:
        _register_from(module)
    elif name == _FABRIC:
        _quietly(register, module.STRATEGY_REGISTRY, True)
    elif name == _FABRIC_CONNECTOR:
        _quietly(suggest_names, module._Connector)


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
        if fullname not in _TARGETS:
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
                _on_import(fullname, module)

            loader.exec_module = exec_module
            return spec
        except Exception:
            return None


_TARGETS = (_TRAINER, _FABRIC, _FABRIC_CONNECTOR)


def install():
    for name in _TARGETS:
        if name in sys.modules:
            _on_import(name, sys.modules[name])
    if not all(name in sys.modules for name in _TARGETS) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    install()
except Exception:
    pass
