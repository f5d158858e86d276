"""Pipeline parallel under ZeRO (``pipeline_parallel_size=2``) against one process on the same global batches.

    python tests/lightning/pipeline_runs.py OUT_DIR LLAMA_DIR [NAME ...]   # with 4 ranks: pp2 x dp2

Two models built in ``configure_model``: a tiny Hugging Face Llama read with ``from_pretrained`` from LLAMA_DIR (4
layers; its step returns the model's own ``.loss``) and lzero's demo GPT (4 blocks, its head tied to the embedding;
its step computes the cross-entropy of the logits), each step written as for DDP. Each trained 4 clipped AdamW
steps with every schedule (GPipe, 1F1B, interleaved 1F1B over 4 virtual stages), 4 micro-batches of 1 per data rank,
at zero1, zero2, zero3 and zero2_offload. Rank 0 writes ``OUT_DIR/<run>.pt``: each step's loss (the global
batch's, as the strategy returns it) and pre-clip gradient norm, the logged ``train_loss``, the final parameters
gathered from every stage (a tied weight from both), the validation loss; ``reference_<model>.pt`` is one process on
the same global batches. NAME: only the runs of that name. tests/lightning/test_pipeline.py compares them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy

VOCAB, SEQ, MICRO, MICROBATCHES, STEPS, CLIP, LR, EPS = 32, 8, 1, 4, 4, 0.5, 0.02, 1e-4
DATA = 2  # data ranks at world 4


def save_llama(folder: Path) -> None:
    """A tiny Llama (4 layers, untied head), written with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)


GPT = "gpt"


def make_model(llama: Any) -> nn.Module:
    if llama == GPT:
        from lzero.demo.model import GPT as DemoGPT, GPTConfig

        torch.manual_seed(5)
        return DemoGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=16))
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The step as written for DDP: the Llama's own loss, or the GPT's logits' cross-entropy."""
    if hasattr(model, "blocks"):
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    return model(input_ids=tokens, labels=tokens).loss


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (64, SEQ + 1), generator=g))


def optimizer_of(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=EPS, fused=False, foreach=False)


