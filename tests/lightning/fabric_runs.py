"""One Fabric training script, as people write them, run under a strategy name: a model built with
``init_module(empty_init=True)`` and initialized after it (litgpt's pattern), set up alone, an optimizer built from
the set-up model, an LR scheduler, gradient accumulation under ``no_backward_sync``, clipping by norm, a checkpoint
after step 2, ``model.state_dict()`` on every rank; then a second model set up together with two optimizers, a save
with ``filter=``, ``load_raw`` into a third model built on the meta device, Fabric's collectives, the model run on
rank 0 alone inside ``strategy.generation()``; and the calls lzero refuses. Rank 0 writes a result file.

    python fabric_runs.py STRATEGY OUT [--resume CKPT] [--devices N] [--save-at STEP] [--train-only]
"""

import argparse
import contextlib

import lightning as L
import torch
import torch.nn.functional as F

from lzero.demo.model import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("out")
parser.add_argument("--resume")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--precision", default="32-true")
parser.add_argument("--save-at", type=int, default=2, help="the step after which to save (once past the resumed one)")
parser.add_argument("--train-only", action="store_true", help="stop after the first model's training and state_dict")
args = parser.parse_args()

strategy = args.strategy
if strategy.endswith("_full"):  # a full checkpoint file instead of a sharded directory
    from lzero.lightning.fabric_strategy import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=int(strategy[4]), checkpoint_format="full")
elif strategy.endswith("_hybrid"):  # shard groups of 2 ranks, replicated across the groups
    from lzero.lightning.fabric_strategy import ZeroFabricStrategy

    offload = {"offload_optimizer": "cpu", "offload_param": "cpu"} if "offload" in strategy else {}
    strategy = ZeroFabricStrategy(stage=int(strategy[4]), shard_group_size=2, **offload)
elif strategy.endswith("_hpz"):  # hpZ: primary shards over all 4 ranks, secondary copies within pairs
    from lzero.lightning.fabric_strategy import ZeroFabricStrategy

    # min_memory: every backward gathers its blocks, from the pair's copies ("auto" keeps this small model gathered)
    strategy = ZeroFabricStrategy(stage=3, hpz_partition_size=2, schedule="min_memory")
elif strategy.endswith("_fp16"):  # lzero's own fp16 (Fabric would turn 16-mixed into bf16-mixed on the CPU)
    from lzero.lightning.fabric_strategy import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=int(strategy[4]), precision="16-mixed")
fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision)
fabric.launch()
fabric.seed_everything(0)
config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
with fabric.init_module(empty_init=True):
    model = GPT(config)
model.apply(GPT._init_weights)  # after the context, on the meta model under zero3 (litgpt's pretrain does this)
result = {}
stale = torch.optim.SGD(GPT(config).parameters(), lr=0.1)  # another model's optimizer, built before its setup
model = fabric.setup_module(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
initial = {k: v.clone() for k, v in model.state_dict().items()}  # every rank
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
if args.resume:
    fabric.load(args.resume, state)
resumed_at = state["step"]
data = torch.randint(0, 64, (16, 2, 17), generator=torch.Generator().manual_seed(1))
losses, norms = [], []
world = fabric.world_size
while state["step"] < 4:
    step = state["step"]
    for micro in range(2):
        batch = torch.cat([data[step * 4 + micro * 2 + r] for r in range(2)])[fabric.global_rank::world]
        with fabric.no_backward_sync(model, enabled=micro == 0):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
            fabric.backward(loss / 2)
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    state["step"] += 1
    if state["step"] == args.save_at and state["step"] > resumed_at:
        fabric.save(f"{args.out}.ckpt", state)
final = model.state_dict()
if args.train_only:
    if fabric.global_rank == 0:
        torch.save({"losses": losses, "norms": norms, "final": final, "lr": scheduler.get_last_lr()}, args.out)
    raise SystemExit(0)
memory = {}  # lzero: the memory monitor's model-state bytes of rank 0 beside its formula's (a collective)
if hasattr(fabric.strategy, "engine_of"):
    import lzero

    engine, zopts = fabric.strategy.engine_of(optimizer)
    lzero.MemoryMonitor().log_now(engine, zopts, fabric.device, 4, lambda metrics, step: memory.update(metrics))
    if engine.gatherer is not None and engine.gatherer.secondary is not None:  # hpZ: backward's gathers in the pair
        memory["hpz_gathered_bytes"] = engine.gatherer.secondary.gathered_bytes

# fabric.setup(model, opt_a, opt_b): set up together, two optimizers over disjoint parameters
second = GPT(config)
named = list(second.named_parameters())
opt_a = torch.optim.AdamW([p for n, p in named if n.startswith("blocks.")], lr=1e-2)
opt_b = torch.optim.SGD([p for n, p in named if not n.startswith("blocks.")], lr=0.1, momentum=0.9)
second, opt_a, opt_b = fabric.setup(second, opt_a, opt_b)
joint = []
for step in range(2):
    batch = torch.cat([data[step * 4 + r] for r in range(2)])[fabric.global_rank::world]
    loss = F.cross_entropy(second(batch[:, :-1]).reshape(-1, 64), batch[:, 1:].reshape(-1))
    fabric.backward(loss)
    fabric.clip_gradients(second, opt_b, clip_val=0.01)  # by value, one optimizer's parameters
    opt_a.step()
    opt_b.step()
    opt_a.zero_grad()
    opt_b.zero_grad()
    joint.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
# a filtered save, and load_raw into a third model built on the meta device
fabric.save(f"{args.out}.filtered", {"model": second, "note": 7}, filter={"model": lambda k, v: k.startswith("blocks.0.")})
if fabric.global_rank == 0:
    torch.save(initial, f"{args.out}.init.pt")
fabric.barrier()
with fabric.init_module(empty_init=True):
    third = GPT(config)
third = fabric.setup_module(third)
fabric.setup_optimizers(torch.optim.SGD(third.parameters(), lr=0.1))
fabric.load_raw(f"{args.out}.init.pt", third)
raw = {k: v.clone() for k, v in third.state_dict().items()}
collectives = {"all_gather": fabric.all_gather(torch.tensor([fabric.global_rank + 1.0])).flatten().tolist(),
               "broadcast": fabric.broadcast({"from": fabric.global_rank}), "device": str(fabric.to_device(torch.ones(1)).device)}
# the model run on rank 0 alone (a sample generated there), inside generation() entered on every rank under lzero
generation = getattr(fabric.strategy, "generation", None)
with generation(model) if generation is not None else contextlib.nullcontext():
    if fabric.global_rank == 0:
        with torch.no_grad():
            sample = model(data[0][:1, :-1]).argmax(-1)
refused = {}
if world > 1:
    try:
        fabric.setup_optimizers(stale)
    except Exception as err:  # noqa: BLE001 - the message is the result
        refused["stale_optimizer"] = f"{type(err).__name__}: {err}"
if fabric.global_rank == 0:
    from pathlib import Path

    filtered = Path(f"{args.out}.filtered")
    if filtered.is_dir():
        from lzero.checkpoint.reader import ShardedCheckpoint

        filtered_keys = sorted(ShardedCheckpoint(filtered).full_state_dict())
    else:
        filtered_keys = sorted(torch.load(filtered, weights_only=True)["model"])
    torch.save({"losses": losses, "norms": norms, "initial": initial, "final": final, "refused": refused,
                "lr": scheduler.get_last_lr(), "joint": joint, "filtered_keys": filtered_keys, "raw": raw,
                "collectives": collectives, "sample": sample, "memory": memory}, args.out)
