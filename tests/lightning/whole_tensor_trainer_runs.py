"""Matrix optimizers under the Trainer: ``torch.optim.Adafactor`` with automatic optimization (accumulation 2,
``gradient_clip_val``), or ``torch.optim.Muon`` on the hidden matrices with ``AdamW`` on the rest through manual
optimization (two optimizers: Lightning's automatic optimization takes one), ``self.clip_gradients`` per optimizer;
6 steps (two epochs of 3) of a global batch of 8 sequences on the demo GPT or a Hugging Face Llama. Rank 0 writes the
losses, the final parameters and each optimizer's ``state_dict()`` (gathered by every rank at the end of fit).
``--save-at 3``: stop after epoch 0 (3 steps) and ``trainer.save_checkpoint`` (a sharded directory under lzero); ``--resume``:
``fit(ckpt_path=...)`` from one, to step 6. ``--configure-model``: the model built in ``configure_model``.

    python whole_tensor_trainer_runs.py STRATEGY MODEL OPTIM OUT [--devices N] [--clip MAX_NORM] [--save-at 3]
                                        [--resume CKPT]
"""


import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lzero
from whole_tensor_runs_common import VOCAB, build, optimizers, run_arguments

parser = run_arguments()
parser.add_argument("--configure-model", action="store_true", help="build the model in configure_model (zero3: on the"
                    " meta device, replayed shard by shard) instead of __init__")
args = parser.parse_args()

STEPS, GLOBAL = 6, 8
ACC = 2 if args.optim == "adafactor" else 1  # manual optimization: one backward per step


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None if args.configure_model else build(args.model)
        self.automatic_optimization = args.optim == "adafactor"
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(args.model)

    def configure_optimizers(self):
        opts = optimizers(self.model, args.optim)
        return opts if len(opts) > 1 else opts[0]

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        out = self.model(tokens[:, :-1])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        self.manual_backward(loss)
        for o in opts:
            self.clip_gradients(o, gradient_clip_val=args.clip, gradient_clip_algorithm="norm")
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


world = args.devices
tokens = torch.randint(0, VOCAB, (STEPS // 2 * GLOBAL, 17), generator=torch.Generator().manual_seed(1))  # an epoch
loader = DataLoader(TensorDataset(tokens), batch_size=GLOBAL // ACC // world)  # rank r takes rows r::world
job = Job()
extra = {"accumulate_grad_batches": ACC, "gradient_clip_val": args.clip} if job.automatic_optimization else {}
per_batch = 1 if job.automatic_optimization else 2  # manual optimization: global_step counts every optimizer's step
# whole epochs (a stop by max_steps at an epoch's last batch resumes into that epoch again, as under DDP)
trainer = L.Trainer(accelerator="cpu", devices=world, strategy=args.strategy, max_epochs=1 if args.save_at else 2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    **extra)
trainer.fit(job, loader, ckpt_path=args.resume)
if args.save_at:
    trainer.save_checkpoint(f"{args.out}.ckpt")
states = [o.state_dict() for o in trainer.optimizers]  # every rank: gathered under lzero
lzero.unshard(job)
if trainer.is_global_zero:
    torch.save({"losses": job.losses, "final": {k: v.detach().clone() for k, v in job.model.state_dict().items()},
                "optim": states, "global_step": trainer.global_step // per_batch}, args.out)