class Module(LightningModule):
    def __init__(self, llama: Any, eager: bool = False) -> None:
        super().__init__()
        self.llama = llama
        self.model: Any = make_model(llama) if eager else None  # eager: built in __init__, not configure_model

    def configure_model(self) -> None:
        if self.model is None:
            self.model = make_model(self.llama)

    def forward(self, tokens: torch.Tensor) -> Any:
        return self.model(tokens)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        loss = loss_of(self.model, batch[0])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("val_loss", loss_of(self.model, batch[0]), sync_dist=True)

    def test_step(self, batch: Any, _: int) -> None:
        self.log("test_loss", loss_of(self.model, batch[0]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_of(self.parameters())


class Record(Callback):
    """Each step's global loss (the strategy's returned loss, averaged over the data ranks), logged loss and norm, and
    the loss scale after it (fp16)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.norms: list[float] = []
        self.scales: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer, module: LightningModule, optimizer: Any) -> None:
        self.norms.append(trainer.strategy.grad_norm().item())

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.scales.append(trainer.strategy.precision_plugin.loss_scale)

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs: Any, batch: Any, i: int) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())
        self.logged.append(trainer.callback_metrics["train_loss"].item())


CONFIGURATIONS = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MEMORY_LOGGED = ("llama_zero3_1f1b", "gpt_zero1_interleaved_1f1b")


def whole_parameters(trainer: Trainer, module: Module) -> dict[str, list[torch.Tensor]]:
    """Every stage's parameters, gathered whole, by name (a tied weight under each stage's name for it)."""
    with trainer.strategy.gathered_parameters(module.model):
        mine = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, list[torch.Tensor]] = {}
    for rank_params in everyone[:: DATA]:  # data rank 0 of each stage
        for name, value in rank_params.items():
            merged.setdefault(name, []).append(value)
    return merged


EAGER = ("gpt_zero2_1f1b", "llama_zero3_1f1b")
"""Runs done a second time with the model built in ``__init__`` (written as ``<name>_eager``)."""


def run(out: Path, name: str, options: dict, schedule: str, llama: Any, eager: bool = False) -> None:
    module, record = Module(llama, eager), Record()
    strategy = ZeroStrategy(**options, pipeline_parallel_size=2, pipeline_schedule=schedule,
                            pipeline_microbatches=MICROBATCHES)
    logged = name in MEMORY_LOGGED  # the memory monitor's per-stage logs, in a CSV file
    fit = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS,
                  logger=CSVLogger(out, name=name, version=0) if logged else False, log_every_n_steps=1,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  gradient_clip_val=CLIP, callbacks=[record])
    fit.fit(module, DataLoader(dataset(), batch_size=MICRO * MICROBATCHES))
    params = whole_parameters(fit, module)
    held_out = DataLoader(Subset(dataset(), range(16)), batch_size=MICRO * MICROBATCHES)
    val = fit.validate(module, held_out, verbose=False)[0]["val_loss"]
    test = fit.test(module, held_out, verbose=False)[0]["test_loss"]
    if fit.is_global_zero:
        torch.save({"losses": record.losses, "logged": record.logged, "norms": record.norms, "params": params,
                    "val_loss": val, "test_loss": test, "sampler": fit.strategy.distributed_sampler_kwargs},
                   out / f"{name}{'_eager' if eager else ''}.pt")


FP16_SCALE = {"initial_scale_power": 20, "hysteresis": 1}
"""fp16's loss scaling in the skip runs: 2^20 overflows the first steps' gradients, so steps are skipped and the
scale halves until it fits."""


def mixed_run(out: Path, precision: str, pipeline: bool) -> None:
    """The demo GPT at zero2 in ``precision`` (16-mixed, bf16-mixed) for 6 steps, at pp2 x dp2 (1F1B) or pp1 x dp4
    (the same global batches): each step's loss and loss scale, and every rank's skipped steps."""
    module, record = Module(GPT), Record()
    options = {"pipeline_parallel_size": 2, "pipeline_microbatches": MICROBATCHES} if pipeline else {}
    if precision == "16-mixed":
        options["loss_scaling"] = FP16_SCALE
    strategy = ZeroStrategy(stage=2, precision=precision, **options)
    fit = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=6, logger=False, callbacks=[record],
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    fit.fit(module, DataLoader(dataset(), batch_size=MICRO * MICROBATCHES * DATA // (2 if pipeline else 4)))
    skipped: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(skipped, fit.strategy.precision_plugin.skipped_steps)
    if fit.is_global_zero:
        torch.save({"losses": record.losses, "scales": record.scales, "skipped": skipped},
                   out / f"{precision}_{'pp2dp2' if pipeline else 'pp1dp4'}.pt")


class Manual(Module):
    """The step under manual optimization."""

    def __init__(self, llama: Any) -> None:
        super().__init__(llama)
        self.automatic_optimization = False


def refusals(out: Path) -> None:
    """What pipelines do not run yet, each tried after a fit: generation, predict, a one-file checkpoint callback,
    manual optimization. Rank 0 writes ``refused_<what>.pt`` with the message (None: not refused)."""
    def attempt(what: str, call: Any) -> None:
        try:
            call()
            message = None
        except Exception as err:  # noqa: BLE001 - the message is what the test reads
            message = f"{type(err).__name__}: {err}"
        if dist.get_rank() == 0:
            torch.save({"message": message}, out / f"refused_{what}.pt")

    def trainer(**kwargs: Any) -> Trainer:
        strategy = ZeroStrategy(stage=2, pipeline_parallel_size=2, **kwargs)
        return Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                       enable_checkpointing="checkpoint_format" in kwargs)

    module, data = Module(GPT), DataLoader(dataset(), batch_size=MICROBATCHES)
    fit = trainer()
    fit.fit(module, data)
    attempt("generation", lambda: fit.strategy.generation().__enter__())
    attempt("predict", lambda: fit.predict(module, data))
    attempt("full_checkpoint", lambda: trainer(checkpoint_format="full").fit(Module(GPT), data))
    attempt("manual", lambda: trainer().fit(Manual(GPT), data))


def reference(out: Path, llama: Any, tag: str, accumulated: bool = False, clip: Optional[float] = CLIP) -> None:
    """One process, the global batch of each step: what each data rank's distributed sampler hands it (Lightning's, for
    a training DataLoader: shuffled with seed 0), MICRO x MICROBATCHES samples per data rank and step. ``accumulated``:
    the floor's reference, the same batch as DATA x MICROBATCHES micro-batches of MICRO, their mean losses' gradients
    accumulated (plain torch), as a pipeline splits it; ``rank0``: each step's loss over data rank 0's samples (what
    rank 0 logs). ``clip``: the gradient clipping (None: none, the norm still recorded)."""
    from torch.utils.data import DistributedSampler

    model = make_model(llama)
    optimizer = optimizer_of(model.parameters())
    (tokens,) = dataset().tensors
    per_rank = MICRO * MICROBATCHES
    orders = [list(DistributedSampler(dataset(), num_replicas=DATA, rank=d, shuffle=True, seed=0)) for d in range(DATA)]
    losses, norms, rank0 = [], [], []
    for step in range(STEPS):
        rows = [order[step * per_rank + i] for order in orders for i in range(per_rank)]
        if accumulated:
            parts = [loss_of(model, tokens[rows[i:i + MICRO]]) for i in range(0, len(rows), MICRO)]
            for part in parts:
                (part / len(parts)).backward()
            loss = torch.stack(parts).mean().detach()
        else:
            loss = loss_of(model, tokens[rows])
            loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            rank0.append(loss_of(model, tokens[rows[:per_rank]]).item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf).item())
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        val = torch.stack([loss_of(model, tokens[i * per_rank:(i + 1) * per_rank]) for i in range(16 // per_rank)])
    torch.save({"losses": losses, "norms": norms, "val_loss": val.mean().item(), "rank0": rank0,
                "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}},
               out / f"{'accumulated' if accumulated else 'reference'}_{tag}.pt")


def main() -> None:
    out, llama = Path(sys.argv[1]), Path(sys.argv[2])
    only = set(sys.argv[3:])
    if not only or "refusals" in only:
        refusals(out)
    for precision in ("16-mixed", "bf16-mixed"):
        if not only or precision in only:
            mixed_run(out, precision, pipeline=True)
            mixed_run(out, precision, pipeline=False)
    for tag, model in (("llama", llama), ("gpt", GPT)):
        ran = False
        for config, options in CONFIGURATIONS.items():
            for schedule in SCHEDULES:
                name = f"{tag}_{config}_{schedule}"
                if not only or name in only or tag in only:
                    run(out, name, options, schedule, model)
                    if name in EAGER:
                        run(out, name, options, schedule, model, eager=True)
                    ran = True
        if ran and dist.get_rank() == 0:
            reference(out, model, tag)
            reference(out, model, tag, accumulated=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
