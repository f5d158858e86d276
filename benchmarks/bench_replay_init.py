"""Materializing a model built on the meta device at world size 2 under lzero zero3: memory and time per rank.

    python benchmarks/bench_replay_init.py [--layers 24] [--out benchmarks/results_replay_init.md]

A Hugging Face Llama built from its config (no files): 24 x 1024, MLP 2816, 16 heads / 8 KV heads, vocabulary 32000,
lm_head untied, fp32 (about 349M parameters, 1.39 GB), ``torch.manual_seed(0)`` then
``AutoModelForCausalLM.from_config``. Each way of getting its weights:

- ``lzero zero3 replay``: ``Trainer(strategy="zero3", devices=2)`` on 2 gloo ranks, the model built in
  ``configure_model`` (on the meta device, its construction recorded); the strategy's setup replays the record from
  rank 0's RNG state, each rank keeping its shards ([Note: replayed construction] in lzero/engine/replay.py);
- ``lzero zero3 block-wise``: the same, with ``lzero.engine.replay.recorder_for`` patched in the rank processes to
  find no recording, so the engine warns and initializes block by block ([Note: meta-device initialization] in
  lzero/engine/materialize.py): other random draws than eager construction;
- ``eager``: ``from_config`` on the CPU in one process: what each DDP rank does.

Per process (one thread each): wall time and peak resident-memory growth of the materialization (``VmHWM`` reset
through ``/proc/self/clear_refs`` just before, minus ``VmRSS`` then; lzero: from the end of ``configure_model`` to
``on_fit_start``, i.e. the strategy's setup that builds the engine; eager: the ``from_config`` call), and the bytes
the rank holds after (the engine units' shards plus the buffers; eager: every parameter and buffer). After the
measurement, rank 0 builds the model eagerly from the same seed and compares it, tensor by tensor with
``torch.equal``, with the lzero model gathered through ``trainer.strategy.gathered_parameters`` (a collective: both
ranks enter it). Every way runs twice: with glibc's default allocator, and with ``MALLOC_MMAP_THRESHOLD_=65536``.
The lzero ranks run in a child process (``--rank-run``), where Lightning launches rank 1 by re-running this script
with the same arguments. The whole run takes a few minutes on 2 CPUs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qlora_load import FIXED, THRESHOLD, WORLD_SIZE, _reset_peak, _status  # noqa: E402

SEED = 0
BLOCKWISE = "benchmark: block-wise"
WAYS = ("replay", "block-wise")
RUN_DATE = "2026-12-03"


def llama_config(layers: int) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)


def build(layers: int) -> torch.nn.Module:
    """The model as each DDP rank builds it (under zero3 ``configure_model`` runs this on the meta device)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(llama_config(layers))


def _nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _way_name(way: str) -> str:
    return f"lzero zero3 {way}" + (f" ({THRESHOLD}={os.environ[THRESHOLD]})" if THRESHOLD in os.environ else "")


# --- lzero zero3: the ranks Lightning launches ------------------------------------------------------------------

def run_rank(way: str, layers: int, results: Path) -> None:
    """This rank's part of ``Trainer(strategy="zero3").fit``: one JSON file of measures in ``results``."""
    import lightning as L
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset
    from transformers.utils import logging as hf_logging

    import lzero  # noqa: F401  registers zero3
    from lzero.engine import replay

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    if way == "block-wise":
        replay.recorder_for = lambda tensors: (None, BLOCKWISE)  # the engine warns and initializes block by block
    seen: dict[str, object] = {}
    replayed_weights = replay.replayed_weights

    def timed_replay(*args: object, **kwargs: object) -> object:
        """The replay itself (or the refusal to replay), timed, and the memory it leaves."""
        start = time.perf_counter()
        source, why = replayed_weights(*args, **kwargs)
        held = 0 if source is None else _nbytes([*source._replay.pieces.values(), *source._replay.whole.values()])
        recorder = source._replay.recorder if source is not None else None
        seen.update(replayed=source is not None, why=why, replay_seconds=time.perf_counter() - start,
                    replay_peak=_status("VmHWM"), replay_rss=_status("VmRSS"), pieces=held,
                    entries=len(recorder.entries) if recorder is not None else 0)
        return source, why

    replay.replayed_weights = timed_replay
    before: dict[str, float] = {}

    class Model(L.LightningModule):
        def configure_model(self) -> None:
            before.update(configure_start=time.perf_counter())
            self.net = build(layers)
            before.update(configure_seconds=time.perf_counter() - before["configure_start"])
            _reset_peak()  # the engine's setup starts next (strategy.setup)
            before.update(rss=_status("VmRSS"), start=time.perf_counter())

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            loss = self.net(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Measure(Callback):
        def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seconds = time.perf_counter() - before["start"]
            hwm, rss = _status("VmHWM"), _status("VmRSS")
            rng = torch.get_rng_state()
            engine = trainer.strategy.engine
            shards = sum(u.spec.shard_numel * u.flat_param.element_size() for u in engine.units)
            buffers = _nbytes(module.buffers())
            result = {
                "way": _way_name(way), "rank": trainer.global_rank, "seconds": seconds,
                "configure_seconds": before["configure_seconds"], "peak_growth": hwm - before["rss"],
                "end_growth": rss - before["rss"], "shards": shards, "buffers": buffers,
                "largest_unit": max(u.spec.shard_numel * u.flat_param.element_size() for u in engine.units),
                "replayed": seen.get("replayed"), "why": seen.get("why"),
                "replay_seconds": seen.get("replay_seconds"), "entries": seen.get("entries"),
                "replay_peak_growth": seen["replay_peak"] - before["rss"] if "replay_peak" in seen else None,
                "replay_rss_growth": seen["replay_rss"] - before["rss"] if "replay_rss" in seen else None,
                "pieces": seen.get("pieces"),
            }
            result.update(compare_with_eager(trainer, module, layers, rng))
            module.result = result

    module = Model()
    module.losses = []
    data = DataLoader(TensorDataset(torch.randint(0, 32000, (4, 32), generator=torch.Generator().manual_seed(1234))),
                      batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="zero3", precision="32-true", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Measure()])
    trainer.fit(module, data)
    (results / f"rank{trainer.global_rank}.json").write_text(json.dumps({**module.result, "loss": module.losses}))


