"""Generation under zero3 and zero3_offload, world size 2: ``strategy.generation()`` (every block gathered once),
``strategy.generation(mode="streamed")`` (blocks copied from a host copy per forward) and without it (each block gathered per forward, ranks kept stepping together), against DDP; a PPO-style rollout inside
``training_step`` followed by an update, against DDP.

    python tests/hf/generate_runs.py MODELS_DIR OUT_DIR

Each rank generates up to 20 greedy tokens for its own prompt, stopping at the model's token in ``EOS``, chosen
(from the plain models of tests/_pretrained_models.py) so that rank 0 stops after 1 (GPT-2) or 4 (Llama) tokens
while rank 1 runs all 20. Rank 0 writes ``OUT_DIR/<model>-<strategy>-<mode>.pt``: each rank's tokens, all-gathers, host
copies and seconds, and ``OUT_DIR/rollout-<strategy>.pt``: the parameters after 2 rollout + update steps.
tests/hf/test_generate.py compares them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

import lzero  # noqa: F401
from lzero.engine import collectives
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

PROMPTS = torch.tensor([[3, 17, 42, 5], [9, 88, 21, 60]])
NEW_TOKENS = 20
EOS = {"gpt2": 5, "llama": 37}


def _generation(module: LightningModule, mode: str) -> Any:
    """``mode``: "gathered" or "streamed" (``strategy.generation(mode=mode)``), or "per_forward" (no context)."""
    strategy = module.trainer.strategy
    if mode == "per_forward" or not hasattr(strategy, "generation"):
        return contextlib.nullcontext()
    return strategy.generation(module.model, mode=mode)  # the model inside, as a policy in RLHF: Fabric's call


class Generate(LightningModule):
    def __init__(self, path: str, mode: str, eos: int) -> None:
        super().__init__()
        self.path, self.mode, self.eos = path, mode, eos

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        from lzero.engine.gather import Gatherer

        calls, copies = [0], [0]
        all_gather, copy_from_host = collectives.all_gather, Gatherer._copy_from_host

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return all_gather(*args, **kwargs)

        def copy_counted(gatherer: Gatherer, block: Any) -> None:
            copies[0] += 1
            copy_from_host(gatherer, block)

        collectives.all_gather, Gatherer._copy_from_host = counted, copy_counted
        try:
            start = time.perf_counter()
            with _generation(self, self.mode):
                entered = calls[0]
                generating = time.perf_counter()
                tokens = self.model.generate(batch[0], max_new_tokens=NEW_TOKENS, do_sample=False,
                                             eos_token_id=self.eos, pad_token_id=self.eos)
                generated = time.perf_counter() - generating
            seconds = time.perf_counter() - start
        finally:
            collectives.all_gather, Gatherer._copy_from_host = all_gather, copy_from_host
        return {"tokens": tokens, "gathers_on_entry": entered, "gathers": calls[0], "host_copies": copies[0],
                "seconds": seconds, "generate_seconds": generated}


class Rollout(LightningModule):
    """PPO-shaped: greedy rollouts from the current policy (no gradient), then a likelihood update on them."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with _generation(self, "gathered"), torch.no_grad():
            sequences = self.model.generate(batch[0], max_new_tokens=6, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
        return self.model(input_ids=sequences, labels=sequences).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def trainer(strategy: str, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, **kwargs)


def main(models: Path, out: Path) -> None:
    prompts = DataLoader(TensorDataset(PROMPTS), batch_size=1)
    for name in ("gpt2", "llama"):
        for strategy in ("ddp", "zero3", "zero3_offload"):
            for mode in (("per_forward",) if strategy == "ddp" else ("gathered", "streamed", "per_forward")):
                t = trainer(strategy)
                results = t.predict(Generate(str(models / name), mode, EOS[name]), prompts)
                mine = [{k: v for k, v in r.items()} for r in results]
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                if t.is_global_zero:
                    torch.save(every, out / f"{name}-{strategy}-{mode}.pt")
    for strategy in ("ddp", "zero3"):
        torch.manual_seed(0)
        model = Rollout(str(models / "llama"))
        t = trainer(strategy, max_steps=2)
        t.fit(model, DataLoader(TensorDataset(PROMPTS.repeat(2, 1)), batch_size=1))
        lzero.unshard(model)  # zero3 leaves the model sharded: whole tensors to compare (a no-op under DDP)
        if t.is_global_zero:
            torch.save({k: v.detach().clone() for k, v in model.model.state_dict().items()}, out / f"rollout-{strategy}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    destroy_process_group()
