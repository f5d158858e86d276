"""Generation under zero3 and zero3_offload, world size 2: ``strategy.generation()`` (every block gathered once) and
without it (each block gathered per forward, ranks kept stepping together), against DDP; a PPO-style rollout inside
``training_step`` followed by an update, against DDP.

    python tests/scripts/generate_runs.py MODELS_DIR OUT_DIR

Each rank generates up to 20 greedy tokens for its own prompt, stopping at the model's token in ``EOS``, chosen
(from the plain models of tests/_pretrained_models.py) so that rank 0 stops after 1 (GPT-2) or 4 (Llama) tokens
while rank 1 runs all 20. Rank 0 writes ``OUT_DIR/<model>-<strategy>-<mode>.pt``: each rank's tokens, all-gathers and
seconds, and ``OUT_DIR/rollout-<strategy>.pt``: the parameters after 2 rollout + update steps.
tests/test_generate.py compares them.
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
from lzero import collectives
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

PROMPTS = torch.tensor([[3, 17, 42, 5], [9, 88, 21, 60]])
NEW_TOKENS = 20
EOS = {"gpt2": 5, "llama": 37}


def _generation(module: LightningModule, gathered: bool) -> Any:
    strategy = module.trainer.strategy
    return strategy.generation() if gathered and hasattr(strategy, "generation") else contextlib.nullcontext()


class Generate(LightningModule):
    def __init__(self, path: str, gathered: bool, eos: int) -> None:
        super().__init__()
        self.path, self.gathered, self.eos = path, gathered, eos

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        calls = [0]
        all_gather = collectives.all_gather

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return all_gather(*args, **kwargs)

        collectives.all_gather = counted
        try:
            start = time.perf_counter()
            with _generation(self, self.gathered):
                entered = calls[0]
                tokens = self.model.generate(batch[0], max_new_tokens=NEW_TOKENS, do_sample=False,
                                             eos_token_id=self.eos, pad_token_id=self.eos)
            seconds = time.perf_counter() - start
        finally:
            collectives.all_gather = all_gather
        return {"tokens": tokens, "gathers_on_entry": entered, "gathers": calls[0], "seconds": seconds}


class Rollout(LightningModule):
    """PPO-shaped: greedy rollouts from the current policy (no gradient), then a likelihood update on them."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with _generation(self, True), torch.no_grad():
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
            for gathered in ((False,) if strategy == "ddp" else (True, False)):
                t = trainer(strategy)
                results = t.predict(Generate(str(models / name), gathered, EOS[name]), prompts)
                mine = [{k: v for k, v in r.items()} for r in results]
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                if t.is_global_zero:
                    mode = "gathered" if gathered else "per_forward"
                    torch.save(every, out / f"{name}-{strategy}-{mode}.pt")
    for strategy in ("ddp", "zero3"):
        torch.manual_seed(0)
        model = Rollout(str(models / "llama"))
        t = trainer(strategy, max_steps=2)
        t.fit(model, DataLoader(TensorDataset(PROMPTS.repeat(2, 1)), batch_size=1))
        if t.is_global_zero:
            torch.save({k: v.detach().clone() for k, v in model.model.state_dict().items()}, out / f"rollout-{strategy}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    destroy_process_group()