def compare_with_eager(trainer: object, module: object, layers: int, rng: torch.Tensor) -> dict:
    """After the measurement: rank 0 builds the model eagerly from the same seed and compares every parameter and
    buffer with the lzero model, gathered whole (a collective: every rank enters it)."""
    eager = build(layers) if trainer.global_rank == 0 else None
    out: dict[str, object] = {}
    if eager is not None:
        out["rng_equal"] = torch.equal(rng, torch.get_rng_state())  # where eager construction leaves the RNG
    with trainer.strategy.gathered_parameters(module.net):
        if eager is not None:
            mine = dict([*module.net.named_parameters(), *module.net.named_buffers()])
            theirs = dict([*eager.named_parameters(), *eager.named_buffers()])
            names = sorted(theirs)
            differ = [n for n in names if n not in mine or not torch.equal(mine[n].detach(), theirs[n].detach())]
            layer0 = [n for n in names if n.startswith("model.layers.0.")]
            out.update(compared=len(names), compared_numel=sum(theirs[n].numel() for n in names),
                       differ=len(differ), differ_names=differ[:6],
                       layer0_equal=all(n not in differ for n in layer0),
                       max_abs_diff=max((float((mine[n].detach() - theirs[n].detach()).abs().max()) for n in differ
                                         if n in mine and mine[n].shape == theirs[n].shape), default=0.0))
    return out


