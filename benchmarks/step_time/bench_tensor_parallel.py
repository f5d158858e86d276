"""Step time of tensor parallel under ZeRO against Lightning's ``ModelParallelStrategy`` (FSDP2 + TP), tp2 x dp2 on 4
CPU processes, one thread each, on the same model and batches in one run.

    torchrun --nproc_per_node 4 -m benchmarks.step_time.bench_tensor_parallel [--rounds 3] [--steps 8] [--out none]

The model: a Hugging Face Llama (``--hidden``, ``--layers``; 8 heads, 4 KV heads), fp32, parallelized by the user's
plan (q/k/v and gate/up column-wise, o and down row-wise) over ``device_mesh["tensor_parallel"]``; lzero shards it
over the data-parallel ranks (zero2; zero3 with its default ``schedule="auto"``, which keeps blocks gathered as far as
memory allows, and with ``schedule="min_memory"``, every block gathered for each use as FSDP2 reshards by default),
``ModelParallelStrategy`` with ``fully_shard`` per decoder layer and on the whole model. AdamW, no clipping (torch's ``clip_grad_norm_`` refuses this model under FSDP2 + TP: its embeddings
and norms sit on the data mesh alone). Each round fits every strategy once; rank 0's wall time per step after
``--warmup`` steps, median over the steps of every round. Lightning's launcher is not used: torchrun starts the ranks
(every Trainer has ``devices=4``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import out_path, run_header, write_report

PLAN = {**{f"model.layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")},
        "model.layers.*.self_attn.o_proj": "rowwise",
        **{f"model.layers.*.mlp.{n}": "colwise" for n in ("gate_proj", "up_proj")},
        "model.layers.*.mlp.down_proj": "rowwise"}


def llama(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                        vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False))


class StepTimer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.start = warmup, [], 0.0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.start)


class Module(LightningModule):
    def __init__(self, args: argparse.Namespace, fsdp: bool) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.model = llama(args.hidden, args.layers, args.vocab)

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(self.model, self.device_mesh["tensor_parallel"],
                           {pattern: styles[style]() for pattern, style in PLAN.items()})
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=False)


def strategy(name: str) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lzero import ZeroStrategy

    if name == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    if name == "zero3_min_memory":  # every block gathered for its use and released, as FSDP2 reshards by default
        return ZeroStrategy(stage=3, tensor_parallel_size=2, schedule="min_memory")
    return ZeroStrategy(stage=int(name[-1]), tensor_parallel_size=2)


def fit(name: str, args: argparse.Namespace) -> list[float]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.steps * args.micro * 2, args.seq + 1), generator=g)
    timer = StepTimer(args.warmup)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy(name), max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[timer])
    trainer.fit(Module(args, fsdp=name == "model_parallel"),
                DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.micro))
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", default="model_parallel,zero3,zero3_min_memory,zero2")
    parser.add_argument("--out", default=None, help="a result name in step_time, a path, or none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.strategies.split(",")
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            times[name].extend(fit(name, args))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in llama(args.hidden, args.layers, args.vocab).parameters())
        base = statistics.median(times["model_parallel"]) if "model_parallel" in times else None
        lines = ["# Tensor parallel under ZeRO against ModelParallelStrategy (FSDP2 + TP), tp2 x dp2", "",
                 run_header("transformers"), "",
                 f"Llama {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab"
                 f" {args.vocab}), fp32, micro-batch {args.micro} x {args.seq} tokens per data rank, 4 CPU processes"
                 f" with 1 thread each on this machine, {args.rounds} rounds of {args.steps} steps ({args.warmup}"
                 " warm-up steps not timed per fit).", "",
                 "| strategy | median step (s) | steps timed | against ModelParallelStrategy |", "|---|---|---|---|"]
        for name in names:
            median = statistics.median(times[name])
            ratio = f"{median / base:.3f}x" if base else "-"
            label = ("ModelParallelStrategy (FSDP2 + TP)" if name == "model_parallel"
                     else "lzero zero3, tp2, `schedule='min_memory'`" if name == "zero3_min_memory"
                     else f"lzero {name}, tp2" + (" (`schedule='auto'`: blocks kept gathered as memory allows)"
                                                  if name == "zero3" else ""))
            lines.append(f"| {label} | {median:.3f} | {len(times[name])} | {ratio} |")
        path = out_path(args.out, "step_time", "tensor_parallel")
        print("\n".join(lines), flush=True)
        if path is not None:
            write_report(path, "\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
