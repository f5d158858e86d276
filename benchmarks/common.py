"""What every benchmark shares: how scripts start each other, where results go, what a report says about its run,
and the memory probes several of them take.

Every script runs as a module from the repository root (``benchmarks`` is a package: scripts import each other's
helpers from here, by package name, and nowhere else)::

    python -m benchmarks.<topic>.<script> [--help]

A script that starts another benchmark process does it the same way (:func:`module_command`, :func:`module_env`).

Results go to ``benchmarks/results/<topic>/<name>.<machine>.<YYYY-MM-DD>.<ext>`` (:func:`result_path`): the
machine as :func:`machine` names it, the date the day of the run. Every report starts with :func:`run_header`:
the run's date, git commit, machine and package versions, read when it runs.

Only the standard library is imported here at import time (torch, Lightning and lzero inside the functions that need
them): the DeepSpeed peers import this module in an environment without lzero or Lightning.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
WORLD_SIZE = 2  # processes of the CPU benchmarks that train through Lightning
# glibc's allocator with a fixed mmap threshold: every allocation above it mapped and unmapped whole, so RSS follows the
# live tensors, not freed memory the heap keeps (the loading benchmarks run each way with and without it)
THRESHOLD, FIXED = "MALLOC_MMAP_THRESHOLD_", "65536"


# --- launching -------------------------------------------------------------------------------------------------

def module_command(module: str, *args: object, python: str = sys.executable) -> list[str]:
    """The command that runs benchmark module ``module`` (``__spec__.name`` of a script run with ``-m``) with
    ``args`` in a fresh interpreter; run it with :func:`module_env`."""
    return [python, "-m", module, *map(str, args)]


def require(package: str, hint: str) -> None:
    """Exit with a message saying so where ``package`` cannot be imported by this interpreter."""
    if importlib.util.find_spec(package) is None:
        raise SystemExit(f"{package} is not installed for {sys.executable}. HINT: {hint}")


def module_env(env: Optional[dict[str, str]] = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``extra`` set and the repository first on PYTHONPATH,
    so ``python -m benchmarks...`` finds the package from any working directory."""
    out = {**(os.environ if env is None else env), **extra}
    out["PYTHONPATH"] = os.pathsep.join([str(REPO), *([out["PYTHONPATH"]] if out.get("PYTHONPATH") else [])])
    return out


# --- results ---------------------------------------------------------------------------------------------------

def today() -> str:
    return datetime.date.today().isoformat()


def _memory_gib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20)
    except OSError:
        pass
    return 0


def _gpus() -> list[tuple[str, int]]:
    """(name, GiB) of each visible CUDA device; none without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), round(torch.cuda.get_device_properties(i).total_memory / 2**30))
            for i in range(torch.cuda.device_count())]


def _gpu_tag(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``."""
    words = [w for w in name.split() if w.upper() not in ("NVIDIA", "GEFORCE", "TESLA", "AMD", "RADEON")]
    tag = words[0] if words else name
    if len(words) > 1 and not any(c.isdigit() for c in tag):
        tag += words[1]
    return "".join(c for c in tag.lower() if c.isalnum() or c == "-")


@cache
def machine() -> str:
    """This machine in a result file's name: ``cpu2-24g`` (2 CPUs, 24 GiB), with a GPU ``h200-cpu16-125g``
    (``h200x8-...`` for eight)."""
    host = f"cpu{os.cpu_count()}-{_memory_gib()}g"
    gpus = _gpus()
    if not gpus:
        return host
    return _gpu_tag(gpus[0][0]) + (f"x{len(gpus)}" if len(gpus) > 1 else "") + "-" + host


@cache
def machine_description() -> str:
    """This machine in words: CPUs, memory, GPUs."""
    gpus = _gpus()
    gpu = f"{len(gpus)} x {gpus[0][0]} ({gpus[0][1]} GiB)" if gpus else "no GPU"
    return f"{os.cpu_count()} CPUs ({platform.machine()}), {_memory_gib()} GiB, {gpu}"


def result_path(topic: str, name: str, ext: str = "md") -> Path:
    """Where a run of today on this machine writes result ``name`` of ``topic``."""
    return RESULTS / topic / f"{name}.{machine()}.{today()}.{ext}"


def latest_result(topic: str, name: str, ext: str = "md") -> Optional[Path]:
    """The newest result ``name`` of ``topic`` (by the date in its file name) of this machine, else of any
    machine; None if there is none."""
    found = []  # (date, machine, path)
    for path in (RESULTS / topic).glob(f"{name}.*.{ext}"):
        parts = path.name[: -len(ext) - 1].split(".")
        if len(parts) == 3 and parts[0] == name:
            found.append((parts[2], parts[1], path))
    found.sort()
    mine = [f for f in found if f[1] == machine()]
    return (mine or found)[-1][2] if found else None


def out_path(value: Optional[str], topic: str, name: str, ext: str = "md") -> Optional[Path]:
    """A script's ``--out``: None or "none" for no file; a bare word (no ``/``, no ``.``) names the result in
    ``topic`` (``--out monitor_overhead``); anything else is a path. Default: ``result_path(topic, name, ext)``."""
    if value is None:
        return result_path(topic, name, ext)
    if value == "none":
        return None
    if "/" not in value and "." not in value:
        return result_path(topic, value, ext)
    return Path(value)


def write_report(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}", flush=True)


