"""Collectives called on rank 0 only under Fabric zero3: ``fabric.save``, ``model.state_dict()`` and a forward must
fail within seconds (the timeouts set to 3 s here) with an error saying what to do, never hang. Rank 0 writes what each raised and how long it took.

    python fabric_misuse.py OUT save|state_dict|forward

One call per run: after a timed-out barrier the gloo group is not usable again.
"""

import sys
import time

import lightning as L
import torch

from lzero.demo.model import GPT, GPTConfig
from lzero.lightning.fabric_strategy import ZeroFabricStrategy

fabric = L.Fabric(accelerator="cpu", devices=2,
                  strategy=ZeroFabricStrategy(stage=3, exception_checkpoint_timeout_s=3, unit_order_timeout_s=3))
fabric.launch()
model = fabric.setup_module(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)))
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
fabric.backward(model(torch.zeros(1, 4, dtype=torch.long)).sum())  # a step on every rank: the engine exists
optimizer.step()
fabric.barrier()
if fabric.global_rank == 0:
    lines = []
    calls = {"save": lambda: fabric.save(sys.argv[1] + ".ckpt", {"model": model}), "state_dict": lambda: model.state_dict(),
             "forward": lambda: model(torch.zeros(1, 4, dtype=torch.long))}
    for what, call in [(sys.argv[2], calls[sys.argv[2]])]:
        start = time.perf_counter()
        try:
            call()
            lines.append(f"{what}\tno error")
        except Exception as err:  # noqa: BLE001 - the message is the result
            lines.append(f"{what}\t{time.perf_counter() - start:.1f}\t{type(err).__name__}: {err}")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines) + "\n")
else:
    time.sleep(4)
