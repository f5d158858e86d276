"""``lzero estimate``: model-state memory per device, per host and per NVMe disk of every strategy, from a
parameter count or from a model built on the meta device (no memory used). The figures come from
:mod:`lzero.memory.estimate`; this file reads the command line, counts a model and prints.

``lzero estimate --params 7.5e9 --num-gpus 64`` prints the ZeRO paper's example beside lzero's own layout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable, Optional, Sequence

from lzero.config import ZeroConfigError
from lzero.memory.estimate import (ADAM_BYTES, COMPUTE_BYTES, GB, Estimate, EstimateError, ModelCount, auto_schedule,
                                   count_parameters, estimate)

PLOT_INSTALL = "pip install matplotlib  (or: pip install 'lzero[plot]')"


def load_model(path: str, model_args: Optional[str] = None) -> Any:
    """``package.module:Class`` (or ``package.module.Class``) called with the JSON ``model_args`` on the meta
    device: parameters have shapes and no memory."""
    import torch

    kwargs = _model_kwargs(model_args)
    module_name, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise EstimateError(f"`--model {path}` names no class. HINT: `--model package.module:Class`, e.g."
                            " `--model lzero.demo:DemoGPT`.")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of the user's module, reported with its cause
        raise EstimateError(f"`--model {path}`: module {module_name!r} does not import ({type(err).__name__}: {err})."
                            " HINT: check the spelling and that the package is on PYTHONPATH.") from err
    cls = getattr(module, attr, None)
    if not callable(cls):
        raise EstimateError(f"`--model {path}`: module {module_name!r} has no class {attr!r}."
                            " HINT: `--model package.module:Class` with a class the module defines.")
    try:
        with torch.device("meta"):
            return cls(**kwargs)
    except Exception as err:  # a bad keyword or value in --model-args
        raise EstimateError(f"`--model {path}` with `--model-args {json.dumps(kwargs)}` failed to build"
                            f" ({type(err).__name__}: {err}). HINT: pass the constructor's own keyword"
                            " arguments in --model-args.") from err


def _json_object(flag: str, text: str, what: str, example: str) -> dict[str, Any]:
    """``text`` of the option ``flag`` read as a JSON object of ``what``, or an error naming it and ``example``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise EstimateError(f"`{flag} {text}` is not valid JSON ({err}). HINT: a JSON object in single quotes, e.g."
                            f" {flag} '{example}'.") from err
    if not isinstance(value, dict):
        raise EstimateError(f"`{flag} {text}` is a JSON {type(value).__name__}, not an object of {what}. HINT: e.g."
                            f" {flag} '{example}'.")
    return value


def _model_kwargs(text: Optional[str]) -> dict[str, Any]:
    if text is None:
        return {}
    return _json_object("--model-args", text, "keyword arguments", '{"n_layer": 48, "n_embd": 1600}')


