"""``lzero.memory.estimate`` and ``lzero estimate``: the ZeRO paper's example (Ψ = 7.5e9, N = 64, mixed-precision Adam:
120 / 31.4 / 16.6 / 1.9 GB), lzero's own layout and the offload rows against hand arithmetic, a 1.5B-parameter
demo GPT counted on the meta device without memory, the estimate against lzero's measured accounting of real
engines, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer
from lzero.cli import main
from lzero.memory.estimate import ModelCount, count_parameters, estimate, model_states
from lzero.memory.accounting import model_state_bytes
from lzero.engine.mixed_precision import PrecisionPolicy

PSI, N = 7_500_000_000, 64
PAPER_GB = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
ROOT = Path(__file__).resolve().parents[2]


def rows_by_name(**kwargs) -> dict:
    return {row.strategy: row for row in estimate(ModelCount(PSI), **kwargs)}


def test_paper_example_from_the_function() -> None:
    rows = rows_by_name(num_gpus=N)
    exact = {"ddp": (2 + 2 + 12) * PSI, "zero1": 4 * PSI + 12 * PSI / N, "zero2": 2 * PSI + 14 * PSI / N,
             "zero3": 16 * PSI / N}  # 120e9, 31.40625e9, 16.640625e9, 1.875e9
    for name, formula in exact.items():
        assert rows[name].paper_bytes == formula
        assert round(rows[name].paper_bytes / 1e9, 1) == PAPER_GB[name]


def test_lzero_layout_keeps_fp32_gradient_shards() -> None:
    """Mixed precision: lzero reduces into fp32 shard gradients (4Ψ/N where the paper counts 2Ψ/N)."""
    rows = rows_by_name(num_gpus=N)
    assert rows["ddp"].per_device == 4 * PSI + 4 * PSI + 8 * PSI  # Lightning's DDP: fp32 params and grads
    assert rows["zero1"].per_device == 2 * PSI + 2 * PSI + (4 + 4 + 8) * PSI / N  # 31.875e9
    assert rows["zero2"].per_device == 2 * PSI + (4 + 4 + 8) * PSI / N  # 16.875e9
    assert rows["zero3"].per_device == (2 + 4 + 4 + 8) * PSI / N  # 2.109375e9
    fp32 = rows_by_name(num_gpus=N, precision="32-true")  # the master is the parameter: paper == lzero
    assert [fp32[s].per_device for s in ("ddp", "zero1", "zero2", "zero3")] == \
        [16 * PSI, 8 * PSI + 8 * PSI / N, 4 * PSI + 12 * PSI / N, 16 * PSI / N]
    assert all(fp32[s].per_device == fp32[s].paper_bytes for s in ("ddp", "zero1", "zero2", "zero3"))


def test_offload_rows_by_hand() -> None:
    rows = rows_by_name(num_gpus=8, num_nodes=8)  # N = 64, 8 ranks per node
    # zero2_offload: bf16 parameters on the device; per rank in host memory fp32 grads 4 + masters 4 + Adam 8 per
    # element of Ψ/N; a node holds 8 ranks' shares
    assert (rows["zero2_offload"].per_device, rows["zero2_offload"].per_host) == (2 * PSI, 8 * 16 * PSI / N)
    # zero3_offload: nothing on the device; host: bf16 shard 2 + grads 4 + masters 4 + Adam 8
    assert (rows["zero3_offload"].per_device, rows["zero3_offload"].per_host) == (0, 8 * 18 * PSI / N)
    # zero3_offload_nvme: masters and Adam (12) in files; grads (4) in host memory, and the bf16 parameter shards
    # too (Ψ/N = 117,187,500 elements per rank is within the default max_in_cpu of 1e9)
    nvme = rows["zero3_offload_nvme"]
    assert (nvme.per_device, nvme.per_host, nvme.per_nvme) == (0, 8 * 6 * PSI / N, 8 * 12 * PSI / N)
    nvme = rows_by_name(num_gpus=8, num_nodes=8, max_in_cpu=0)["zero3_offload_nvme"]  # parameter shards to files
    assert (nvme.per_host, nvme.per_nvme) == (8 * 4 * PSI / N, 8 * 14 * PSI / N)
    fp32 = rows_by_name(num_gpus=8, num_nodes=8, precision="32-true")
    # fp32 zero2_offload: fp32 parameters on the device, a separate fp32 master in host memory
    assert (fp32["zero2_offload"].per_device, fp32["zero2_offload"].per_host) == (4 * PSI, 8 * 16 * PSI / N)
    # fp32 zero3_offload: the host parameter shard is the master: 4 + grads 4 + Adam 8
    assert fp32["zero3_offload"].per_host == 8 * 16 * PSI / N
    half = rows_by_name(num_gpus=8, num_nodes=8, offload_ratio=0.5)["zero2_offload"]
    assert (half.per_device, half.per_host) == (2 * PSI + 0.5 * 16 * PSI / N, 8 * 0.5 * 16 * PSI / N)
    sgd = rows_by_name(num_gpus=N, optimizer_bytes=4)  # SGD with momentum: K = 4 + 4
    assert sgd["zero2"].paper_bytes == 2 * PSI + (2 + 8) * PSI / N


def test_buffers_add_the_working_set() -> None:
    plain, busy = rows_by_name(num_gpus=N), rows_by_name(num_gpus=N, buffers=True)
    assert busy["ddp"].per_device - plain["ddp"].per_device == 4 * PSI  # DDP's gradient buckets
    assert busy["zero2"].per_device - plain["zero2"].per_device == 2 * 4 * 5_000_000  # 2 fp32 reduce buckets
    # stage 3, unit sizes unknown: the root and 2 gathered units in bf16 and 2 fp32 reduce buckets of 5e6 each
    assert busy["zero3"].per_device - plain["zero3"].per_device == 2 * 3 * 5_000_000 + 2 * 4 * 5_000_000
    # the outgoing bf16 copies of the stepped masters: 2 bytes per offloaded element, cΨ/N on each of the N ranks
    assert busy["zero2_offload"].per_host - plain["zero2_offload"].per_host == N * 2 * PSI // N
    assert busy["zero3_offload"].per_host - plain["zero3_offload"].per_host == 0  # cast straight into host shards


def test_paper_example_from_the_cli(capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", "--params", "7.5e9", "--num-gpus", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["world_size"], data["precision"], data["units"]) == (64, "bf16-mixed", "bytes")
    got = {row["strategy"]: row for row in data["strategies"]}
    assert {s: round(got[s]["paper_per_device_bytes"] / 1e9, 1) for s in PAPER_GB} == PAPER_GB
    assert got["zero3"]["per_device_bytes"] == (2 + 4 + 4 + 8) * PSI / N
    assert got["zero3_offload_nvme"]["per_nvme_bytes"] == 12 * PSI
    assert main(["estimate", "--params", "7.5e9", "--num-gpus", "64"]) == 0
    table = capsys.readouterr().out
    paper_column = {line.split()[0]: line.split()[-1] for line in table.splitlines() if line.split()[:1] and
                    line.split()[0] in PAPER_GB}
    assert paper_column == {s: f"{gb:.1f}" for s, gb in PAPER_GB.items()}
    cells = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.startswith("zero")}
    assert cells["zero2_offload"] == ["15.0", "120.0", "-", "-"]  # device 2Ψ, host 64 x 16Ψ/64
    assert cells["zero3_offload_nvme"] == ["-", "45.0", "90.0", "-"]  # host 64 x 6Ψ/64, NVMe 64 x 12Ψ/64


RSS_SCRIPT = textwrap.dedent('''
    import ctypes, gc, json, torch
    from lzero.demo import DemoGPT
    from lzero.memory.estimate import count_parameters
    from lzero.memory.estimate_command import load_model

    ARGS = {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab_size": 50257, "block_size": 1024}

    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

    def growth(work):
        """VmHWM after work() minus VmRSS before it, the mark reset first (without a reset: an overestimate)."""
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            open("/proc/self/clear_refs", "w").write("5")
        except OSError:
            pass
        before = status("VmRSS")
        result = work()
        return status("VmHWM") - before, result

    with torch.device("meta"):
        reference = sum(p.numel() for p in DemoGPT(**ARGS).parameters())
    grew, count = growth(lambda: count_parameters(load_model("lzero.demo.DemoGPT", json.dumps(ARGS))))
    control, _ = growth(lambda: torch.ones(25_000_000).sum())  # 100 MB: the measure sees an allocation
    print(json.dumps({"reference": reference, "trainable": count.trainable, "frozen": count.frozen,
                      "growth": grew, "control": control}))
''')


def test_model_counted_on_meta_without_memory() -> None:
    """~1.56B parameters (GPT-2 XL's shape): counted exactly, peak RSS growing by less than 50 MB."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    print(result)
    assert result["trainable"] == result["reference"] == 1_557_611_200 and result["frozen"] == 0
    assert result["growth"] < 50e6
    assert result["control"] >= 95e6


def test_model_path_with_colon_and_frozen_parameters(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_models.py").write_text(textwrap.dedent('''
        from torch import nn
        class Tuned(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.base = nn.Linear(width, width)
                self.base.requires_grad_(False)
                self.head = nn.Linear(width, 2)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "--model", "user_models:Tuned", "--model-args", '{"width": 10}', "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["trainable_params"], data["frozen_params"]) == (10 * 2 + 2, 10 * 10 + 10)
    zero3 = next(r for r in data["strategies"] if r["strategy"] == "zero3")
    assert zero3["per_device_bytes"] == 18 * 22 + 2 * 110  # N = 1: frozen in bf16, sharded (here whole)


def _engine_case(preset: dict, bf16: bool) -> tuple[dict, dict, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    count = count_parameters(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(**preset)
    engine = ZeroEngine(model, [opt], config, PrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None)
    zopt = ZeroOptimizer(opt, engine, 0)
    # the third backward: optimizer state exists and every gradient is held (with the delayed update, the second
    # step is in flight, and the state its first step created exists: the worker only updates it in place)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(torch.randn(3, 8)).float().square().mean().backward()
        if step < 2:
            zopt.step()
            zopt.zero_grad()
    measured = model_state_bytes(engine, [zopt])
    units = len(engine.units)
    engine.remove()
    return measured, model_states(config, count, 1, "bf16-mixed" if bf16 else "32-true"), units


@pytest.mark.parametrize("bf16", [False, True], ids=["32-true", "bf16-mixed"])
@pytest.mark.parametrize("preset", [{"stage": 1}, {"stage": 2}, {"stage": 3},
                                    {"stage": 2, "offload_optimizer": "cpu"},
                                    {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                                    {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_update": True}}],
                         ids=["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero2_offload_delayed"])
def test_estimate_equals_measured_engine(preset: dict, bf16: bool) -> None:
    """World size 1 (no padding), after a backward: every store and kind equal to lzero.memory.accounting's accounting, but
    Adam's 4-byte step counter per unit and the offload staging buffers (the working set, not model states)."""
    measured, estimated, units = _engine_case(preset, bf16)
    assert set(measured) == set(estimated)
    for store in measured:
        counters = measured[store]["optimizer_state"] - estimated[store]["optimizer_state"]
        assert counters == (4 * units if estimated[store]["optimizer_state"] else 0)
        for kind in ("parameters", "gradients", "masters"):
            assert measured[store][kind] == estimated[store][kind], (store, kind)


@pytest.mark.parametrize("argv, message", [
    (["--params", "7.5e9", "--precision", "fp8"], r"Unknown precision 'fp8'\. HINT: use one of 32-true, bf16-mixed"),
    (["--params", "7.5e9", "--num-gpus", "0"], r"`num_gpus=0` must be a whole number >= 1\. HINT"),
    (["--params", "7.5e9", "--num-nodes", "-2"], r"`num_nodes=-2` must be a whole number >= 1"),
    (["--params", "7.5e9", "--optimizer-bytes", "-1"], r"`optimizer_bytes=-1.0` must be a number >= 0.*HINT: Adam 8"),
    (["--params", "7.5e9", "--frozen-params", "-5"], r"`frozen=-5` must be a whole number"),
    (["--params", "7.5e9", "--offload-ratio", "0"], r"`offload_optimizer.ratio=0.0` must be a fraction in \(0, 1\]"),
    (["--model", "no_such_pkg.models:Net"], r"module 'no_such_pkg.models' does not import \(ModuleNotFoundError.*HINT"),
    (["--model", "lzero.demo:NoSuchModel"], r"module 'lzero.demo' has no class 'NoSuchModel'\. HINT"),
    (["--model", "lzero.demo.DemoGPT", "--model-args", "{n_layer: 2}"], r"is not valid JSON.*HINT: a JSON object"),
    (["--model", "lzero.demo.DemoGPT", "--model-args", "[2]"], r"is a JSON list, not an object"),
    (["--model", "lzero.demo.DemoGPT", "--model-args", '{"n_layers": 2}'],
     r"failed to build \(TypeError.*n_layers.*HINT"),
    (["--params", "7.5e9", "--model-args", "{}"], r"`--model-args` is given without `--model`"),
    (["--params", "7.5e9", "--plot", "out.png"], r"`--plot out.png` needs matplotlib.*HINT: pip install matplotlib"),
    (["--params", "7.5e9", "--num-gpus", "8", "--tensor-parallel", "3"],
     r"`tensor_parallel_size=3` must divide the world size 8\. HINT"),
    (["--params", "7.5e9", "--tensor-sharded-params", "1e9"], r"`--tensor-sharded-params` is given without"),
    (["--params", "1e9", "--num-gpus", "2", "--tensor-parallel", "2", "--tensor-sharded-params", "2e9"],
     r"`tensor_sharded=2000000000` exceeds the trainable parameters"),
    (["--model", "lzero.demo.DemoGPT", "--tensor-parallel", "2", "--num-gpus", "2", "--tp-plan", "[1]"],
     r"`--tp-plan \[1\]` is a JSON list"),
    (["--params", "1e9", "--optimizer", "muon"], r"`--optimizer muon` needs the model's tensors.*HINT: add `--model"),
    (["--model", "lzero.demo.DemoGPT", "--num-gpus", "2", "--tensor-parallel", "2", "--optimizer", "adafactor"],
     r"`--optimizer` with `--tensor-parallel` is not modeled yet.*HINT"),
])
def test_bad_input_is_named(argv: list, message: str, capsys: pytest.CaptureFixture,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # absent, whether or not this venv has it
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "lots"])
def test_bad_params_are_refused_by_the_parser(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--params", value])
    assert exit_.value.code == 2
    assert f"{value!r}" in capsys.readouterr().err


def test_deepspeed_estimator_figures_for_its_documented_case() -> None:
    """DeepSpeed 0.19.8's estimate_zero2/zero3_model_states_mem_needs_all_cold for its documented example (a 2851M
    parameter model, 1 node x 8 GPUs, largest layer 32M), as it printed them here (GiB, two decimals)."""
    from lzero.memory.estimate import deepspeed_estimator

    gib = lambda rows: [(round(r["per_gpu"] / 2**30, 2), round(r["per_cpu"] / 2**30, 2)) for r in rows]  # noqa: E731
    assert gib(deepspeed_estimator(2, 2851e6, 8, 1)) == [(5.31, 127.45), (11.28, 127.45)]
    assert gib(deepspeed_estimator(3, 2851e6, 8, 1, largest_layer_params=32e6)) == [
        (0.12, 71.69), (0.12, 127.45), (0.78, 63.72), (0.78, 127.45), (6.09, 1.43), (6.09, 127.45)]


def test_estimate_prints_deepspeed_rows_beside_lzeros(capsys: pytest.CaptureFixture) -> None:
    from lzero.cli import main

    assert main(["estimate", "--params", "2851e6", "--num-gpus", "8", "--deepspeed", "--largest-layer", "32e6"]) == 0
    out = capsys.readouterr().out
    assert "zero2: per GPU   11.28 | per CPU  127.45 | offload_optimizer=none" in out
    assert "zero3: per GPU    6.09 | per CPU    1.43 | offload_param=none, offload_optimizer=none, zero_init=1" in out


B = 2448  # elements of one block of tests/_engine_cases.Deep (width 48); its root (the tied embedding) holds 3072
SCHEDULES = {  # ZeroConfig's gather-schedule fields -> blocks gathered at once, as [Note: working set] counts them
    "default": ({}, 2), "prefetch 0": ({"prefetch": 0}, 1), "prefetch 2": ({"prefetch": 2}, 3),
    "bucket 1.5 blocks": ({"prefetch_bucket_size": B + B // 2}, 3), "bucket 0": ({"prefetch_bucket_size": 0}, 1),
    "prefetch 3 within root + 2 blocks": ({"prefetch": 3, "max_live_parameters": 3072 + 2 * B}, 2),
    "reuse 4B + 1": ({"max_reuse_distance": 4 * B + 1}, 3), "reuse 1e6": ({"max_reuse_distance": 10**6}, 6),
    "reuse 1e6 within root + 4 blocks": ({"max_reuse_distance": 10**6, "max_live_parameters": 3072 + 4 * B}, 4),
    "persistence B": ({"param_persistence_threshold": B}, 6),
    # runs of 4 blocks (gather_bucket_size 4B): blocks 0-3 and 4-5; the first run computing, the second prefetched
    "runs of 4": ({"gather_bucket_size": 4 * B}, 6),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_stage3_working_set_follows_the_gather_schedule(name: str) -> None:
    """The blocks the estimate counts as gathered at once equal the most the Gatherer holds in two steps (world
    size 1, six equal blocks), for each gather-schedule setting; and the working set is root + that many blocks."""
    from _engine_cases import Deep, count_live_peak

    from lzero.memory.estimate import gathered_blocks, working_set

    knobs, blocks = SCHEDULES[name]
    torch.manual_seed(0)
    model = Deep(depth=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, schedule="min_memory", **knobs))
    zopt = ZeroOptimizer(opt, engine, 0)
    gatherer = engine.gatherer
    peak = count_live_peak(gatherer)
    x, y = torch.randint(0, 64, (4, 3)), torch.randint(0, 64, (4,))
    for _ in range(2):  # the second step knows the order: reuse applies from then on
        engine.gather_root()
        nn.functional.cross_entropy(model(x), y).backward()
        zopt.step()
        zopt.zero_grad()
    engine.remove()
    assert gatherer.numel == {"": 3072, **{f"blocks.{i}": B for i in range(6)}}
    assert peak[0] == 3072 + blocks * B
    config, psi = ZeroConfig(stage=3, schedule="min_memory", **knobs), 3072 + 6 * B
    assert gathered_blocks(config, 3072, B, psi) == blocks
    count = ModelCount(trainable=psi, largest_block=B, root=3072)
    assert working_set(config, count, 1, "32-true")["device"] == 4 * (3072 + blocks * B) + 2 * 4 * B


def test_hybrid_sharding_divides_by_the_group_not_the_world() -> None:
    """`--shard-group-size G`: the zero rows are a flat run's at world size G; DDP's is unchanged; NVMe is refused with
    hybrid sharding, so it has no row."""
    from lzero.memory.estimate import ModelCount, estimate

    count = ModelCount(7_000_000_000, 0)
    hybrid = {r.strategy: r for r in estimate(count, 8, 4, shard_group_size=8)}
    flat = {r.strategy: r for r in estimate(count, 8, 1)}
    assert "zero3_offload_nvme" not in hybrid
    for name, row in hybrid.items():
        assert row.per_device == flat[name].per_device and row.per_host == flat[name].per_host, name
    assert hybrid["zero3"].per_device < estimate(count, 8, 4)[0].per_device  # still far below DDP's 16 bytes/param


def test_hpz_row_adds_the_secondary_copy_of_one_node() -> None:
    """`--hpz-partition-size H`: a zero3_hpz row after zero3's, holding zero3's states plus 1/H of the model in the
    compute dtype (bf16: 2 bytes); H must divide the world and excludes hybrid sharding."""
    from lzero.memory.estimate import EstimateError, ModelCount, estimate

    count = ModelCount(7_000_000_000, 0)
    rows = {r.strategy: r for r in estimate(count, 8, 4, hpz_partition_size=8)}
    assert list(rows)[list(rows).index("zero3") + 1] == "zero3_hpz"
    assert rows["zero3_hpz"].per_device - rows["zero3"].per_device == 2 * 7_000_000_000 // 8
    assert rows["zero3_hpz"].paper_bytes is None
    with pytest.raises(EstimateError, match=r"`hpz_partition_size=3` must be a divisor >= 2 of the world size 32"):
        estimate(count, 8, 4, hpz_partition_size=3)


def test_across_nodes_the_table_recommends_a_group_of_one_node(capsys: pytest.CaptureFixture) -> None:
    from lzero.cli import main

    assert main(["estimate", "--params", "7e9", "--num-gpus", "8", "--num-nodes", "4"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    # zero3 sharded over 8 ranks: 18 bytes x 7e9 / 8 = 15.8 GB, as the --shard-group-size 8 rows say
    assert last.startswith("Across nodes, shard within a node: `--shard-group-size 8`") and "zero3 15.8 GB" in last


def test_tensor_parallel_divides_the_split_parameters_then_shards_over_the_data_ranks(
        capsys: pytest.CaptureFixture) -> None:
    """``--tensor-parallel T``: the plan's split parameters count 1/T per rank, and each row's data parallel runs over
    N / T ranks. By numbers (every parameter split by default) and from a model with a plan (the demo GPT's MLPs)."""
    from lzero.demo import DemoGPT
    from lzero.engine.tensor_parallel_plan import resolve_plan

    assert main(["estimate", "--params", "7e9", "--num-gpus", "8", "--tensor-parallel", "2", "--json"]) == 0
    split = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
    whole = {row.strategy: row for row in estimate(ModelCount(3_500_000_000), num_gpus=4)}
    for name in ("ddp", "zero1", "zero2", "zero3", "zero3_offload"):
        assert split[name]["per_device_bytes"] == whole[name].per_device, name
    plan = {"model.blocks.*.mlp.fc": "colwise", "model.blocks.*.mlp.proj": "rowwise"}
    with torch.device("meta"):
        gpt = DemoGPT(n_layer=2, n_head=2, n_embd=64, block_size=32)
    count = count_parameters(gpt, tensor_plan=resolve_plan(gpt, plan, 2))
    mlp = sum(p.numel() for n, p in gpt.named_parameters() if ".mlp." in n) - 2 * 64  # row-wise biases stay whole
    assert count.tensor_sharded == mlp and count.per_tensor_rank(2).trainable == count.trainable - mlp // 2
    assert main(["estimate", "--model", "lzero.demo.DemoGPT", "--model-args", '{"n_layer": 2, "n_head": 2, "n_embd":'
                 ' 64, "block_size": 32}', "--tensor-parallel", "2", "--num-gpus", "4", "--tp-plan", json.dumps(plan),
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tensor_sharded_params"] == mlp
    rows = {row.strategy: row for row in estimate(count.per_tensor_rank(2), num_gpus=2)}
    assert {r["strategy"]: r["per_device_bytes"] for r in printed["strategies"]} == \
        {name: row.per_device for name, row in rows.items()}


def test_matrix_optimizer_rows_from_the_partition(capsys: pytest.CaptureFixture) -> None:
    """`--optimizer adamw` on a model gives the per-element rows (Adam's 8 bytes per parameter, its step counter per
    shard); `--optimizer muon` each rank's owned tensors, the ddp row every tensor's state; NVMe refused for it."""
    import json

    argv = ["estimate", "--model", "lzero.demo.DemoGPT", "--num-gpus", "4", "--precision", "32-true", "--json"]
    assert main([*argv, "--optimizer-bytes", "8"]) == 0
    plain = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
    assert main([*argv, "--optimizer", "adamw"]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert main([*argv, "--optimizer", "muon"]) == 0
    muon = json.loads(capsys.readouterr().out)
    psi = adamw["trainable_params"]
    for row in adamw["strategies"]:
        name = row["strategy"]
        state = sum(kinds["optimizer_state"] for kinds in row["per_rank"].values())
        want = sum(kinds["optimizer_state"] for kinds in plain[name]["per_rank"].values())
        assert 0 <= state - want <= 8 * 4 + 4 * 64, name  # padding of < N elements per unit and a step per shard
    assert muon["optimizer_state_per_rank"]["zero3_offload_nvme"] == []
    assert "zero3_offload_nvme" not in {r["strategy"] for r in muon["strategies"]}
    ddp = muon["optimizer_state_per_rank"]["ddp"][0]
    for name in ("zero1", "zero2", "zero3"):
        ranks = muon["optimizer_state_per_rank"][name]
        assert len(ranks) == 4 and sum(ranks) >= ddp > 0 and max(ranks) < ddp / 2
    assert psi > 0
