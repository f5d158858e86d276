"""Materializing a model built on the meta device at world size 2 under lzero zero3: memory and time per rank.

    python -m benchmarks.loading.bench_replay_init [--layers 24] [--out PATH]
    # default: results/loading/replay_init.<machine>.<date>.md

A Hugging Face Llama built from its config (no files): 24 x 1024, MLP 2816, 16 heads / 8 KV heads, vocabulary 32000,
lm_head untied, fp32 (about 349M parameters, 1.39 GB), ``torch.manual_seed(0)`` then
``AutoModelForCausalLM.from_config``. Each way of getting its weights:

- ``lzero zero3 replay``: ``Trainer(strategy="zero3", devices=2)`` on 2 gloo ranks, the model built in
  ``configure_model`` (on the meta device, its construction recorded); the strategy's setup replays the record from
  rank 0's RNG state, each rank keeping its shards ([Note: replayed construction] in lzero/engine/replay.py);
- ``lzero zero3 block-wise``: the same, with ``lzero.engine.replayed_weights.recorder_for`` patched in the rank
  processes to find no recording, so the engine warns and initializes block by block ([Note: meta-device initialization] in
  lzero/engine/materialize.py): other random draws than eager construction;
- ``eager``: ``from_config`` on the CPU in one process: what each DDP rank does;
- ``lzero zero3 replay, also seeded before fit`` (a diagnostic, default allocator only): ``torch.manual_seed(0)``
  before ``trainer.fit`` as well: whether the seed set in ``configure_model`` alone is the one the replay honours.

Per process (one thread each): wall time and peak resident-memory growth of the materialization (``VmHWM`` reset
through ``/proc/self/clear_refs`` just before, minus ``VmRSS`` then; lzero: from the end of ``configure_model`` to
``on_fit_start``, i.e. the strategy's setup that builds the engine; eager: the ``from_config`` call), and the bytes
the rank holds after (the engine units' shards plus the buffers; eager: every parameter and buffer). After the
measurement, rank 0 builds the model eagerly from the same seed and compares it, tensor by tensor with
``torch.equal``, with the lzero model gathered through ``trainer.strategy.gathered_parameters`` (a collective: both
ranks enter it). The lzero ways and eager construction run twice: with glibc's default allocator, and with
``MALLOC_MMAP_THRESHOLD_=65536``.
The lzero ranks run in a child process (``--rank-run``), where Lightning launches rank 1 by re-running this module
with the same arguments.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import ctypes
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (FIXED, REPO, THRESHOLD, WORLD_SIZE, module_command, module_env, out_path, proc_bytes,
                               reset_peak, run_header, run_spawned, write_report)

SEED = 0
BLOCKWISE = "benchmark: block-wise"
WAYS = ("replay", "block-wise", "replay-seeded")
SEEDED = "replay-seeded"  # a diagnostic: torch.manual_seed(0) before trainer.fit as well


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


def _trimmed_rss(rss0: int) -> int:
    """``VmRSS`` minus ``rss0`` after glibc's ``malloc_trim(0)``: what the heap held free is given back (a diagnostic,
    after the measurement)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return proc_bytes("VmRSS") - rss0


def _way_name(way: str) -> str:
    name = "replay, also seeded before fit" if way == SEEDED else way
    return f"lzero zero3 {name}" + (f" ({THRESHOLD}={os.environ[THRESHOLD]})" if THRESHOLD in os.environ else "")


# --- lzero zero3: the ranks Lightning launches ------------------------------------------------------------------

