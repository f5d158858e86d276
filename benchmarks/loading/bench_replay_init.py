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


def _where(path: str, snippet: str) -> str:
    """``path:line`` of the first line of lzero's source holding ``snippet`` (``path`` when none does)."""
    source = REPO / path
    for number, line in enumerate(source.read_text().splitlines() if source.exists() else [], 1):
        if snippet in line:
            return f"{path}:{number}"
    return path


def write_table(rows: list[dict], layers: int, out: Path | None, command: str, wall: float, version: dict,
                version_after: dict) -> str:
    eager = next(r for r in rows if r["way"].startswith("eager"))
    params, largest = eager["params"], eager["largest_tensor"]
    mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f}"  # noqa: E731
    lz = [r for r in rows if r["way"].startswith("lzero")]
    replay = [r for r in lz if r["replayed"]]
    group = lambda way: [r for r in lz if r["way"] == way]  # noqa: E731
    plain, fixed = group(_way_name("replay")), group(_way_name("replay") + f" ({THRESHOLD}={FIXED})")
    seeded = group(_way_name(SEEDED))
    block, block_fixed = group(_way_name("block-wise")), group(_way_name("block-wise") + f" ({THRESHOLD}={FIXED})")
    held = replay[0]["shards"] + replay[0]["buffers"]
    target = 1.1 * (held + largest)

    def check(r: dict) -> str:
        ratio = f"{r['peak_growth'] / (r['shards'] + r['buffers'] + largest):.2f}"
        if not r.get("replayed"):
            return ratio
        return f"{ratio} {'pass' if r['peak_growth'] <= target else '**FAIL**'}"

    def equal(r: dict) -> str:
        if r["rank"] != 0:
            return "(rank 0 checks)"
        if r["differ"] == 0:
            return f"yes ({r['compared']}/{r['compared']} tensors)"
        return f"no ({r['differ']}/{r['compared']} tensors differ)"

    def path(r: dict) -> str:
        if r["replayed"]:
            return f"replay ({r['entries']:,} ops)"
        return "block-wise" + (" (warned)" if r.get("warned") else "")

    peak = lambda rs: "/".join(mb(r["peak_growth"]) for r in rs)  # noqa: E731
    each = lambda rs, key: "/".join(mb(r[key]) for r in rs)  # noqa: E731
    losses = lambda way: "/".join(format(r["loss"][0], ".4f") for r in group(way))  # noqa: E731
    changed = f", with uncommitted changes to {', '.join(version['changed'])}" if version["changed"] else ""
    lines = [
        "# Materializing a meta-device model at world size 2 (benchmarks.loading.bench_replay_init)",
        "",
        run_header("transformers"),
        "",
        f"`{command}`, {wall / 60:.1f} minutes in all, lzero at commit {version['commit']}{changed} (source hash"
        f" {version['hash']}"
        + (", unchanged through the run)." if version_after["hash"] == version["hash"] else
           f"; **lzero's source changed during the run**, to {version_after['hash']}: the rows may mix versions).")
        + f" Load average (1 min) {version['load']:.1f} at the start, {version_after['load']:.1f} at the end (other"
        " work on the machine shows in the times)."
        " Model: a Hugging Face Llama from its config, no files:"
        " `AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=1024, intermediate_size=2816,"
        f" num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,"
        " tie_word_embeddings=False))` after `torch.manual_seed(0)`, fp32:"
        f" {params / 1e6:,.1f}M parameters, {mb(eager['shards'])} MB. lzero zero3: N = {WORLD_SIZE} gloo ranks, one"
        " thread each, `Trainer(accelerator=\"cpu\", devices=2, strategy=\"zero3\", precision=\"32-true\","
        " max_steps=1)`, the model built in `configure_model` (seed included), SGD lr 0, one step on 2 x 32 token"
        " ids. The lzero ways run twice: with glibc's default allocator settings, and with"
        f" `{THRESHOLD}={FIXED}` (no dynamic mmap threshold: every allocation above 64 KiB is mapped and unmapped"
        " whole, so RSS follows the live tensors, not freed memory the heap keeps); so does eager construction."
        " One more row, a diagnostic, seeds before `trainer.fit` too (see below).",
        "",
        f"Largest single tensor: embed_tokens or lm_head, 32000 x 1024 fp32 = {mb(largest)} MB. Target per lzero"
        " replay rank: peak RSS growth <= 1.1 x (the rank's held bytes + the largest tensor)"
        f" = 1.1 x ({mb(held)} + {mb(largest)}) = {mb(target)} MB.",
        "",
        "| way | rank | path | time s | of which replay s | peak RSS growth MB | RSS growth after MB |"
        " after malloc_trim MB | held MB | peak / (held + largest) | RSS growth after replay MB |"
        " configure_model s | equals eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        is_lzero = r["way"].startswith("lzero")
        lines.append(
            f"| {r['way']} | {r['rank']} | {path(r) if is_lzero else '-'} | {r['seconds']:.1f} |"
            f" {format(r['replay_seconds'], '.1f') if r.get('replayed') else '-'} | {mb(r['peak_growth'])} |"
            f" {mb(r['end_growth'])} | {mb(r['trimmed_growth'])} | {mb(r['shards'] + r['buffers'])} | {check(r)} |"
            f" {mb(r['replay_rss_growth']) if r.get('replayed') else '-'} |"
            f" {format(r['configure_seconds'], '.1f') if is_lzero else '-'} |"
            f" {equal(r) if is_lzero else '-'} |")
    rank0 = {r["way"]: r for r in lz if r["rank"] == 0}
    failed = [r for r in replay if r["peak_growth"] > target]
    verdict = "met" if not failed else "**missed**" + (
        "" if len(failed) == len(replay) else
        f" by {len(failed)} of {len(replay)} replay rows: "
        + "; ".join(f"rank {r['rank']} of `{r['way']}`" for r in failed))
    unseeded = [r["initial_seed"] for r in lz if r not in seeded]
    seeds = (f"a different value in each of the {len(unseeded)} rank processes not seeded before fit"
             if len(set(unseeded)) == len(unseeded) else f"{len(set(unseeded))} values in {len(unseeded)} processes")
    lines += [
        "",
        "How each figure is measured:",
        "- *time*: lzero: `time.perf_counter()` from the end of `configure_model` (the model laid out on the meta"
        " device, its construction recorded) to the first `on_fit_start` callback, i.e. the strategy's setup, which"
        " builds the engine and materializes the model into shards; eager: the `from_config` call (the Llama code"
        " imported and a tiny Llama built first, as the lzero ranks have by then). *of which replay*: the call to"
        " `lzero.engine.replayed_weights.from_replay` (wrapped by the benchmark), which runs the record and keeps this"
        " rank's values; the rest of the window builds the units from them. *configure_model*: the meta-device"
        " construction with its recording.",
        "- *peak RSS growth*: `VmHWM` at the end of the window minus `VmRSS` at its start, the high-water mark reset"
        " through `/proc/self/clear_refs` at the start (`benchmarks.common.reset_peak`). *RSS growth after*:"
        " `VmRSS` at the end minus the same start. *after malloc_trim*: the same once glibc's `malloc_trim(0)` has"
        " returned the free memory its heap keeps (a diagnostic, after the measurement). *RSS growth after replay*:"
        " `VmRSS` when `from_replay` returns, holding what the replay hands the engine.",
        "- *held*: lzero: the engine's units at `on_fit_start` (`trainer.strategy.engine.units`), sum of"
        " `spec.shard_numel x flat_param.element_size()`, plus the module's buffers (the rotary `inv_freq`, whole on"
        " each rank, 256 B); eager: every parameter and buffer.",
        "- *path*: the engine replayed the record (its number of recorded operations), or initialized block by"
        " block: the block-wise rows patch `lzero.engine.replayed_weights.recorder_for` to"
        f" `lambda tensors: (None, \"{BLOCKWISE}\")` in the rank processes (\"warned\": the engine's warning with that"
        " reason was on stderr).",
        "- *equals eager*: after the measurement, rank 0 builds the model with `from_config` after"
        " `torch.manual_seed(0)` in the same process, the lzero model is gathered whole inside"
        " `trainer.strategy.gathered_parameters(module.net)` (a collective: both ranks enter it), and every parameter"
        " and buffer is compared with `torch.equal` (bitwise); layer 0's alone gives"
        + (" the same answer in every run" if all(r["layer0_equal"] == (r["differ"] == 0) for r in rank0.values())
           else " another answer: " + "; ".join(f"{w}: {r['layer0_equal']}" for w, r in rank0.items()))
        + ". Largest absolute difference, rank 0: "
        + "; ".join(f"{w}: {r['max_abs_diff']:.3g}" for w, r in rank0.items()) + ". Global RNG at `on_fit_start`"
        " equal to where eager construction leaves it: "
        + "; ".join(f"{w}: {'yes' if r['rng_equal'] else 'no'}" for w, r in rank0.items()) + ".",
        "- Loss of the one training step, ranks 0/1: "
        + "; ".join(f"{w}: {losses(w)}" for w in rank0) + ".",
        "",
        "Results:",
        f"- Replay, the target: {verdict}. Peak {peak(plain)} MB (ranks 0/1) with the default"
        f" allocator ({peak(seeded)} MB in the seeded run), {peak(fixed)} MB with `{THRESHOLD}={FIXED}`, against"
        f" {mb(target)} MB. Block-wise initialization peaks at {peak(block)} / {peak(block_fixed)} MB, eager"
        f" construction (every DDP rank) at {mb(eager['peak_growth'])} MB.",
        "- Replayed weights equal eager: "
        + (f"**yes**, bitwise, all {rank0[plain[0]['way']]['compared']} tensors, with the seed in `configure_model`"
           " as specified" if rank0[plain[0]['way']]["differ"] == 0 else
           f"**no** as specified (seed in `configure_model`): {rank0[plain[0]['way']]['differ']}/"
           f"{rank0[plain[0]['way']]['compared']} tensors differ, every randomly drawn one (the norms' ones and the"
           " rotary buffers agree)")
        + ("; **yes**, bitwise," if rank0[seeded[0]["way"]]["differ"] == 0 else "; **no**, still,")
        + " when `torch.manual_seed(0)` also runs before `trainer.fit`. Block-wise differs, as documented.",
        "",
        "Where the bytes go (replay, ranks 0/1):",
    ]
    kept = replay[0].get("kept")
    pieces_then_shards = kept == "pieces"
    lines.append(
        "- The replay runs the whole record on every rank (nn.Linear's `uniform_` draw of every weight, then"
        " `post_init`'s `normal_` redraw), a storage per version, and keeps this rank's values of each tensor's"
        " final version: "
        + ("cloned pieces, which the engine then copies into each unit's shard, allocated as the unit is built"
           f" (`shard_values`, {_where('lzero/engine/materialize.py', 'values = torch.empty(spec.shard_numel')})"
           " and drops as read; the root unit (embed_tokens, norm, lm_head:"
           f" a {mb(max(r['largest_unit'] for r in lz))} MB shard per rank) comes last, so the pieces and a copy of"
           f" the largest unit's shard coexist: held + {mb(max(r['largest_unit'] for r in lz))} MB at least." if
           pieces_then_shards else
           "written into the units' shards, allocated before the replay starts; the tensors outside the units are"
           " kept whole.")
        + f" When `from_replay` returns it holds {mb(replay[0]['pieces'])} MB; RSS is then"
        f" {each(fixed, 'replay_rss_growth')} MB above the start with the fixed threshold"
        f" ({each(seeded, 'replay_rss_growth')} MB, seeded run, default allocator). With the fixed threshold the peak"
        f" is held + {'/'.join(mb(r['peak_growth'] - held) for r in fixed)} MB: every rank materializes each"
        f" tensor whole, one at a time, so the largest ({mb(largest)} MB) sits beside the shards while this rank's"
        " part of it is copied out.")
    gap = fixed[0]["peak_growth"] - fixed[1]["peak_growth"] if len(fixed) == 2 else 0.0
    if abs(gap) > largest / 2:
        lines.append(
            f"- With the fixed threshold the ranks' peaks differ by {mb(abs(gap))} MB, more than half the largest"
            " tensor: one rank holds one more version of a large tensor at its peak than the other.")
    over = [(d, f) for d, f in zip(plain, fixed) if d["peak_growth"] - f["peak_growth"] > 5e6]
    if over:
        lines.append(
            "- Default allocator: the same peak plus"
            f" {'/'.join(mb(d['peak_growth'] - f['peak_growth']) for d, f in over)} MB (ranks 0/1), freed memory"
            " glibc's heap keeps, not live tensors: RSS after the window is"
            f" {each(plain, 'end_growth')} MB ({each(seeded, 'end_growth')} seeded) for {mb(held)} MB held, and"
            f" {each(plain, 'trimmed_growth')} MB ({each(seeded, 'trimmed_growth')}) once `malloc_trim(0)` has run."
            " glibc raises its mmap threshold to the size of a freed mapped block (up to 32 MB): once the first"
            " layer weights are freed, the versions of every layer weight"
            + (" and every cloned piece (half a weight)" if pieces_then_shards else "")
            + " come from the brk heap, and what is freed below memory still live stays there.")
    if rank0[plain[0]["way"]]["differ"] and not rank0[seeded[0]["way"]]["differ"]:
        lines.append(
            "- Seed: with `torch.manual_seed(0)` in `configure_model` alone the replayed weights differ from eager;"
            " seeded before `trainer.fit` as well they equal it, so the replay did not start from the state"
            " `configure_model` set (`torch.initial_seed()` at the start of `configure_model`:"
            f" {seeds}). Eager construction and DDP honour that seed.")
    lines += [
        f"- Block-wise ({peak(block_fixed)} MB, fixed threshold): held + the root unit's full parameters"
        f" materialized (embed_tokens and lm_head, {mb(2 * largest)} MB) + the unit's full flat buffer they are"
        f" copied into ({mb(2 * largest)} MB), on every rank.",
        "- Time: the replay draws every number of the model on every rank, as eager construction does, plus the"
        " copies into the shards and the page faults of fresh storage for every version:"
        f" {min(r['seconds'] for r in replay):.1f}-{max(r['seconds'] for r in replay):.1f} s against"
        f" {min(r['seconds'] for r in rows if not r['way'].startswith('lzero')):.1f}-"
        f"{max(r['seconds'] for r in rows if not r['way'].startswith('lzero')):.1f} s for eager construction.",
    ]
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