def _params(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number. HINT: e.g. 7.5e9") from None
    if not value.is_integer() or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number of parameters. HINT: e.g. 7.5e9")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lzero estimate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Model-state memory of each strategy, per device, per host (node) and per NVMe disk (node),"
                    " in GB (1e9 bytes). See lzero/memory/estimate.py for the formulas.")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_params, help="trainable parameters, e.g. 7.5e9")
    model.add_argument("--model", help="package.module:Class (or package.module.Class), built on the meta device")
    parser.add_argument("--model-args", help="JSON object of keyword arguments for --model")
    parser.add_argument("--frozen-params", type=float, default=0, help="with --params: parameters that are not trained")
    parser.add_argument("--quantized", choices=["4bit", "4bit-dq", "int8"],
                        help="with --params: the frozen parameters are a bitsandbytes-quantized base (QLoRA): 4bit"
                             " (nf4/fp4), 4bit-dq (double quantization), int8")
    parser.add_argument("--quantized-params", type=float, default=None,
                        help="with --quantized: how many of the frozen parameters are quantized (default: all)")
    parser.add_argument("--num-gpus", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--shard-group-size", type=int, default=None,
                        help="hybrid sharding: the zero rows shard within groups of this many ranks (e.g. --num-gpus),"
                             " replicated across groups")
    parser.add_argument("--hpz-partition-size", type=int, default=None,
                        help="add a zero3_hpz row: ZeRO++'s hpZ with a secondary copy within groups of this many ranks"
                             " (e.g. --num-gpus)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="tensor parallel over T of the ranks (a divisor of the world; ZeRO over the rest): a"
                             " plan's split parameters count 1/T per rank")
    parser.add_argument("--tensor-sharded-params", type=float, default=None,
                        help="with --params and --tensor-parallel: how many of the trainable parameters the plan splits"
                             " (default: all of them)")
    parser.add_argument("--tp-plan", default="auto",
                        help="with --model and --tensor-parallel: 'auto' (the Hugging Face model's"
                             " base_model_tp_plan) or a JSON object of module-name patterns to colwise/rowwise")
    parser.add_argument("--pipeline-parallel", type=int, default=1, metavar="P",
                        help="pipeline parallel over P of the ranks: adds a row per pipeline rank (its stage's model"
                             " states over N / (P x T) data ranks, the activations its schedule holds)")
    parser.add_argument("--pipeline-schedule", default="1f1b", help="with --pipeline-parallel: gpipe, 1f1b or"
                                                                    " interleaved_1f1b")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="with --pipeline-parallel: micro-batches per step (default: the stages)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="with --pipeline-parallel: stages per rank (default 2 under interleaved_1f1b, else 1)")
    parser.add_argument("--microbatch-activations", type=float, default=0,
                        help="with --pipeline-parallel: bytes of activations one micro-batch keeps for backward"
                             " through the whole model (e.g. measured without pipelines)")
    parser.add_argument("--precision", default="bf16-mixed",
                        help=f"one of {', '.join(COMPUTE_BYTES)} (default bf16-mixed, the ZeRO paper's setting)")
    parser.add_argument("--optimizer-bytes", type=float, default=ADAM_BYTES,
                        help="optimizer state bytes per parameter besides the fp32 master (Adam 8, SGD momentum 4)")
    parser.add_argument("--optimizer", choices=["adamw", "muon", "adafactor"], default=None,
                        help="with --model: the optimizer's own state per tensor and per rank instead of"
                             " --optimizer-bytes (muon: Muon on the blocks' matrices, AdamW on the rest; Muon and"
                             " Adafactor step whole tensors, each owned by one rank)")
    parser.add_argument("--buffers", action="store_true",
                        help="add lzero's working set (reduce buckets, stage-3 gathers, offload staging) at the"
                             " ZeroConfig defaults")
    parser.add_argument("--offload-ratio", type=float, default=1.0, help="offload_optimizer.ratio of the offload rows")
    parser.add_argument("--max-in-cpu", type=float, default=None,
                        help="offload_param.max_in_cpu of the NVMe row (default 1e9 elements per rank)")
    parser.add_argument("--deepspeed", action="store_true",
                        help="also print DeepSpeed's own estimator rows (stages 2 and 3) for comparison")
    parser.add_argument("--largest-layer", type=float, default=None,
                        help="with --deepspeed and --params: the largest layer's parameters (its stage-3 figure)")
    parser.add_argument("--free-memory", type=float, default=None,
                        help="with --model: bytes free per device; prints the zero3 gather schedule that"
                             " `schedule=\"auto\"` would choose there")
    parser.add_argument("--activations", type=float, default=0,
                        help="with --free-memory: bytes of activations per rank (at run time they are measured)")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="also write stacked bars per strategy (needs matplotlib)")
    return parser


