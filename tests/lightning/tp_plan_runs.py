"""``tp_plan`` (the strategy applies the plan, no user code) against the user-written plan and one process: the tiny
Llama of tensor_parallel_runs.py, tensor_parallel_size=2.

    python tests/lightning/tp_plan_runs.py OUT_DIR LLAMA_DIR   # with 4 ranks (tp2 x dp2) or 2 (tp2 x dp1)

Rank 0 writes ``OUT_DIR/<run>_dp<N>.pt`` as tensor_parallel_runs.py does: ``user_zero<S>`` (the user's
``configure_model`` parallelizes with LLAMA_PLAN), ``auto_zero<S>`` (``tp_plan="auto"``: the model's own
``base_model_tp_plan``, the Llama built in ``__init__``), ``dict_zero2`` (``tp_plan`` = LLAMA_PLAN from the
LightningModule, the Llama built in ``configure_model``), ``deepspeed_{auto,partition,user}_zero2`` (a DeepSpeed JSON's
``tensor_parallel`` block: the seeds' ``tp_size``, AutoTP's ``partition_config``, the block beside the user's plan) and
``reference_llama_dp<N>`` (one process); at dp1,
``refused_twice``: a plan beside a model the user parallelized. tests/lightning/test_tp_plan.py compares them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _teardown import destroy_process_group  # a sibling: scripts run from their folder
from lzero import ZeroStrategy
from tensor_parallel_runs import MICRO, LLAMA_PLAN, Module, dataset, load_llama, reference, refusal, run, trainer


class PlannedModule(Module):
    """The Llama parallelized by the strategy's ``tp_plan``: ``configure_model`` builds it (``in_configure``) or does
    nothing (built in ``__init__``)."""

    def __init__(self, llama: Path, in_configure: bool = False) -> None:
        super().__init__(llama=llama)
        self.folder = llama
        if in_configure:
            del self.model

    def configure_model(self) -> None:
        if not hasattr(self, "model"):  # configure_model runs at every fit/validate
            self.model = load_llama(self.folder)

    def on_train_start(self) -> None:  # the plan was applied: q/k/v/o and gate/up/down of both layers, split
        from torch.distributed.tensor import DTensor

        split = [n for n, p in self.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()]
        assert len(split) == 14 and all(n.endswith("_proj.weight") for n in split), split


def main(out: Path, llama: Path) -> None:
    world = int(os.environ["WORLD_SIZE"])
    dp = world // 2
    dict_plan = {f"model.{pattern}": style for pattern, style in LLAMA_PLAN.items()}  # from the LightningModule
    for stage in (1, 2):
        run(out, f"user_zero{stage}_dp{dp}", ZeroStrategy(stage=stage, tensor_parallel_size=2), world, llama=llama)
        run(out, f"auto_zero{stage}_dp{dp}", ZeroStrategy(stage=stage, tensor_parallel_size=2, tp_plan="auto"), world,
            module=PlannedModule(llama))
    run(out, f"dict_zero2_dp{dp}", ZeroStrategy(stage=2, tensor_parallel_size=2, tp_plan=dict_plan), world,
        module=PlannedModule(llama, in_configure=True))
    # DeepSpeed JSON: the seeds' `tp_size` (AutoTP's `autotp_size`) with the model's own plan, AutoTP's partition_config
    # (regexes over parameter names), and an AutoTP block beside the user's own plan (which comes first)
    seeds = {"zero_optimization": {"stage": 2}, "tensor_parallel": {"tp_size": 2}}
    run(out, f"deepspeed_auto_zero2_dp{dp}", ZeroStrategy(config=seeds), world, module=PlannedModule(llama))
    specs = [{"patterns": [r".*\.(q|k|v|gate|up)_proj\.weight$"], "partition_type": "column"},
             {"patterns": [r".*\.(o|down)_proj\.weight$"], "partition_type": "row"}]
    partitioned = {"zero_optimization": {"stage": 2},
                   "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": specs}}}
    run(out, f"deepspeed_partition_zero2_dp{dp}", ZeroStrategy(config=partitioned), world, module=PlannedModule(llama))
    run(out, f"deepspeed_user_zero2_dp{dp}", ZeroStrategy(config=seeds), world, llama=llama)
    if dp == 1:
        from torch.utils.data import DataLoader

        twice = trainer(ZeroStrategy(stage=2, tensor_parallel_size=2, tp_plan="auto"), world)
        refusal(out, "refused_twice", lambda: twice.fit(Module(llama=llama), DataLoader(dataset(), batch_size=MICRO)))
    if dist.get_rank() == 0:
        reference(out, dp, llama)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    destroy_process_group()
