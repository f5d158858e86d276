"""``ExportHF``: a Hugging Face folder written at the end of ``fit`` (see [Note: exporting to a Hugging Face folder]
in export.py), from a checkpoint every rank writes its shards of, so no rank gathers the model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override


class ExportHF(Callback):
    """At the end of ``fit``: the trained model as a ``save_pretrained`` folder at ``out_dir``.

    Args:
        out_dir: the folder to write; replaced at the end of each fit (the old one stays until the new is complete).
        config: the folder to copy ``config.json``, ``generation_config.json`` and tokenizer files from; by default
            the folder the model's ``from_pretrained`` read.
        dtype: ``fp32``, ``bf16`` or ``fp16`` for the floating tensors (default: fp32, as stored).
        max_shard_size: the largest weight file, e.g. ``5GB``.
        prefix: the LightningModule attribute holding the model, with its dot; by default that of the first
            Hugging Face ``PreTrainedModel`` (or peft model) inside the LightningModule.
        adapters_only: a peft model's LoRA adapters alone (``adapter_model.safetensors`` and the adapter's
            ``adapter_config.json``), for ``PeftModel.from_pretrained(base, out_dir)``.
        merge: a peft model's LoRA adapters folded into its base, as ``merge_and_unload()`` folds them (a quantized
            base dequantized, into bf16 unless ``dtype`` says otherwise): a plain model's folder, with the adapter's
            hyperparameters taken from the live peft model (see [Note: a merged export] in merge.py).
    """

    def __init__(self, out_dir: str, config: Optional[str] = None, dtype: Optional[str] = None,
                 max_shard_size: str = "5GB", prefix: Optional[str] = None, adapters_only: bool = False,
                 merge: bool = False) -> None:
        if merge and adapters_only:
            raise ValueError("ExportHF(merge=True, adapters_only=True) asks for two exports. HINT: pass one: merge for"
                             " the base with the adapters folded in, adapters_only for the adapters alone.")
        self.out_dir = Path(out_dir)
        self.config, self.dtype, self.max_shard_size, self.prefix = config, dtype, max_shard_size, prefix
        self.adapters_only, self.merge = adapters_only, merge

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lzero.hf.export import export_hf

        prefix, folder = _pretrained_of(pl_module, self.adapters_only or self.merge)
        adapter = None
        if self.merge:  # the peft model's keys, the base's folder, the live adapter's settings (none: a plain model)
            folder, adapter = _pretrained_of(pl_module)[1], _peft_config(pl_module, required=False)
        staging = self.out_dir.parent / f".{self.out_dir.name}.export.ckpt"  # the same path on every rank
        trainer.save_checkpoint(staging, weights_only=True)  # a collective: each rank writes its own shards
        if trainer.is_global_zero:
            with tempfile.TemporaryDirectory() as adapter_config:
                if self.adapters_only and self.config is None:  # the adapter's own configuration
                    _peft_config(pl_module).save_pretrained(adapter_config)
                    folder = adapter_config
                try:
                    export_hf(staging, self.out_dir, self.dtype, self.max_shard_size, self.config or folder,
                              self.prefix if self.prefix is not None else prefix, overwrite=True,
                              adapters_only=self.adapters_only, merge=self.merge, adapter_config=adapter)
                finally:
                    (shutil.rmtree if staging.is_dir() else Path.unlink)(staging)
        trainer.strategy.barrier("lzero.ExportHF")


def _peft_config(module: nn.Module, required: bool = True) -> Any:
    for sub in module.modules():
        configs = getattr(sub, "peft_config", None)
        if isinstance(configs, dict) and configs:
            return next(iter(configs.values()))
    if not required:
        return None
    raise ValueError("ExportHF(adapters_only=True): the LightningModule holds no peft model. HINT: wrap the model"
                     " with `peft.get_peft_model`, or export the whole model (adapters_only=False).")


def _pretrained_of(module: nn.Module, peft: bool = False) -> tuple[Optional[str], Optional[str]]:
    """(the attribute prefix, the folder its weights came from) of the first Hugging Face model inside ``module``
    (``peft``: of the peft model wrapping it)."""
    from lzero.hf.pretrained import source_of

    for name, sub in module.named_modules():
        if peft and name and isinstance(getattr(sub, "peft_config", None), dict):
            return f"{name}.", None
        config = getattr(sub, "config", None)
        if name and hasattr(sub, "base_model_prefix") and config is not None:
            source = source_of(sub)
            folder = source.files.folder if source is not None else Path(getattr(config, "_name_or_path", "") or ".")
            return f"{name}.", str(folder) if (folder / "config.json").is_file() else None
    return None, None