def estimate_command(argv: Sequence[str], plan_for: Optional[Callable[[Any, Any, int], dict[str, str]]] = None) -> int:
    """``plan_for(module, tp_plan, T)``: a ``tp_plan`` resolved to module names (``lzero.hf.tensor_parallel_plan``'s,
    handed in by the command line: it reads Hugging Face models), for ``--model`` with ``--tensor-parallel``."""
    args = _parser().parse_args(list(argv))
    try:
        _check_optimizer(args)
        if args.model_args is not None and args.model is None:
            raise EstimateError("`--model-args` is given without `--model`. HINT: add `--model package.module:Class`,"
                                " or drop --model-args.")
        if args.model is not None:
            if args.quantized is not None:
                raise EstimateError("`--quantized` counts a quantized frozen base given by numbers. HINT: use"
                                    " `--params TRAINABLE --frozen-params F --quantized 4bit-dq` (F: the base's"
                                    " parameters, Ψ: the adapters').")
            module = load_model(args.model, args.model_args)
            staged = module
            plan = _tp_plan(args.tp_plan) if args.tensor_parallel > 1 else None
            count = count_parameters(module, tensor_plan=plan_for(module, plan, args.tensor_parallel)
                                     if plan is not None and plan_for is not None else None)
        elif args.quantized is not None:
            quantized = args.frozen_params if args.quantized_params is None else args.quantized_params
            count = ModelCount(args.params, args.frozen_params, quantized=quantized, quantization=args.quantized,
                               tensor_sharded=_split(args))
        else:
            count = ModelCount(args.params, args.frozen_params, tensor_sharded=_split(args))
        if args.model is None:
            staged = None
        max_in_cpu = None if args.max_in_cpu is None else int(args.max_in_cpu)
        rows = estimate(count, args.num_gpus, args.num_nodes, args.precision,
                        0 if args.optimizer else args.optimizer_bytes, args.buffers,
                        args.offload_ratio, max_in_cpu, shard_group_size=args.shard_group_size,
                        hpz_partition_size=args.hpz_partition_size, tensor_parallel_size=args.tensor_parallel)
        by_rank = None
        if args.optimizer:
            from lzero.memory.matrix_estimate import matrix_rows

            rows, by_rank = matrix_rows(module, args.optimizer, rows, args.num_gpus * args.num_nodes, args.precision,
                                        args.offload_ratio, max_in_cpu)
        pipeline = _pipeline(count, args, staged)
        if args.plot:
            plot(rows, args.plot)
        schedule = None
        if args.free_memory is not None:
            schedule = auto_schedule(count, args.shard_group_size or args.num_gpus * args.num_nodes,
                                     int(args.free_memory), args.precision, int(args.activations), args.optimizer_bytes)
    except (EstimateError, ZeroConfigError) as err:
        print(f"lzero estimate: {err}", file=sys.stderr)
        return 2
    deepspeed = _deepspeed(count, args) if args.deepspeed else None
    if args.json:
        print(json.dumps({**_json(rows, count, args), **({"deepspeed": deepspeed} if deepspeed else {}),
                          **({"optimizer_state_per_rank": by_rank} if by_rank is not None else {}),
                          **({"pipeline": pipeline} if pipeline else {}),
                          **({"zero3_schedule": schedule} if schedule else {})}, indent=2))
    else:
        print(table(rows, count, args))
        if by_rank is not None:
            from lzero.memory.matrix_estimate import imbalance_lines

            print(imbalance_lines(by_rank, args.optimizer))
        if pipeline:
            from lzero.memory.pipeline_estimate import pipeline_table

            print(pipeline_table(pipeline, args, _gb))
        if schedule:
            print(schedule_line(schedule, args))
        if deepspeed:
            print("\nDeepSpeed's estimator (its formulas: 18 bytes of sharded states per parameter, a 1.5 host buffer"
                  " factor), GiB:")
            for stage, stage_rows in deepspeed.items():
                for row in stage_rows:
                    print(f"  {stage}: per GPU {row['per_gpu'] / 2**30:7.2f} | per CPU {row['per_cpu'] / 2**30:7.2f} |"
                          f" {row['options']}")
    return 0


def _check_optimizer(args: argparse.Namespace) -> None:
    """``--optimizer`` needs the model's shapes, and models one data-parallel dimension."""
    if args.optimizer is None:
        return
    if args.model is None:
        raise EstimateError(f"`--optimizer {args.optimizer}` needs the model's tensors: each one's state depends on its"
                            " shape, and which rank owns it on the partition. HINT: add `--model package.module:Class`"
                            " (built on the meta device), or use `--optimizer-bytes` with `--params`.")
    beside = [flag for flag, on in (("--tensor-parallel", args.tensor_parallel > 1),
                                    ("--pipeline-parallel", args.pipeline_parallel > 1),
                                    ("--shard-group-size", args.shard_group_size),
                                    ("--hpz-partition-size", args.hpz_partition_size),
                                    ("--free-memory", args.free_memory is not None)) if on]
    if beside:
        raise EstimateError(f"`--optimizer` with `{beside[0]}` is not modeled yet (the per-tensor partition is computed"
                            " over the data-parallel ranks alone). HINT: drop one of the two.")


