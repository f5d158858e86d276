"""Matrix optimizers under ZeRO, as a Fabric loop writes them: ``torch.optim.Muon`` on the 2-D weights with ``AdamW`` on
the rest (two optimizers), or ``torch.optim.Adafactor`` alone; the demo GPT or a Hugging Face Llama (built from a
tiny config); 6 steps of one global batch of 8 sequences, accumulation 2, clipping by norm per optimizer; a checkpoint
after ``--save-at`` (its optimizers' ``state_dict()`` recorded), and after ``--resume`` what was loaded; the final
parameters and each optimizer's ``state_dict()`` (torch's format, gathered) written by rank 0. The global batch is the
same at every world size (rank r takes rows r::world of each micro-batch). Under lzero the memory monitor's measure
after the last step is recorded too. Models and optimizers:
whole_tensor_runs_common.py.

STRATEGY: a name Fabric takes, ``zero<N>_full`` (one DDP-format checkpoint file) or ``zero<N>_hybrid`` (shard groups
of 2 ranks).

    python whole_tensor_runs.py STRATEGY MODEL OPTIM OUT [--devices N] [--save-at S] [--resume CKPT]
                                [--clip MAX_NORM] [--acc K] [--unfused] [--reduce-each-micro]
"""

import copy

import lightning as L
import torch
import torch.nn.functional as F

from whole_tensor_runs_common import VOCAB, build, optimizers, run_arguments

parser = run_arguments()
parser.add_argument("--acc", type=int, default=2)
parser.add_argument("--unfused", action="store_true", help="AdamW(fused=False): offload's host step runs DDP's kernel")
parser.add_argument("--reduce-each-micro", action="store_true", help="no no_backward_sync: every backward reduces")
args = parser.parse_args()

STEPS, ACC, GLOBAL = 6, args.acc, 8

strategy = args.strategy
if strategy.endswith("_full"):  # one DDP-format checkpoint file, gathered, instead of a sharded directory
    from lzero.lightning.fabric_strategy import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=int(strategy[4]), checkpoint_format="full")
elif strategy.endswith("_hybrid"):  # shard groups of 2 ranks, replicated across the groups
    from lzero.lightning.fabric_strategy import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=int(strategy[4]), shard_group_size=2)
fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
fabric.launch()
model = fabric.setup_module(build(args.model))
opts = [fabric.setup_optimizers(o) for o in optimizers(model, args.optim, args.unfused)]
state = {"model": model, **{f"optimizer{k}": o for k, o in enumerate(opts)}, "step": 0}
record = {}
if args.resume:
    fabric.load(args.resume, state)
    record["loaded"] = copy.deepcopy([o.state_dict() for o in opts])  # what was taken (lzero: gathered, a collective)
world, rank = fabric.world_size, fabric.global_rank
data = torch.randint(0, VOCAB, (STEPS, ACC, GLOBAL // ACC, 17), generator=torch.Generator().manual_seed(1))
losses = []
while state["step"] < STEPS:
    step = state["step"]
    for micro in range(ACC):
        batch = data[step, micro][rank::world]
        with fabric.no_backward_sync(model, enabled=micro < ACC - 1 and not args.reduce_each_micro):
            out = model(batch[:, :-1])
            logits = out if isinstance(out, torch.Tensor) else out.logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            fabric.backward(loss / ACC)
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    for o in opts if args.clip else ():
        fabric.clip_gradients(model, o, max_norm=args.clip)
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    state["step"] += 1
    if state["step"] == args.save_at:
        fabric.save(f"{args.out}.ckpt", state)
        record["saved"] = copy.deepcopy([o.state_dict() for o in opts])  # DDP's are the live tensors: copied
if hasattr(fabric.strategy, "engine_of"):  # lzero: the memory monitor's measure of every rank (a collective)
    import lzero

    engine, zopts = fabric.strategy.engine_of(opts[0])
    record["memory"] = {}
    lzero.MemoryMonitor().log_now(engine, zopts, fabric.device, STEPS, lambda m, _: record["memory"].update(m))
final = {k: v.detach().clone() for k, v in model.state_dict().items()}
optim_states = [o.state_dict() for o in opts]  # every rank: a collective under lzero
if rank == 0:
    torch.save({"losses": losses, "final": final, "optim": optim_states, **record}, args.out)
