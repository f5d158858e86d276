"""Hugging Face interop: pretrained checkpoints read into shards (``from_pretrained`` under zero3), sharded lzero
checkpoints exported as a ``save_pretrained`` folder (``lzero export-hf``, :func:`export_hf`, :class:`ExportHF`).
The checkpoint reading and writing need ``safetensors``; what touches a model class needs ``transformers``."""

from typing import Any

_EXPORTS = {"export_hf": "lzero.hf.export", "ExportHF": "lzero.hf.callback",
            "PretrainedLoadError": "lzero.hf.weights"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lzero.hf' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