def publish(lines: list[str], path: Optional[Path]) -> None:
    """A report's lines printed, and written to ``path`` unless it is None."""
    text = "\n".join(lines) + "\n"
    print(text)
    if path is not None:
        write_report(path, text)


# --- what a report says about its run ----------------------------------------------------------------------------

def git_commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout, marked when lzero/ or benchmarks/ has uncommitted changes."""
    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *cmd], capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "(not a git checkout)"
        dirty = git("status", "--porcelain", "--", "lzero", "benchmarks").stdout.strip()
    except OSError:
        return "(git unavailable)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def versions(*packages: str) -> str:
    """python, torch, lightning and ``packages``, as installed in this environment."""
    found = [f"python {platform.python_version()}"]
    for name in ("torch", "lightning", *packages):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def run_header(*packages: str) -> str:
    """The first lines of a report: this run's date, commit, machine and versions (``packages`` besides python,
    torch and lightning, e.g. ``"transformers"``), all read now."""
    return (f"Run {today()}, commit {git_commit()}, machine {machine()} ({machine_description()});"
            f" {versions(*packages)}.")


# --- memory probes ----------------------------------------------------------------------------------------------

def proc_status(field: str) -> int:
    """A field of /proc/self/status as the kernel prints it (kB for the Vm* fields)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def proc_bytes(field: str) -> int:
    """A Vm* field of /proc/self/status in bytes."""
    return proc_status(field) * 1024


def proc_io(field: str) -> int:
    """A field of /proc/self/io (``rchar``, ``read_bytes``, ...); 0 where the file or field is missing."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak() -> bool:
    """Restart the kernel's high-water mark of this process's RSS (``VmHWM``) at its current RSS; False where
    /proc/self/clear_refs refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reset_peak_rss() -> bool:
    """:func:`reset_peak` after handing freed memory back to the OS (glibc keeps freed heap pages otherwise), so the
    new mark starts near this run's own footprint."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim, the mark may include retained memory
    return reset_peak()


def peak_rss_mb() -> float:
    """VmHWM in MB of 2**20 bytes, or ru_maxrss (a high-water mark over the whole process) without /proc."""
    try:
        return proc_status("VmHWM") / 1024
    except (OSError, KeyError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def count_checkpoint_reads() -> list[int]:
    """From now on, the bytes lzero's pretrained-checkpoint reader asks for, in the checkpoint's dtype: ``[total]``
    (``lzero.hf.weights.OpenFiles.read_flat_into`` wrapped for the rest of the process)."""
    from lzero.hf import weights

    asked = [0]
    read_flat_into = weights.OpenFiles.read_flat_into

    def counted(self: Any, key: str, start: int, end: int, out: Any) -> None:
        asked[0] += (end - start) * self._files.tensors[key].dtype.itemsize
        read_flat_into(self, key, start, end, out)

    weights.OpenFiles.read_flat_into = counted
    return asked


def run_spawned(target: Any, args: tuple, env: dict[str, str], timeout_s: float = 600) -> Any:
    """What ``target(*args, queue)`` puts on its queue, run in a fresh (spawned) process that starts with ``env`` added
    to this one's environment (read by its allocator as it starts)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    result = queue.get(timeout=timeout_s)
    proc.join()
    return result


def gather_floats(value: float) -> list[float]:
    """``value`` from every rank, in rank order (the process group outlives Trainer.fit)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    values: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# --- Lightning runs of the demo GPT --------------------------------------------------------------------------------

def bench_trainer(strategy: Any, steps: int, callbacks: list, accelerator: str = "cpu", devices: int = WORLD_SIZE,
                  **kwargs: Any) -> Any:
    """A fp32 Trainer on ``devices`` processes that only trains (no validation, checkpoints, logs or bars)."""
    from lightning.pytorch import Trainer

    return Trainer(accelerator=accelerator, devices=devices, strategy=strategy, precision="32-true",
                   max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
                   enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   **kwargs)


def make_strategy(name: str, world_size: int = WORLD_SIZE) -> Any:
    """What to pass as ``Trainer(strategy=...)`` for a benchmark strategy name: a Lightning registry name as is
    (``ddp``; ``zero1``-``zero3`` and the presets come from lzero), or ``fsdp2``: Lightning's ModelParallelStrategy
    with every process data-parallel ("auto" would make the tensor-parallel dimension span the node); nothing in it
    is tied to CUDA: on the CPU accelerator it uses gloo and a "cpu" device mesh. Pair it with
    :func:`fsdp2_demo_gpt`."""
    if name != "fsdp2":
        return name
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)


@cache
def fsdp2_demo_gpt() -> type:
    """DemoGPT sharded with FSDP2 in ``configure_model``, as ModelParallelStrategy requires.

    Like torchtitan: every transformer block is its own ``fully_shard`` group, then the GPT itself takes the rest
    (embeddings, the tied head weight, final LayerNorm). The last block keeps its parameters gathered after forward,
    because backward needs them first. DemoGPT's ``configure_optimizers`` runs after this hook, so AdamW gets the
    DTensor shards. (A function, so that importing this module needs no lzero.)"""
    from lzero.demo import DemoGPT

    class FSDP2DemoGPT(DemoGPT):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):  # Lightning calls this hook again on a later fit/test
                return
            mesh = self.device_mesh["data_parallel"]
            blocks = self.model.blocks
            for i, block in enumerate(blocks):
                fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
            fully_shard(self.model, mesh=mesh)

    return FSDP2DemoGPT