def _pipeline(count: ModelCount, args: argparse.Namespace, module: Any) -> Optional[list[dict]]:
    """``--pipeline-parallel``'s rows (see lzero/memory/pipeline_estimate.py), or None without it."""
    pipeline_only = [flag for flag, value in (("--microbatches", args.microbatches),
                                              ("--virtual-stages", args.virtual_stages),
                                              ("--microbatch-activations", args.microbatch_activations or None))
                     if value is not None]
    if args.pipeline_parallel == 1:
        if pipeline_only:
            raise EstimateError(f"`{pipeline_only[0]}` is given without `--pipeline-parallel`. HINT: add"
                                " `--pipeline-parallel P`, or drop it.")
        return None
    from lzero.memory.pipeline_estimate import pipeline_rows

    return pipeline_rows(count, args, module)


def _tensor_line(count: ModelCount, args: argparse.Namespace) -> str:
    size = args.tensor_parallel
    if size == 1:
        return ""
    return (f"; tensor parallel T = {size}: {count.tensor_sharded:,} of the trainable params split over the tensor ranks"
            f" ({count.per_tensor_rank(size).trainable:,} per tensor rank), every row's data parallel over"
            f" N / T = {args.num_gpus * args.num_nodes // size} ranks")


def _split(args: argparse.Namespace) -> int:
    """``--params``: the trainable parameters a tensor-parallel plan splits (all, unless told)."""
    if args.tensor_sharded_params is not None and args.tensor_parallel == 1:
        raise EstimateError("`--tensor-sharded-params` is given without `--tensor-parallel`. HINT: add"
                            " `--tensor-parallel T`, or drop it.")
    if args.tensor_parallel == 1:
        return 0
    return int(args.params if args.tensor_sharded_params is None else args.tensor_sharded_params)


def _tp_plan(text: str) -> Any:
    if text == "auto":
        return text
    return _json_object("--tp-plan", text, "module-name patterns to 'colwise'/'rowwise' ('auto' aside)",
                        '{"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}')


def schedule_line(r: dict, args: argparse.Namespace) -> str:
    """What ``schedule="auto"`` would take, in one paragraph."""
    return (f"\nzero3 gather schedule (`schedule=\"auto\"`) with {_gb(r['budget_bytes'])} GB free per device and"
            f" {_gb(args.activations) if args.activations else 'no'} activations: {r['persistent_blocks']} of"
            f" {r['blocks']} blocks persistent (param_persistence_threshold={r['param_persistence_threshold']}),"
            f" {r['kept_blocks']} kept across the forward-backward turn (max_reuse_distance={r['max_reuse_distance']}):"
            f" {r['gathers_per_step']} all-gathers per step instead of {r['min_memory_gathers_per_step']}; predicted"
            f" peak {_gb(r['predicted_peak_bytes'])} GB of {_gb(r['budget_bytes'])} GB less {r['margin']:.0%}. At run"
            " time the measured peak of the first two steps replaces this estimate's.")


def _deepspeed(count: ModelCount, args: argparse.Namespace) -> dict:
    from lzero.memory.estimate import deepspeed_estimator

    total = count.trainable + count.frozen
    largest = args.largest_layer if args.largest_layer is not None else (count.largest_block or count.largest_param or 0)
    return {f"zero{stage}": deepspeed_estimator(stage, total, args.num_gpus, args.num_nodes, largest)
            for stage in (2, 3)}


def _json(rows: list[Estimate], count: ModelCount, args: argparse.Namespace) -> dict:
    return {"trainable_params": count.trainable, "frozen_params": count.frozen, "num_gpus": args.num_gpus,
            "tensor_parallel_size": args.tensor_parallel, "tensor_sharded_params": count.tensor_sharded,
            "num_nodes": args.num_nodes, "world_size": args.num_gpus * args.num_nodes, "precision": args.precision,
            "optimizer_bytes": args.optimizer_bytes, "buffers": args.buffers, "units": "bytes",
            "strategies": [row.as_dict() for row in rows]}


