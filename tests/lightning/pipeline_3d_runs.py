"""The seeds' 3-D example: their DeepSpeed JSON (ZeRO-2 with CPU optimizer offload on the data dimension of a tensor x
pipeline mesh) with only its sizes scaled to this machine, run by ``Trainer(strategy=ZeroStrategy(config=...))``.

    python tests/lightning/pipeline_3d_runs.py OUT_DIR LLAMA_DIR   # with 8 ranks: tp2 x pp2 x dp2

The seeds wrote ``tp_size: 8``, ``pp_size: 4`` and ``train_batch_size: 1024`` (micro 8 x 4 micro-batches x 32 data
ranks); here ``tp_size: 2``, ``pp_size: 2``, ``micro_batch_size: 1`` and ``train_batch_size: 8`` (1 x 4 x 2 data
ranks at world 8), every other key as written. The model: a tiny Hugging Face Llama (4 layers, 4 heads, 2 KV heads)
read with ``from_pretrained`` in ``configure_model``, split over the tensor ranks by its own ``base_model_tp_plan``
(the JSON's ``tensor_parallel`` block: ``tp_plan: auto``), cut into 2 stages. 4 AdamW steps; rank 0 writes
``OUT_DIR/seeds_3d.pt`` (losses, norms, the whole parameters) and ``reference_seeds_3d.pt``, one process on the same
global batches. tests/lightning/test_pipeline.py compares them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy
from pipeline_runs import MICROBATCHES, STEPS, Module, Record, dataset, reference

SEEDS = {"train_batch_size": 1024,
         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                               "allgather_partitions": True, "overlap_comm": True},
         "tensor_parallel": {"tp_size": 8}, "pipeline": {"pp_size": 4, "micro_batch_size": 8},
         "gradient_accumulation_steps": 4}
"""The seeds' example, as they wrote it."""


def scaled() -> dict:
    """The seeds' JSON with its sizes for world 8: tp2 x pp2 x dp2, micro batch 1."""
    config = json.loads(json.dumps(SEEDS))
    config["tensor_parallel"]["tp_size"] = 2
    config["pipeline"].update(pp_size=2, micro_batch_size=1)
    config["train_batch_size"] = 1 * config["gradient_accumulation_steps"] * 2
    return config


def save_llama(folder: Path) -> None:
    """A tiny Llama whose heads split over 2 tensor ranks (4 heads, 2 KV heads), 4 layers for 2 stages."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)


def whole(trainer: Trainer, module: Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (tensor pieces gathered), from the stage holding it."""
    from torch.distributed.tensor import DTensor

    with trainer.strategy.gathered_parameters(module.model):
        mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.model.named_parameters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: value for params in everyone for name, value in params.items()}


def main() -> None:
    out, llama = Path(sys.argv[1]), Path(sys.argv[2])
    module, record = Module(llama), Record()
    fit = Trainer(accelerator="cpu", devices=8, strategy=ZeroStrategy(config=scaled()), max_steps=STEPS, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[record])
    fit.fit(module, DataLoader(dataset(), batch_size=MICROBATCHES))
    params = whole(fit, module)
    if fit.is_global_zero:
        config = fit.strategy.config
        sizes = {"tensor": config.tensor_parallel_size, "pipeline": config.pipeline_parallel_size,
                 "microbatches": config.microbatches, "stage": config.stage, "offload": config.offload_optimizer.device,
                 "data": fit.strategy.data_parallel_size}
        torch.save({"losses": record.losses, "norms": record.norms, "params": params, "sizes": sizes,
                    "sampler": fit.strategy.distributed_sampler_kwargs},
                   out / "seeds_3d.pt")
        reference(out, llama, "seeds_3d", clip=None)
    destroy_process_group()


if __name__ == "__main__":
    main()
