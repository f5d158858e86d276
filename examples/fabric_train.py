"""A Fabric training loop under lzero, written as Fabric scripts are (and as litgpt's are): the model built on the
meta device, set up alone, the optimizer built from the set-up model, weights loaded after it, gradient accumulation,
clipping, a checkpoint every few steps and a resume from it. Only the strategy name is lzero's.

    python examples/fabric_train.py --strategy zero3 --out runs/fabric            # train 20 steps, save at 10 and 20
    python examples/fabric_train.py --strategy zero2 --out runs/fabric --resume runs/fabric/step-10.ckpt
    lzero consolidate runs/fabric/step-20.ckpt runs/fabric/model.pt               # one plain state_dict file
    python examples/fabric_train.py --out runs/fabric-init --init-from runs/fabric/model.pt   # start from it

From the repository root, with ``source .venv/bin/activate`` done (or ``.venv/bin/python``, ``.venv/bin/lzero``);
Fabric launches the ``--devices`` processes itself.

``LT_STRATEGY=zero3_offload`` overrides ``--strategy``, as it overrides any Fabric script's. TensorBoard logs (losses,
and lzero's memory logs) go to ``OUT/logs``.
"""

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

import lzero
from lzero.demo.data import RandomWindows, load_corpus
from lzero.demo.model import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default="runs/fabric")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--log-memory-every", type=int, default=5, help="optimizer steps between memory logs")
    parser.add_argument("--resume", help="a checkpoint written by this script (any strategy, world size)")
    parser.add_argument("--init-from", help="a plain state_dict file (torch.save(model.state_dict(), path))")
    args = parser.parse_args()
    out = Path(args.out)

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, precision=args.precision,
                      loggers=TensorBoardLogger(out / "logs"), callbacks=[lzero.MemoryMonitor(every_n_steps=args.log_memory_every)])
    fabric.launch()
    fabric.seed_everything(1234)

    config = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    with fabric.init_module(empty_init=True):  # zero3: the meta device, materialized shard by shard at first use
        model = GPT(config)
    if not (args.resume or args.init_from):
        model.apply(GPT._init_weights)  # drawn after the empty build, as litgpt's pretrain does: replayed under zero3
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # sharded or full; every rank reads only its pieces
    elif args.init_from:
        fabric.load_raw(args.init_from, model)

    loader = fabric.setup_dataloaders(DataLoader(RandomWindows(load_corpus(), config.block_size, 4096), batch_size=8))
    batches = iter(loader)
    for _ in range(state["step"] * args.accumulate):  # a resumed run continues where the data left off
        next(batches)
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state["step"] += 1
        fabric.log_dict({"loss": loss.item(), "grad_norm": norm.item()}, step=state["step"])
        fabric.print(f"step {state['step']}: loss {loss.item():.4f}")
        if state["step"] % args.save_every == 0:
            fabric.save(out / f"step-{state['step']}.ckpt", state)  # a directory, each rank writing its pieces


if __name__ == "__main__":
    main()