def _gb(nbytes: Optional[int]) -> str:
    """GB (1e9): one decimal from 1 GB up, three significant digits below; '-' for nothing."""
    if nbytes is None or nbytes == 0:
        return "-"
    return f"{nbytes / GB:.1f}" if nbytes >= GB else f"{nbytes / GB:.3g}"


def table(rows: list[Estimate], count: ModelCount, args: argparse.Namespace) -> str:
    world = args.num_gpus * args.num_nodes
    head = ("strategy", "per device", "per host (node)", "per NVMe (node)", "ZeRO paper, per device")
    body = [(r.strategy, _gb(r.per_device), _gb(r.per_host), _gb(r.per_nvme), _gb(r.paper_bytes)) for r in rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    lines = [f"Model states in GB (1e9 bytes): trainable {count.trainable:,} params, frozen {count.frozen:,};"
             f" N = {world} ({args.num_gpus} per node x {args.num_nodes} node{'s' if args.num_nodes > 1 else ''});"
             f" {args.precision}; {_optimizer_words(args)}"
             f"{'; with lzero working set' if args.buffers else ''}"
             f"{f'; hybrid: zero rows sharded within groups of G = {args.shard_group_size}' if args.shard_group_size else ''}"
             f"{_tensor_line(count, args)}", ""]
    for line in (head, tuple("-" * w for w in widths), *body):
        cells = [line[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(line[1:], widths[1:]))]
        lines.append("  ".join(cells))
    lines += ["",
              f"per host and per NVMe: the {args.num_gpus} rank(s) of one node together. Every gradient is counted"
              " (from a backward to its step). ddp: Lightning's DDP (fp32 parameters, autocast).",
              "ZeRO paper: its formula with 16-bit gradients, without buffers; lzero keeps fp32 gradient shards"
              " under mixed precision (lzero/memory/estimate.py, [Note: lzero's layout])."]
    if args.num_nodes > 1 and not args.shard_group_size and args.tensor_parallel == 1:
        hybrid = {r.strategy: r for r in estimate(count, args.num_gpus, args.num_nodes, args.precision,
                                                  args.optimizer_bytes, strategies=["zero1", "zero2", "zero3"],
                                                  shard_group_size=args.num_gpus)}
        lines.append(f"Across nodes, shard within a node: `--shard-group-size {args.num_gpus}` (hybrid sharding) keeps"
                     " every all-gather inside the node and sends one all-reduce of a 1/G gradient shard between"
                     " nodes; per device: " + ", ".join(f"{name} {_gb(row.per_device)} GB" for name, row in hybrid.items())
                     + ". zero_auto tries those first when they fit.")
    if args.buffers and count.largest_block is None:
        lines.append("stage-3 blocks and root unit taken as reduce_bucket_size (5e6) elements each: pass --model"
                     " for the real sizes.")
    return "\n".join(lines)


def _optimizer_words(args: argparse.Namespace) -> str:
    if args.optimizer:
        return f"optimizer {args.optimizer}, each tensor's own state"
    return f"optimizer state {args.optimizer_bytes:g} bytes/param"


def plot(rows: list[Estimate], path: str) -> None:
    """Stacked bars per strategy (parameters, gradients, masters, optimizer state, buffers), one panel per
    store, per rank in GB."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise EstimateError(f"`--plot {path}` needs matplotlib, which is not installed. HINT: {PLOT_INSTALL}") from err
    from lzero.offload.store import KINDS

    stores = [s for s in ("device", "cpu", "nvme") if any(r.store_bytes(s) for r in rows)]
    fig, axes = plt.subplots(1, len(stores), figsize=(5 * len(stores), 4), squeeze=False)
    names = [r.strategy for r in rows]
    for ax, store in zip(axes[0], stores):
        bottom = [0.0] * len(rows)
        for kind in KINDS:
            values = [r.per_rank.get(store, {}).get(kind, 0) / GB for r in rows]
            if any(values):
                ax.bar(names, values, bottom=bottom, label=kind.replace("_", " "), color=f"C{KINDS.index(kind)}")
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title({"device": "device", "cpu": "host memory", "nvme": "NVMe"}[store] + " per rank")
        ax.set_ylabel("GB (1e9 bytes)")
        ax.tick_params(axis="x", labelrotation=45)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
