"""Write the DeepSpeed ZeRO checkpoints that lzero's DeepSpeed-resume tests read (issue 49).

DeepSpeed is never a dependency of lzero. This script runs only in a separate environment that has DeepSpeed and a
CPU build of torch; it imports neither lzero's package nor lightning (the demo GPT is loaded from its file):

    DS_ACCELERATOR=cpu /work/peers/deepspeed/bin/python tests/deepspeed_fixtures/make_fixtures.py  # from the root

It rewrites every case folder under ``tests/deepspeed_fixtures/`` (``--out`` elsewhere, ``--cases`` a subset), then
prints each folder's bytes and an inventory of every ``.pt`` file: its top-level keys and every class its pickle
names. ``README.md`` beside this script describes the files.

Setup, the same in every case (two processes, ``torch.multiprocessing.spawn``, gloo, one thread each):

* Model: ``GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=3, n_embd=15, dropout=0.0, bias=True))``
  from ``lzero/demo/model.py``, built after ``torch.manual_seed(0)`` on every rank; ``lm_head.weight`` is
  ``wte.weight`` (tied). The odd sizes (7,035 elements, LayerNorms of 15, ``wte`` of 975) make DeepSpeed pad: the
  last ZeRO-1/2 partition by one element, each ZeRO-3 parameter of odd size by one. In the Lightning-shaped case
  the GPT sits under a module attribute ``model`` (as in ``lzero.demo.module.DemoGPT``): names start ``model.``.
* Batch of step ``i`` (1, 2, ... in training order) on rank ``r``:
  ``tokens = torch.randint(0, 65, (2, 9), generator=torch.Generator().manual_seed(1000 * i + r))``,
  inputs ``tokens[:, :-1]`` and targets ``tokens[:, 1:]`` (micro batch 2, sequence 8).
* Loss: ``F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())`` (mean over the rank's 16 tokens).
  ``expected.json`` records each rank's loss and their mean (the all-reduced average, the quantity whose gradient
  DeepSpeed applies).
* Optimizer: ``torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)`` (one group;
  the Lightning-shaped case uses DemoGPT's two groups: weights of dim >= 2 with weight decay 0.1, the rest 0.0).
  Scheduler: ``LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))``, stepped once after each optimizer step
  (by the engine; in the Lightning-shaped case by the script, as Lightning does, the engine's ``lr_scheduler``
  being ``None``). Learning rates of steps 1-6: 0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01.
* DeepSpeed: micro batch 2 per GPU, gradient accumulation 1, ``gradient_clipping=1.0``, ZeRO stage 1, 2 or 3, fp32
  or ``"bf16": {"enabled": true}``; stage 3 with ``stage3_param_persistence_threshold=0`` so that every parameter
  is partitioned.

Each ``stage{S}_{fp32,bf16}`` case trains steps 1-3, saves ``tag="global_step3"``, trains steps 4-6 and saves
``tag="global_step6"``. The ``lightning_stage2_fp32`` case saves at step 3 the way Lightning's
``DeepSpeedStrategy.save_checkpoint`` does (folder ``epoch=0-step=3.ckpt``, ``tag="checkpoint"``, Lightning's
checkpoint dict without ``state_dict`` and ``optimizer_states`` as ``client_state``, Lightning's default DeepSpeed
config), then trains steps 4-6 without saving.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import pickle
import shutil
import socket
import sys
import zipfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE.parents[1] / "lzero" / "demo" / "model.py"
MODEL_CONFIG = dict(vocab_size=65, block_size=16, n_layer=2, n_head=3, n_embd=15, dropout=0.0, bias=True)
MICRO_BATCH, SEQUENCE = 2, 8
LR, BETAS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 0.1, 1.0
SAVE_AT, LAST_STEP = 3, 6
CASES = [f"stage{s}_{p}" for s in (1, 2, 3) for p in ("fp32", "bf16")] + ["lightning_stage2_fp32"]
LIGHTNING_CKPT = "epoch=0-step=3.ckpt"
LIGHTNING_DIRPATH = "/tmp/lzero-deepspeed-fixtures/checkpoints"  # where the fictional run's ModelCheckpoint wrote
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed's recovery scripts: not committed


def load_model_module():
    """``lzero/demo/model.py`` as a standalone module (importing ``lzero`` would pull its engine)."""
    spec = importlib.util.spec_from_file_location("lzero_demo_model", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


class LightningShaped(nn.Module):
    """The GPT under the attribute ``model``, as ``DemoGPT`` holds it: DeepSpeed sees Lightning's module names."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.model = gpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, each ``(MICRO_BATCH, SEQUENCE)``, of training step ``step`` (from 1) on ``rank``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, MODEL_CONFIG["vocab_size"], (MICRO_BATCH, SEQUENCE + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def ds_config(stage: int, precision: str) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1000,
                    stage3_max_live_parameters=10_000, reduce_bucket_size=10_000)
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "zero_optimization": zero,
    }