def run_lzero(way: str, layers: int, results: Path, env: dict[str, str]) -> list[dict]:
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("rank*.json"):
        old.unlink()
    done = subprocess.run([sys.executable, __file__, "--layers", str(layers), "--way", way, "--rank-run",
                           str(results)], capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    if done.returncode != 0:
        sys.exit(f"lzero zero3 {way} ranks failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    warned = BLOCKWISE in done.stderr or BLOCKWISE in done.stdout
    rows = [json.loads((results / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for row in rows:
        row["warned"] = warned
    return rows


# --- eager construction: one process holding the whole model ------------------------------------------------------

def _eager(layers: int, queue: object) -> None:
    import transformers  # noqa: F401  imported before the window, as the lzero ranks have it imported

    torch.set_num_threads(1)
    _reset_peak()
    rss0 = _status("VmRSS")
    start = time.perf_counter()
    model = build(layers)
    seconds = time.perf_counter() - start
    params = list(model.parameters())
    queue.put({"way": "eager (from_config on the CPU)" + "".join(f" ({THRESHOLD}={os.environ[THRESHOLD]})"
                                                                   for _ in [0] if THRESHOLD in os.environ),
               "rank": "-", "seconds": seconds, "peak_growth": _status("VmHWM") - rss0,
               "end_growth": _status("VmRSS") - rss0, "shards": _nbytes(params), "buffers": _nbytes(model.buffers()),
               "params": sum(p.numel() for p in params), "largest_tensor": max(p.numel() * p.element_size()
                                                                                 for p in params)})


def run_eager(layers: int, env: dict[str, str]) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_eager, args=(layers, queue))
    saved = dict(os.environ)
    os.environ.update(env)  # read by the child's allocator as it starts
    try:
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    result = queue.get(timeout=600)
    proc.join()
    return result


# --- the table ---------------------------------------------------------------------------------------------------

def write_table(rows: list[dict], layers: int, out: Path, command: str, wall: float) -> str:
    eager = next(r for r in rows if r["way"].startswith("eager"))
    params, largest = eager["params"], eager["largest_tensor"]
    mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f}"  # noqa: E731
    lz = [r for r in rows if r["way"].startswith("lzero")]
    replay = [r for r in lz if " replay" in r["way"]]
    blockwise = [r for r in lz if "block-wise" in r["way"]]

    def base(r: dict) -> int:
        return r["shards"] + r["buffers"] + largest

    def check(r: dict) -> str:
        ratio = f"{r['peak_growth'] / base(r):.2f}"
        if " replay" not in r["way"]:
            return ratio
        return f"{ratio} {'pass' if r['peak_growth'] <= 1.1 * base(r) else '**FAIL**'}"

    def equal(r: dict) -> str:
        if r["rank"] != 0:
            return "(rank 0 checks)"
        if "differ" not in r:
            return "-"
        if r["differ"] == 0:
            return f"yes ({r['compared']}/{r['compared']} tensors)"
        return f"no ({r['differ']}/{r['compared']} tensors differ)"

    def path(r: dict) -> str:
        if r["way"].startswith("eager"):
            return "-"
        if r["replayed"]:
            return f"replay ({r['entries']:,} ops)"
        return "block-wise" + (" (warned)" if r.get("warned") else "")

    lines = [
        "# Materializing a meta-device model at world size 2 (benchmarks/bench_replay_init.py)",
        "",
        f"`{command}`, run {RUN_DATE} on this machine (2 CPUs, 24 GiB, no GPU; torch {torch.__version__} CPU),"
        f" {wall / 60:.1f} minutes in all. Model: Hugging Face Llama from its config, no files:"
        f" `AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=1024, intermediate_size=2816,"
        f" num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,"
        f" tie_word_embeddings=False))` after `torch.manual_seed(0)`, fp32: {params / 1e6:,.1f}M parameters,"
        f" {mb(eager['shards'])} MB. lzero zero3: N = {WORLD_SIZE} gloo ranks, one thread each,"
        " `Trainer(accelerator=\"cpu\", devices=2, strategy=\"zero3\", precision=\"32-true\", max_steps=1)`, the model"
        " built in `configure_model`, SGD lr 0, one step on 2 x 32 token ids. Every way runs twice: with glibc's"
        f" default allocator settings, and with `{THRESHOLD}={FIXED}` (no dynamic mmap threshold: every allocation"
        " above 64 KiB is mapped and unmapped whole, so RSS follows the live tensors, not freed memory the heap"
        " keeps).",
        "",
        f"Largest single tensor: embed_tokens / lm_head, 32000 x 1024 fp32 = {mb(largest)} MB. Target per lzero"
        " replay rank: peak RSS growth <= 1.1 x (the rank's held bytes + the largest tensor)"
        f" = 1.1 x ({mb(replay[0]['shards'] + replay[0]['buffers'])} + {mb(largest)})"
        f" = {mb(1.1 * base(replay[0]))} MB.",
        "",
        "| way | rank | path | time s | peak RSS growth MB | RSS growth after MB | held MB | peak / (held + largest)"
        " | of which replay s | RSS growth after replay MB | configure_model s | equals eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = r["shards"] + r["buffers"]
        lines.append(
            f"| {r['way']} | {r['rank']} | {path(r)} | {r['seconds']:.1f} | {mb(r['peak_growth'])} |"
            f" {mb(r['end_growth'])} | {mb(held)} | {check(r)} |"
            f" {'-' if not r.get('replayed') else format(r['replay_seconds'], '.1f')} |"
            f" {mb(r.get('replay_rss_growth')) if r.get('replayed') else '-'} |"
            f" {format(r['configure_seconds'], '.1f') if 'configure_seconds' in r else '-'} | {equal(r)} |")
    rank0 = [r for r in lz if r["rank"] == 0]
    failed = [r for r in replay if r["peak_growth"] > 1.1 * base(r)]
    peak = lambda rs: "/".join(mb(r["peak_growth"]) for r in rs)  # noqa: E731
    default_replay = [r for r in replay if THRESHOLD not in r["way"]]
    fixed_replay = [r for r in replay if THRESHOLD in r["way"]]
    default_block = [r for r in blockwise if THRESHOLD not in r["way"]]
    fixed_block = [r for r in blockwise if THRESHOLD in r["way"]]
    unit = max(r["largest_unit"] for r in lz)
    each = lambda key: "; ".join(f"{r['way']}: {r.get(key)}" for r in rank0)  # noqa: E731
    lines += [
        "",
        "How each figure is measured:",
        "- *time*: lzero: `time.perf_counter()` from the end of `configure_model` (the model laid out on the meta"
        " device, its construction recorded) to the first `on_fit_start` callback, i.e. the strategy's setup, which"
        " builds the engine and materializes the model into shards; eager: the `from_config` call. *of which"
        " replay*: the call to `lzero.engine.replay.replayed_weights` (wrapped by the benchmark), which runs the"
        " record and keeps this rank's pieces; the rest of the window builds the units from those pieces."
        " *configure_model*: the meta-device construction with its recording (eager construction does both at"
        " once).",
        "- *peak RSS growth*: `VmHWM` at the end of the window minus `VmRSS` at its start, the high-water mark reset"
        " through `/proc/self/clear_refs` at the start. *RSS growth after*: `VmRSS` at the end minus the same start."
        " *RSS growth after replay*: `VmRSS` when `replayed_weights` returns, the pieces held then.",
        "- *held*: lzero: the engine's units at `on_fit_start` (`trainer.strategy.engine.units`), sum of"
        " `spec.shard_numel x flat_param.element_size()`, plus the module's buffers (the rotary `inv_freq`, whole on"
        " each rank); eager: every parameter and buffer.",
        "- *path*: whether the engine replayed the record (the number of recorded operations) or initialized block"
        " by block; block-wise rows are forced by patching `lzero.engine.replay.recorder_for` to"
        f" `lambda tensors: (None, \"{BLOCKWISE}\")` in the rank processes (\"warned\": the engine's warning naming"
        " that reason was seen on stderr).",
        "- *equals eager*: after the measurement, rank 0 builds the model with `from_config` after"
        " `torch.manual_seed(0)` in the same process, the lzero model is gathered whole inside"
        " `trainer.strategy.gathered_parameters(module.net)` (a collective: both ranks enter it), and every parameter"
        " and buffer is compared with `torch.equal` (bitwise)."
        f" Layer 0 alone equal, rank 0 of each run: {each('layer0_equal')}."
        f" RNG state at `on_fit_start` equal to where eager construction leaves it: {each('rng_equal')}."
        f" Largest absolute difference: {each('max_abs_diff')}.",
        "- The pass/fail applies to the replay rows; the other rows' ratios are against the same per-rank figure, for"
        " comparison.",
        f"- Loss of the one training step, per rank: "
        f"{'; '.join(r['way'] + ' ' + str(r['loss']) for r in lz)}.",
        "",
        "Where the bytes go:",
        f"- Replay: the peak is {peak(default_replay)} MB (ranks 0/1) with the default allocator and"
        f" {peak(fixed_replay)} MB with `{THRESHOLD}={FIXED}`, against {mb(1.1 * base(replay[0]))} MB:"
        f" {'**the target is missed**' if failed else 'the target is met'}. The replay runs the whole record on"
        " every rank, one tensor's storage alive at a time (nn.Linear's own `reset_parameters` draw, redrawn by"
        " `post_init`, goes into storage freed right after), and keeps this rank's pieces (cloned) as each tensor's"
        f" final version ends: {mb(replay[0]['pieces'])} MB of pieces when it returns (RSS then"
        f" {'/'.join(mb(r['replay_rss_growth']) for r in replay)} MB above the start, run by run). The units are then"
        " built from those pieces: each unit's shard is allocated and filled from the pieces, which are dropped as"
        f" they are read, so one unit's shard (the largest, the root's embeddings, norm and lm_head: {mb(unit)} MB on a"
        " rank) sits beside the pieces not yet read.",
        f"- Block-wise: {peak(default_block)} MB with the default allocator, {peak(fixed_block)} MB with the fixed"
        " threshold: a unit's full parameters are materialized and initialized on every rank, copied into the unit's"
        " full flat buffer, and the shard kept; the root unit (embeddings and lm_head, both whole) is the largest.",
    ]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results_replay_init.md"))
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # internal, with --rank-run
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)  # internal: the lzero ranks write their JSON here
    args = parser.parse_args()
    if args.rank_run:
        run_rank(args.way, args.layers, Path(args.rank_run))
        return
    start = time.perf_counter()
    results = Path("/tmp/lzero-bench-replay-init-results")
    rows = []
    for env in ({}, {THRESHOLD: FIXED}):
        for way in WAYS:
            rows += run_lzero(way, args.layers, results, env)
            print(json.dumps(rows[-2:]), flush=True)
        rows.append(run_eager(args.layers, env))
        print(json.dumps(rows[-1]), flush=True)
    command = "python benchmarks/bench_replay_init.py" + (f" --layers {args.layers}" if args.layers != 24 else "")
    print(write_table(rows, args.layers, Path(args.out), command, time.perf_counter() - start))


if __name__ == "__main__":
    main()