def run_rank(way: str, layers: int, results: Path) -> None:
    """This rank's part of ``Trainer(strategy="zero3").fit``: one JSON file of measures in ``results``."""
    import lightning as L
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset
    from transformers.utils import logging as hf_logging

    import lzero  # noqa: F401  registers zero3
    from lzero.engine import replayed_weights

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    if way == "block-wise":
        # the engine warns, goes block by block
        replayed_weights.recorder_for = lambda tensors, names=None, among=None: (None, BLOCKWISE)
    seen: dict[str, object] = {}
    from_replay = replayed_weights.from_replay

    def timed_replay(*args: object, **kwargs: object) -> object:
        """The replay itself (or the refusal to replay), timed, and the memory it leaves."""
        start = time.perf_counter()
        source, why = from_replay(*args, **kwargs)
        replayed = getattr(source, "_replay", None)
        # what the replay hands the engine: its pieces of the unit parameters (or, where lzero builds them there,
        # the units' shards) and the tensors outside the units, whole
        kept = {"pieces": getattr(replayed, "pieces", None), "shards": getattr(source, "_shards", None)}
        held = _nbytes([t for d in [*kept.values(), getattr(replayed, "whole", None)] if d for t in d.values()])
        record = getattr(replayed, "record", None)
        seen.update(replayed=source is not None, why=why, replay_seconds=time.perf_counter() - start,
                    replay_peak=proc_bytes("VmHWM"), replay_rss=proc_bytes("VmRSS"), pieces=held,
                    kept=next((k for k, d in kept.items() if d is not None), None),
                    entries=len(record.entries) if record is not None else 0)
        return source, why

    replayed_weights.from_replay = timed_replay
    before: dict[str, float] = {}

    class Model(L.LightningModule):
        def configure_model(self) -> None:
            before.update(configure_start=time.perf_counter(), initial_seed=torch.initial_seed(),
                          rng_at_open=int(torch.get_rng_state().sum()))  # the state the record takes (diagnostic)
            self.net = build(layers)
            before.update(configure_seconds=time.perf_counter() - before["configure_start"])
            reset_peak()  # the engine's setup starts next (strategy.setup)
            before.update(rss=proc_bytes("VmRSS"), start=time.perf_counter())

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            loss = self.net(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Measure(Callback):
        def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            seconds = time.perf_counter() - before["start"]
            hwm, rss = proc_bytes("VmHWM"), proc_bytes("VmRSS")
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
                "pieces": seen.get("pieces"), "kept": seen.get("kept"), "initial_seed": before["initial_seed"],
                "rng_at_open": before["rng_at_open"], "trimmed_growth": _trimmed_rss(before["rss"]),
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
    if way == SEEDED:
        torch.manual_seed(SEED)  # the RNG state lzero's meta context takes when it opens
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
    done = subprocess.run(module_command(__spec__.name, "--layers", layers, "--way", way, "--rank-run", results),
                          capture_output=True, text=True, timeout=600, env=module_env(**env))
    if done.returncode != 0:
        sys.exit(f"lzero zero3 {way} ranks failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    warned = BLOCKWISE in done.stderr or BLOCKWISE in done.stdout
    rows = [json.loads((results / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for row in rows:
        row["warned"] = warned
    return rows


# --- eager construction: one process holding the whole model ------------------------------------------------------

def _eager(layers: int, queue: object) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    # the Llama code imported and a tiny model built before the window, as the lzero ranks' configure_model has
    AutoModelForCausalLM.from_config(llama_config(1).__class__(hidden_size=64, intermediate_size=128,
                                                                num_hidden_layers=1, num_attention_heads=4,
                                                                num_key_value_heads=2, vocab_size=128))
    reset_peak()
    rss0 = proc_bytes("VmRSS")
    start = time.perf_counter()
    model = build(layers)
    seconds = time.perf_counter() - start
    params = list(model.parameters())
    way = "eager (from_config on the CPU)" + (f" ({THRESHOLD}={os.environ[THRESHOLD]})" if THRESHOLD in os.environ
                                              else "")
    queue.put({"way": way, "rank": "-", "seconds": seconds, "peak_growth": proc_bytes("VmHWM") - rss0,
               "end_growth": proc_bytes("VmRSS") - rss0, "trimmed_growth": _trimmed_rss(rss0),
               "shards": _nbytes(params), "buffers": _nbytes(model.buffers()), "params": sum(p.numel() for p in params),
               "largest_tensor": max(p.numel() * p.element_size() for p in params)})


def run_eager(layers: int, env: dict[str, str]) -> dict:
    return run_spawned(_eager, (layers,), env)


# --- the table ---------------------------------------------------------------------------------------------------

def lzero_version() -> dict:
    """The lzero the run measured: its commit, the files changed since, and a hash of every source file's content
    (compared at the end of the run: another process may edit the tree meanwhile)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    content = hashlib.sha256()
    for f in sorted((REPO / "lzero").rglob("*.py")):
        content.update(str(f.relative_to(REPO)).encode() + f.read_bytes())
    return {"commit": git("rev-parse", "--short", "HEAD"), "hash": content.hexdigest()[:12], "load": os.getloadavg()[0],
            "changed": [line[3:] for line in git("status", "--porcelain", "--", "lzero").splitlines()]}


README = "[benchmarks/loading/README.md](../../loading/README.md)"  # how each figure is measured, from results/loading
mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f}"  # noqa: E731
each = lambda rs, key="peak_growth": "/".join(mb(r[key]) for r in rs)  # noqa: E731  ranks 0/1


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows by way: the lzero ways (``replay``, ``seeded``, ``block`` with the default allocator, ``replay fixed``
    and ``block fixed`` with the fixed mmap threshold), all lzero rows, those that replayed, and the eager ones."""
    lz = [r for r in rows if r["way"].startswith("lzero")]
    group = lambda way: [r for r in lz if r["way"] == way]  # noqa: E731
    fixed = f" ({THRESHOLD}={FIXED})"
    return {"replay": group(_way_name("replay")), "replay fixed": group(_way_name("replay") + fixed),
            "seeded": group(_way_name(SEEDED)), "block": group(_way_name("block-wise")),
            "block fixed": group(_way_name("block-wise") + fixed), "lzero": lz,
            "replayed": [r for r in lz if r["replayed"]],
            "eager": [r for r in rows if not r["way"].startswith("lzero")]}


def _target(groups: dict[str, list[dict]]) -> tuple[float, float, float]:
    """(held bytes of a replay rank, largest tensor, the target peak 1.1 x (held + largest))."""
    held = groups["replayed"][0]["shards"] + groups["replayed"][0]["buffers"]
    largest = groups["eager"][0]["largest_tensor"]
    return held, largest, 1.1 * (held + largest)


def _run_lines(command: str, wall: float, version: dict, version_after: dict) -> list[str]:
    same = version_after["hash"] == version["hash"]
    return [run_header("transformers"), "",
            f"- command: `{command}`", f"- wall time: {wall / 60:.1f} min",
            f"- lzero commit: {version['commit']}",
            f"- uncommitted changes to lzero: {', '.join(version['changed']) or 'none'}",
            f"- lzero source hash: {version['hash']}, "
            + ("unchanged through the run" if same else f"**changed during the run** to {version_after['hash']}"),
            f"- load average (1 min), start/end: {version['load']:.1f}/{version_after['load']:.1f}"]


def _setup_lines(groups: dict[str, list[dict]], layers: int) -> list[str]:
    eager = groups["eager"][0]
    held, largest, target = _target(groups)
    return [f"- model: Llama from_config, {layers} x 1024, MLP 2816, 16 heads / 8 KV heads, vocabulary 32000,"
            f" lm_head untied, fp32, seed {SEED}",
            f"- parameters: {eager['params'] / 1e6:,.1f}M, {mb(eager['shards'])} MB",
            f"- lzero: zero3, {WORLD_SIZE} gloo ranks, one thread each, precision 32-true, SGD lr 0, one step on"
            " 2 x 32 tokens",
            f"- allocator: glibc default; {THRESHOLD}={FIXED}",
            f"- largest tensor (embed_tokens, lm_head): {mb(largest)} MB",
            f"- target, peak RSS growth per replay rank: <= 1.1 x (held {mb(held)} + largest {mb(largest)})"
            f" = {mb(target)} MB"]


def _table_lines(rows: list[dict], largest: float, target: float) -> list[str]:
    lines = ["| way | rank | path | time s | of which replay s | peak RSS growth MB | RSS growth after MB |"
             " after malloc_trim MB | held MB | peak / (held + largest) | RSS growth after replay MB |"
             " configure_model s | equals eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lz, replayed = r["way"].startswith("lzero"), r.get("replayed")
        ratio = f"{r['peak_growth'] / (r['shards'] + r['buffers'] + largest):.2f}"
        verdict = f" {'pass' if r['peak_growth'] <= target else '**FAIL**'}" if replayed else ""
        path = (f"replay ({r['entries']:,} ops)" if replayed else
                "block-wise" + (" (warned)" if r.get("warned") else "")) if lz else "-"
        equal = "-" if not lz else "(rank 0 checks)" if r["rank"] != 0 else _equal(r)
        lines.append(
            f"| {r['way']} | {r['rank']} | {path} | {r['seconds']:.1f} |"
            f" {format(r['replay_seconds'], '.1f') if replayed else '-'} | {mb(r['peak_growth'])} |"
            f" {mb(r['end_growth'])} | {mb(r['trimmed_growth'])} | {mb(r['shards'] + r['buffers'])} |"
            f" {ratio}{verdict} | {mb(r['replay_rss_growth']) if replayed else '-'} |"
            f" {format(r['configure_seconds'], '.1f') if lz else '-'} | {equal} |")
    return lines


def _memory_lines(groups: dict[str, list[dict]]) -> list[str]:
    """The target's verdict and the peaks, in MB, ranks 0/1."""
    held, largest, target = _target(groups)
    replayed, fixed = groups["replayed"], groups["replay fixed"]
    failed = [f"rank {r['rank']} of `{r['way']}`" for r in replayed if r["peak_growth"] > target]
    return [f"- target met: {'yes' if not failed else '**no**, ' + '; '.join(failed)}"
            f" ({len(replayed) - len(failed)} of {len(replayed)} replay rows within)",
            f"- peak RSS growth, replay: {each(groups['replay'])} MB; seeded before fit {each(groups['seeded'])} MB;"
            f" {THRESHOLD}={FIXED} {each(fixed)} MB",
            f"- peak RSS growth, block-wise: {each(groups['block'])} MB; {THRESHOLD}={FIXED}"
            f" {each(groups['block fixed'])} MB (held + 4 x largest = {mb(held + 4 * largest)} MB)",
            f"- peak RSS growth, eager, default/{THRESHOLD}={FIXED}: {each(groups['eager'])} MB",
            f"- peak - held, replay, {THRESHOLD}={FIXED}: {'/'.join(mb(r['peak_growth'] - held) for r in fixed)} MB",
            f"- peak gap between ranks, replay, {THRESHOLD}={FIXED}:"
            f" {mb(abs(fixed[0]['peak_growth'] - fixed[-1]['peak_growth']))} MB (half the largest: {mb(largest / 2)})",
            "- peak default - fixed, replay: "
            + "/".join(mb(d["peak_growth"] - f["peak_growth"]) for d, f in zip(groups["replay"], fixed)) + " MB",
            f"- RSS growth after, replay: {each(groups['replay'], 'end_growth')} MB; seeded"
            f" {each(groups['seeded'], 'end_growth')} MB; after malloc_trim"
            f" {each(groups['replay'], 'trimmed_growth')} MB, seeded {each(groups['seeded'], 'trimmed_growth')} MB",
            f"- replay keeps: {replayed[0].get('kept')}; holds {mb(replayed[0]['pieces'])} MB when from_replay returns",
            f"- RSS growth after replay: {THRESHOLD}={FIXED} {each(fixed, 'replay_rss_growth')} MB; seeded"
            f" {each(groups['seeded'], 'replay_rss_growth')} MB",
            f"- largest unit shard per rank: {mb(max(r['largest_unit'] for r in groups['lzero']))} MB"]


def _equal(r: dict) -> str:
    """Rank 0's comparison with eager construction: equal or how many tensors differ."""
    if r["differ"] == 0:
        return f"yes ({r['compared']}/{r['compared']} tensors)"
    return f"no ({r['differ']}/{r['compared']} tensors differ)"


def _equality_lines(groups: dict[str, list[dict]]) -> list[str]:
    """Equality with eager construction (rank 0 checks), the seeds, the RNG, the losses and the times."""
    rank0 = {r["way"]: r for r in groups["lzero"] if r["rank"] == 0}
    by_way = lambda show: "; ".join(f"{w}: {show(r)}" for w, r in rank0.items())  # noqa: E731
    equal = lambda way: _equal(rank0[groups[way][0]["way"]])  # noqa: E731
    unseeded = [r["initial_seed"] for r in groups["lzero"] if r not in groups["seeded"]]
    seconds = lambda rs: f"{min(r['seconds'] for r in rs):.1f}-{max(r['seconds'] for r in rs):.1f}"  # noqa: E731
    loss = lambda r: "/".join(f"{o['loss'][0]:.4f}" for o in groups["lzero"] if o["way"] == r["way"])  # noqa: E731
    return [f"- replay equals eager, seed in configure_model only: {equal('replay')}",
            f"- replay equals eager, also seeded before fit: {equal('seeded')}",
            f"- block-wise equals eager: {equal('block')}",
            "- layer 0 alone gives the same answer: "
            + ("yes, every way" if all(r["layer0_equal"] == (r["differ"] == 0) for r in rank0.values()) else
               by_way(lambda r: r["layer0_equal"])),
            f"- largest absolute difference, rank 0: {by_way(lambda r: format(r['max_abs_diff'], '.3g'))}",
            f"- RNG at on_fit_start equal to eager's: {by_way(lambda r: 'yes' if r['rng_equal'] else 'no')}",
            f"- torch.initial_seed() at configure_model, processes not seeded before fit: {len(set(unseeded))}"
            f" distinct of {len(unseeded)}",
            f"- loss, ranks 0/1: {by_way(loss)}",
            f"- time: replay {seconds(groups['replayed'])} s, eager {seconds(groups['eager'])} s"]


def write_table(rows: list[dict], layers: int, out: Path | None, command: str, wall: float, version: dict,
                version_after: dict) -> str:
    groups = _groups(rows)
    _, largest, target = _target(groups)
    lines = ["# Materializing a meta-device model at world size 2 (benchmarks.loading.bench_replay_init)", "",
             *_run_lines(command, wall, version, version_after), "", "## Setup", "",
             *_setup_lines(groups, layers), "", "## Results", "", f"How each figure is measured: {README}.", "",
             *_table_lines(rows, largest, target), "", "## Figures", "", *_memory_lines(groups),
             *_equality_lines(groups)]
    text = "\n".join(lines) + "\n"
    if out is not None:
        write_report(out, text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out", default=None, help="markdown file, a result name, or none (default:"
                        " results/loading/replay_init.<machine>.<date>.md)")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # internal, with --rank-run
    parser.add_argument("--rank-run", help=argparse.SUPPRESS)  # internal: the lzero ranks write their JSON here
    args = parser.parse_args()
    if args.rank_run:
        run_rank(args.way, args.layers, Path(args.rank_run))
        return
    start, version = time.perf_counter(), lzero_version()
    results = Path("/tmp/lzero-bench-replay-init-results")
    rows = []
    for env in ({}, {THRESHOLD: FIXED}):
        for way in WAYS if not env else WAYS[:2]:
            rows += run_lzero(way, args.layers, results, env)
            print(json.dumps(rows[-2:]), flush=True)
        rows.append(run_eager(args.layers, env))
        print(json.dumps(rows[-1]), flush=True)
    command = f"python -m {__spec__.name}" + (f" --layers {args.layers}" if args.layers != 24 else "")
    print(write_table(rows, args.layers, out_path(args.out, "loading", "replay_init"), command,
                      time.perf_counter() - start, version, lzero_version()))


if __name__ == "__main__":
    main()