def lightning_ds_config() -> dict:
    """What ``DeepSpeedStrategy(stage=2)`` (Lightning 2.6) hands ``deepspeed.initialize`` under ``precision="32-true"``,
    ``gradient_clip_val=1.0``, ``accumulate_grad_batches=1`` and a loader of batch size 2."""
    return {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 2, "contiguous_gradients": True, "overlap_comm": True, "allgather_partitions": True,
            "reduce_scatter": True, "allgather_bucket_size": 200_000_000, "reduce_bucket_size": 200_000_000,
            "sub_group_size": 1_000_000_000_000,
        },
        "activation_checkpointing": {
            "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "thread_count": 1},
        "gradient_accumulation_steps": 1,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": CLIP,
    }


def _progress(n: int, keys: tuple[str, ...]) -> dict:
    return {"total": dict.fromkeys(keys, n), "current": dict.fromkeys(keys, n)}


def _batch_progress(started: int, completed: int) -> dict:
    counts = {"ready": started, "started": started, "processed": started, "completed": completed}
    return {"total": dict(counts), "current": dict(counts), "is_last_batch": False}


def lightning_client_state(scheduler) -> dict:
    """The dict Lightning 2.6.6's ``dump_checkpoint`` builds when ``ModelCheckpoint(every_n_train_steps=3)`` saves
    after step 3 of epoch 0 (copied from a real checkpoint of ``DemoGPT`` with this scheduler), without the
    ``state_dict`` and ``optimizer_states`` that ``DeepSpeedStrategy.save_checkpoint`` leaves out."""
    s = SAVE_AT
    fit_loop = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": s - 1},  # the checkpoint is written inside batch s
        "epoch_loop.batch_progress": _batch_progress(s, s - 1),
        "epoch_loop.scheduler_progress": _progress(s, ("ready", "completed")),
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
            "step": _progress(s, ("ready", "completed")),
            "zero_grad": _progress(s, ("ready", "started", "completed")),
        }},
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": _progress(0, ("ready", "completed")),
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": _batch_progress(0, 0),
        "epoch_progress": {
            "total": {"ready": 1, "started": 1, "processed": 0, "completed": 0},
            "current": {"ready": 1, "started": 1, "processed": 0, "completed": 0},
        },
    }
    callback_key = ("ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 3, 'every_n_epochs': 0,"
                    " 'train_time_interval': None}")
    return {
        "epoch": 0,
        "global_step": s,
        "pytorch-lightning_version": "2.6.6",
        "loops": {
            "fit_loop": fit_loop,
            "validate_loop": {"state_dict": {}, "batch_progress": _batch_progress(0, 0)},
            "test_loop": {"state_dict": {}, "batch_progress": _batch_progress(0, 0)},
            "predict_loop": {"state_dict": {}, "batch_progress": {"total": _batch_progress(0, 0)["total"],
                                                                  "current": _batch_progress(0, 0)["current"]}},
        },
        "callbacks": {callback_key: {
            "monitor": None, "best_model_score": None, "best_model_path": f"{LIGHTNING_DIRPATH}/{LIGHTNING_CKPT}",
            "current_score": None, "dirpath": LIGHTNING_DIRPATH, "best_k_models": {}, "kth_best_model_path": "",
            "kth_value": torch.tensor(float("inf")), "last_model_path": "",
        }},
        "lr_schedulers": [scheduler.state_dict()],
        "hparams_name": "kwargs",
        # DemoGPT's __init__ arguments: GPTConfig's fields but bias (its default applies), then the optimizer's
        "hyper_parameters": {k: v for k, v in MODEL_CONFIG.items() if k != "bias"}
        | dict(lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS),
    }


