"""DPO as users write it, for the memory logs: a policy and a frozen reference model, both ``from_pretrained`` in
``configure_model``, at zero1, zero2 and zero3 in fp32 and bf16-mixed (one launch, world size 2), with
``lzero.MemoryMonitor`` logging every step.

    python tests/memory/dpo_memory_runs.py MODEL_DIR OUT_DIR

After each logged step every rank also counts what it holds, without lzero's accounting: the storage bytes of every
tensor its model and optimizers hold (see ``held_bytes``). Each rank writes ``OUT_DIR/{run}-rank{r}.json``:
``{"held": [...], "logged": [...], "expected": [...]}`` per logged step (rank 0's logger receives every rank's logs:
it writes each rank's logged values into that rank's file). tests/memory/test_memory_monitor.py compares them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

import lzero
from _teardown import destroy_process_group  # a sibling: scripts run from their folder

STEPS = 2
RUNS = {f"zero{stage}-{precision}": (stage, precision) for precision in ("32-true", "bf16-mixed") for stage in (1, 2, 3)}


class DPO(LightningModule):
    """Direct preference optimization: the policy's log-ratio of chosen over rejected against the frozen reference's."""

    def __init__(self, path: str, beta: float = 0.1) -> None:
        super().__init__()
        self.path, self.beta = path, beta

    def configure_model(self) -> None:
        if hasattr(self, "policy"):
            return
        self.policy = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        self.reference = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        self.reference.requires_grad_(False).eval()

    @staticmethod
    def logps(model: Any, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits[:, :-1]  # (B, T-1, V)
        return logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1).sum(-1)  # (B,)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        chosen, rejected = batch
        with torch.no_grad():
            ref = self.logps(self.reference, chosen) - self.logps(self.reference, rejected)
        ours = self.logps(self.policy, chosen) - self.logps(self.policy, rejected)
        return -F.logsigmoid(self.beta * (ours - ref)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.policy.parameters(), lr=1e-3)


def held_bytes(module: torch.nn.Module, strategy: Any) -> dict[str, int]:
    """Bytes of the distinct storages this rank's model and optimizers hold, by what holds them: the module's
    parameters (whole where unsharded: the frozen reference at zero1/2), the parameter shards of the engine's units
    (zero3 releases the module's own), and every tensor the optimizers' inner (per-shard) optimizers hold, their
    parameters (the fp32 masters) and their state. Each storage counted once, under the first that names it. Not
    counted: zero3's gathered blocks (between steps, those the gather schedule keeps), which are working set."""
    seen: set[int] = set()
    out = {"module_parameters": 0, "shards": 0, "optimizers": 0}

    def count(where: str, tensors: Any) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[where] += storage.nbytes()

    if strategy.engine.gatherer is not None:  # zero3 blocks kept gathered between steps by schedule="auto": working
        seen.update(u.flat_param.untyped_storage().data_ptr() for u in strategy.engine.units  # set, logged as buffers
                    if u.flat_param.untyped_storage().nbytes())
    count("module_parameters", [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None)])
    count("shards", [u.compute_shard() for u in strategy.engine.units])
    for zopt in strategy.optimizers:
        for inner in {id(o): o for o in zopt._shared.inner.values()}.values():
            count("optimizers", [p for g in inner.param_groups for p in g["params"]])
            count("optimizers", [v for state in inner.state.values() for v in state.values()
                                 if isinstance(v, torch.Tensor)])
    return out


class Capture(Logger):
    """Rank 0's logged metrics in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        if any(k.startswith("memory/") for k in metrics):
            self.metrics.append(dict(metrics))


class Held(Callback):
    """After the monitor's log of each step: what this rank holds (``held_bytes``)."""

    def __init__(self) -> None:
        self.held: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.held.append(held_bytes(pl_module, trainer.strategy))


def fit(model_dir: Path, out: Path, run: str) -> None:
    stage, precision = RUNS[run]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    chosen, rejected = torch.randint(0, 128, (8, 12), generator=gen), torch.randint(0, 128, (8, 12), generator=gen)
    capture, held = Capture(), Held()
    trainer = Trainer(accelerator="cpu", devices=2, strategy=f"zero{stage}", precision=precision, max_steps=STEPS,
                      log_every_n_steps=1, logger=capture, callbacks=[lzero.MemoryMonitor(), held],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    trainer.fit(DPO(str(model_dir)), DataLoader(TensorDataset(chosen, rejected), batch_size=2))
    rank = trainer.global_rank
    logged = {r: {"logged": [m[f"memory/model_states_bytes/rank{r}"] for m in capture.metrics],
                  "expected": [m[f"memory/model_states_expected_bytes/rank{r}"] for m in capture.metrics]}
              for r in range(trainer.world_size)} if trainer.is_global_zero else {}
    (out / f"{run}-rank{rank}.json").write_text(json.dumps({"held": held.held}))
    trainer.strategy.barrier()
    for r, values in logged.items():  # rank 0 adds every rank's logged values to that rank's file
        path = out / f"{run}-rank{r}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    trainer.strategy.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    for run in RUNS:
        fit(model_dir, out_dir, run)
    destroy_process_group()
