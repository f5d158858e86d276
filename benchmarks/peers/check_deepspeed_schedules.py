"""lzero's DeepSpeed schedulers against DeepSpeed's own classes, step by step (run in an environment that has
DeepSpeed, which lzero never depends on; results in benchmarks/results/peers/).

For random parameter sets of ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` (two param groups, some resumed with
``last_batch_iteration``) and ``OneCycle`` (momentum cycled on AdamW's betas; stairs, decay, resumed), the learning
rate (and betas) each optimizer holds before each of 40 steps must be equal, bitwise, between DeepSpeed's class
(``deepspeed.runtime.lr_schedules``, stepped after each optimizer step as its engine does) and lzero's scheduler
(stepped once per optimizer step as Lightning does).

    /path/to/deepspeed-venv/bin/python -m benchmarks.peers.check_deepspeed_schedules [--out none]

from the repository root (lzero is imported from there). It prints the comparison and writes it, under a
:func:`benchmarks.common.run_header` line, to ``results/peers/deepspeed_schedules.<machine>.<date>.md``.
"""

from __future__ import annotations

import argparse
import logging
import random
import warnings

import torch

from benchmarks.common import out_path, require, run_header, write_report

STEPS, TRIALS = 40, 300


def optimizer() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    return torch.optim.AdamW([{"params": [params[0]], "lr": 0.01}, {"params": [params[1]], "lr": 0.005}],
                             betas=(0.9, 0.99))


def warmup_params(rng: random.Random) -> tuple[str, dict]:
    kind = rng.choice(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
    p = {"warmup_num_steps": rng.randint(1, 12), "warmup_type": rng.choice(["log", "linear"])}
    if kind != "WarmupLR":
        p["total_num_steps"] = rng.randint(1, 30)
    if kind == "WarmupCosineLR":
        p.update(warmup_min_ratio=rng.random() * 0.5, cos_min_ratio=rng.random() * 0.1)
    else:
        p["warmup_min_lr"] = rng.random() * 1e-4
        if rng.random() < 0.7:
            p["warmup_max_lr"] = 1e-3 * (1 + rng.random())
    if rng.random() < 0.3:
        p["last_batch_iteration"] = rng.randint(0, 10)
    return kind, p


def one_cycle_params(rng: random.Random) -> tuple[str, dict]:
    p = {"cycle_min_lr": 1e-4 * rng.random(), "cycle_max_lr": 1e-3 * (1 + rng.random()),
         "cycle_first_step_size": rng.randint(1, 10), "decay_lr_rate": rng.random() * 0.5,
         "decay_step_size": rng.randint(0, 5), "decay_mom_rate": rng.random() * 0.1}
    if rng.random() < 0.5:
        p["cycle_second_step_size"] = rng.randint(1, 10)
    if rng.random() < 0.4:
        p["cycle_first_stair_count"] = rng.randint(1, 4)
    if rng.random() < 0.2:
        p["last_batch_iteration"] = rng.randint(0, 8)
    return "OneCycle", p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/peers/deepspeed_schedules.<machine>.<date>.md)")
    out = out_path(parser.parse_args().out, "peers", "deepspeed_schedules")
    require("deepspeed", "run this with the python of an environment that has DeepSpeed (and torch, lightning)")
    import deepspeed
    from deepspeed.runtime import lr_schedules

    from lzero.deepspeed.schedules import build_scheduler

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    rng = random.Random(0)
    lines = []
    for family, draw in (("Warmup*", warmup_params), ("OneCycle", one_cycle_params)):
        compared = mismatched = 0
        for _ in range(TRIALS):
            kind, p = draw(rng)
            theirs, ours = optimizer(), optimizer()
            reference = getattr(lr_schedules, kind)(theirs, **p)
            scheduler = build_scheduler({"type": kind, "params": dict(p)}, ours)
            for step in range(STEPS):
                seen = [[(g["lr"], tuple(g["betas"])) for g in o.param_groups] for o in (theirs, ours)]
                compared += 1
                if seen[0] != seen[1]:
                    mismatched += 1
                    lines.append(f"MISMATCH {kind} {p} before step {step}: DeepSpeed {seen[0]}, lzero {seen[1]}")
                    print(lines[-1])
                    break
                reference.step()
                ours.step()
                scheduler.step()
        lines.append(f"{family}: {TRIALS} parameter sets, {compared} steps compared, {mismatched} mismatched"
                     f" (DeepSpeed {deepspeed.__version__}, torch {torch.__version__})")
        print(lines[-1])
    if out is not None:
        write_report(out, "# lzero's DeepSpeed schedulers against DeepSpeed's classes\n\n"
                          f"{run_header('deepspeed')}\n\n```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