def _build(case: str, gpt_module):
    torch.manual_seed(0)
    gpt = gpt_module.GPT(gpt_module.GPTConfig(**MODEL_CONFIG))
    if case.startswith("lightning"):
        model = LightningShaped(gpt)
        params = [p for _, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS)
        config = lightning_ds_config()
    else:
        model = gpt
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        stage, precision = case.removeprefix("stage").split("_")
        config = ds_config(int(stage), precision)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler, config


def _train_step(engine, step: int, rank: int, lightning_scheduler=None) -> dict:
    x, y = batch(step, rank)
    lr = engine.get_lr()[0]
    logits = engine(x)  # (B, T, V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    engine.backward(loss)
    engine.step()
    if lightning_scheduler is not None:
        lightning_scheduler.step()
    losses = [torch.zeros(()) for _ in range(WORLD)]
    torch.distributed.all_gather(losses, loss.detach().float())
    norm = engine.get_global_grad_norm()
    return {"step": step, "lr": lr, "loss_per_rank": [t.item() for t in losses],
            "loss_mean": sum(t.item() for t in losses) / WORLD,
            "grad_norm": None if norm is None else float(norm)}


def _moments(engine) -> dict:
    """Every parameter's full fp32 ``exp_avg`` / ``exp_avg_sq`` and master weight, reassembled by DeepSpeed's own
    ``safe_get_full_*`` (collective at stage 3: every rank calls it), plus this rank's AdamW ``step`` values."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        # ZeRO 1/2 links each parameter to its optimizer-state fragment once, right after the first group's first
        # step, when later groups have no state yet: with several groups (the Lightning-shaped case) their
        # parameters would raise "exp_avg not found". Link again now that every group has stepped.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    full = {}
    for name, p in engine.module.named_parameters():
        full[name] = {key: safe_get_full_optimizer_state(p, key).detach().float().clone()
                      for key in ("exp_avg", "exp_avg_sq")}
        full[name]["fp32"] = safe_get_full_fp32_param(p).detach().float().clone()
    inner = engine.optimizer.optimizer  # the client torch.optim.AdamW over DeepSpeed's flat partitions
    steps = [float(state["step"]) for state in inner.state.values() if "step" in state]
    return {"params": full, "step": steps}


def _checkpoint(engine, folder: Path, save_dir: Path, tag: str, step: int, rank: int, client_state: dict) -> None:
    """Save through DeepSpeed, then write what DeepSpeed says the checkpoint holds: the weights its
    ``zero_to_fp32`` recovers from the files, the moments its ``safe_get_full_*`` read in memory."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state)
    torch.distributed.barrier()
    moments = _moments(engine)
    steps = [None] * WORLD
    torch.distributed.all_gather_object(steps, moments["step"])
    if rank == 0:
        for script in DEEPSPEED_SCRIPTS:
            (save_dir / script).unlink(missing_ok=True)
        with contextlib.redirect_stdout(sys.stderr):
            weights = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
        weights = {k: v.detach().float().clone() for k, v in weights.items()}
        torch.save(weights, folder / f"expected_step{step}_fp32.pt")
        torch.save({"params": moments["params"], "step_per_rank": steps}, folder / f"expected_step{step}_moments.pt")
    torch.distributed.barrier()


def run_case(deepspeed, case: str, out: Path, rank: int, gpt_module) -> None:
    folder = out / case
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    torch.distributed.barrier()
    model, optimizer, scheduler, config = _build(case, gpt_module)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=config)
    lightning = case.startswith("lightning")
    if lightning:  # DeepSpeedStrategy takes the scheduler from the engine and steps it itself
        engine.lr_scheduler = None
    save_dir = folder / LIGHTNING_CKPT if lightning else folder
    records = []
    for step in range(1, LAST_STEP + 1):
        records.append(_train_step(engine, step, rank, scheduler if lightning else None))
        if lightning and step == SAVE_AT:
            _checkpoint(engine, folder, save_dir, "checkpoint", step, rank, lightning_client_state(scheduler))
        elif not lightning and step in (SAVE_AT, LAST_STEP):
            _checkpoint(engine, folder, save_dir, f"global_step{step}", step, rank, {})
    if rank == 0:
        expected = {
            "case": case, "world_size": WORLD, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "model_config": MODEL_CONFIG, "config": config, "saved_at_step": SAVE_AT,
            "fields": "per step: lr the step used, each rank's loss, loss_mean their mean (the all-reduced"
                      " average), grad_norm DeepSpeed's global gradient norm before clipping",
            "steps_before_save": records[:SAVE_AT],
            "steps_after_resume": records[SAVE_AT:],
        }
        (folder / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    del engine, optimizer, model
    torch.distributed.barrier()


def _rank(rank: int, port: int, out: str, cases: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo")
    gpt_module = load_model_module()
    for case in cases:
        run_case(deepspeed, case, Path(out), rank, gpt_module)


class _Anything(dict):
    """Stands for every class a pickle names, so that reading one executes nothing and fails on nothing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def __setstate__(self, state) -> None:
        pass

    def append(self, item) -> None:
        pass

    def extend(self, items) -> None:
        pass


class _ClassLogger(pickle.Unpickler):
    """Records every global a pickle names, without importing any of them."""

    def __init__(self, file, seen: set[str]) -> None:
        super().__init__(file)
        self.seen = seen

    def find_class(self, module: str, name: str):
        self.seen.add(f"{module}.{name}")
        return _Anything

    def persistent_load(self, pid):
        return None


def pickled_classes(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        data = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        seen: set[str] = set()
        _ClassLogger(io.BytesIO(archive.read(data)), seen).load()
    return sorted(seen)


def _describe(value, depth: int = 0, limit: int = 2) -> str:
    if isinstance(value, dict) and depth < limit:
        inner = ", ".join(f"{k!r}: {_describe(v, depth + 1, limit)}" for k, v in list(value.items())[:12])
        more = f", ... ({len(value)} keys)" if len(value) > 12 else ""
        return "{" + inner + more + "}"
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{len(value)}]" + (f" of {_describe(value[0], depth + 1, limit)}"
                                                          if value and depth < limit else "")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return repr(value)[:80]
    return type(value).__module__ + "." + type(value).__qualname__


def inventory(out: Path, cases: list[str]) -> None:
    for case in cases:
        folder = out / case
        total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"== {case}: {total} bytes")
        for path in sorted(folder.rglob("*")):
            if not path.is_file():
                continue
            print(f"  {path.relative_to(folder)} ({path.stat().st_size} bytes)")
            if path.suffix != ".pt":
                continue
            print(f"    classes: {', '.join(pickled_classes(path))}")
            state = torch.load(path, map_location="cpu", weights_only=False)
            keys = list(state) if isinstance(state, dict) else type(state).__name__
            print(f"    keys: {keys}")
            if isinstance(state, dict) and "optimizer_state_dict" in state:
                print(f"    optimizer_state_dict: {_describe(state['optimizer_state_dict'])}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"== all of {out}: {total} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder that receives one folder per case")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, among {', '.join(CASES)}")
    parser.add_argument("--inventory-only", action="store_true", help="only describe the existing folders")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose among {CASES}")
    if not args.inventory_only:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(port, str(args.out.resolve()), cases), nprocs=WORLD, join=True)
    inventory(args.out, cases)


if __name__ == "__main__":
    main()
