"""Before and after NVMe offload's swap files: removing dead runs' folders, the checks ``nvme_path`` must pass
before the first step, and the raw ``O_DIRECT`` reference the swap-file throughput is measured against. The swap
files themselves, and the notes on their life, are in nvme.py ([Note: life of the swap folder])."""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import shutil
import stat
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from lzero.offload.nvme import (LOCK_FILE, RANK_FOLDER, RUN_ID, NvmeError, PathLike, aligned_empty, byte_view,
                                free_bytes, host_name, move_all, path_error, proc_stat, start_time, user_name)


# --- stale runs ----------------------------------------------------------------------------------


def cleanup_stale(nvme_path: PathLike) -> list[Path]:
    """Remove the run folders ``lzero-<this user>-<id>`` under ``nvme_path`` left by dead runs of this host, and
    return them. See [Note: life of the swap folder]: a folder is removed only when it is this user's, holds
    nothing but ``rank<r>`` folders and their ``rank<r>.lock`` files, and every lock names a process of this
    host that no longer exists."""
    root = Path(nvme_path).expanduser()
    prefix = f"lzero-{user_name()}-"
    removed = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix) and RUN_ID.fullmatch(entry.name[len(prefix) :]) and _is_stale(entry):
            shutil.rmtree(entry, ignore_errors=True)  # another process may be removing it too
            if not entry.exists():
                removed.append(entry)
    return removed


_SWEPT_AT_EXIT: set[Path] = set()


def sweep_at_exit(run_folder: Path, wait_s: float = 3.0) -> None:
    """At this process's exit, remove ``run_folder`` once every lock in it names a dead process, waiting up to
    ``wait_s`` for that. A launcher interrupted by Ctrl+C kills its child ranks with SIGKILL right before it
    exits, so their swap files would outlive the run until the next start's :func:`cleanup_stale`: the
    launcher's exit removes them instead (see [Note: life of the swap folder] in nvme.py). A run that ended
    normally removed its folder already, and the handler returns at once."""
    if run_folder in _SWEPT_AT_EXIT:
        return
    _SWEPT_AT_EXIT.add(run_folder)
    atexit.register(_sweep, run_folder, wait_s)


def _sweep(run_folder: Path, wait_s: float) -> None:
    """Remove ``run_folder`` once it is stale, waiting up to ``wait_s`` while a lock in it names a live child of
    this process (a rank it launched and killed; any other live rank removes its own folder).

    Whether a child holds the folder is read *before* the staleness check of the same round: read after it, a
    child that dies between the two reads would count as neither live nor checked, and the folder it leaves
    would be given up on (seen under load, one Ctrl+C run in many)."""
    deadline = time.monotonic() + wait_s
    while run_folder.exists():
        waiting = _children_hold(run_folder)
        if _is_stale(run_folder, exiting=os.getpid()):
            shutil.rmtree(run_folder, ignore_errors=True)
            return
        if not waiting or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _children_hold(run_folder: Path) -> bool:
    """Some lock in ``run_folder`` names a live child of this process."""
    for lock_file in run_folder.glob("rank*.lock"):
        lock = _read_lock(lock_file)
        fields = proc_stat(lock["pid"]) if lock else None
        if fields is not None and fields[0] not in ("Z", "X") and fields[1] == str(os.getpid()):
            return True
    return False


def _is_stale(run_folder: Path, exiting: Optional[int] = None) -> bool:
    try:
        info = os.lstat(run_folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        locks, ranks = {}, set()
        for child in os.scandir(run_folder):
            if LOCK_FILE.fullmatch(child.name) and child.is_file(follow_symlinks=False):
                locks[LOCK_FILE.fullmatch(child.name).group(1)] = _read_lock(Path(child.path))
            elif RANK_FOLDER.fullmatch(child.name) and child.is_dir(follow_symlinks=False):
                ranks.add(RANK_FOLDER.fullmatch(child.name).group(1))
            else:
                return False  # something lzero did not put there
    except OSError:
        return False
    if not locks or None in locks.values() or not ranks <= set(locks):
        return False
    return all(lock["host"] == host_name() and (lock["pid"] == exiting or not _alive(lock["pid"], lock.get("start")))
               for lock in locks.values())


def _read_lock(path: Path) -> Optional[dict]:
    try:
        lock = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(lock, dict) and lock.get("lzero") == 1 and isinstance(lock.get("pid"), int) and lock["pid"] > 0
    return lock if ok and isinstance(lock.get("host"), str) else None


def _alive(pid: int, start: Optional[int]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    fields = proc_stat(pid)
    if fields is not None and fields[0] in ("Z", "X"):
        # a zombie: killed (SIGKILL, OOM) but not yet reaped by its parent, e.g. a rank whose launcher is still
        # alive; signal 0 reaches it, yet it is dead and will never touch its folder again
        return False
    now = start_time(pid)
    return start is None or now is None or now == start  # a different start time: the pid was reused


# --- checks before the first step ----------------------------------------------------------------


def check_path(nvme_path: PathLike) -> Path:
    """Make sure ``nvme_path`` is a folder this process can write in, creating it (mode 0700) when missing;
    returns it. Raises :class:`NvmeError` naming the path and the fix."""
    path = Path(nvme_path).expanduser().absolute()
    if os.path.exists(path) and not os.path.isdir(path):
        raise NvmeError(f"`nvme_path` {path} is not a directory. HINT: point `nvme_path` at a folder on a local disk.",
                        path=path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise path_error(path, f"`nvme_path` {path} does not exist and cannot be created", err) from err
    try:
        fd, probe = tempfile.mkstemp(prefix=".lzero-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise path_error(path, f"`nvme_path` {path} is not writable", err) from err
    return path


def check_space(nvme_path: PathLike, bytes_needed: int, margin: float = 0.1) -> int:
    """Raise :class:`NvmeError` when the file system of ``nvme_path`` (or of its nearest existing parent) has
    fewer than ``bytes_needed * (1 + margin)`` bytes free; returns the free bytes."""
    path = Path(nvme_path).expanduser().absolute()
    free = free_bytes(path)
    needed = math.ceil(bytes_needed * (1 + margin))
    if free < needed:
        raise NvmeError(
            f"`nvme_path` {path} has {free:,} bytes ({free / 2**30:.1f} GiB) free; the swap files need {needed:,}"
            f" bytes ({needed / 2**30:.1f} GiB: {bytes_needed:,} of state + {margin:.0%} margin). HINT: free space"
            " on that disk or point `nvme_path` at a disk with room.",
            path=path, nbytes=needed,
        )
    return free


def check_buffer(buffer_size_bytes: int, block_size: int) -> None:
    """A buffer smaller than one I/O block cannot be read or written in blocks: raise :class:`NvmeError`."""
    if buffer_size_bytes < block_size:
        raise NvmeError(
            f"`buffer_size` ({buffer_size_bytes:,} bytes) is smaller than aio `block_size` ({block_size:,} bytes)."
            " HINT: raise `buffer_size` to at least `block_size`, or lower `block_size`.",
            nbytes=buffer_size_bytes,
        )






# --- the raw reference ---------------------------------------------------------------------------


class RawThroughput(NamedTuple):
    """A raw sequential write then read of one file (see :func:`raw_throughput`)."""

    write_gbps: float  # 1e9 bytes per second
    read_gbps: float
    nbytes: int
    direct: bool  # False: the folder refused O_DIRECT, buffered I/O was measured


def raw_throughput(folder: PathLike, nbytes: int, block_size: int = 1 << 20, threads: int = 1) -> RawThroughput:
    """Write then read ``nbytes`` (rounded up to ``block_size``) sequentially in one file in ``folder`` with
    O_DIRECT, ``os.pwritev`` / ``os.preadv`` and ``threads`` threads each moving every ``threads``-th block from
    its own aligned buffer; the file is deleted after. The reference for lzero's swap-file throughput."""
    blocks = max(1, -(-nbytes // block_size))
    path = Path(folder) / f".lzero-raw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    buffers = [aligned_empty(block_size, torch.uint8) for _ in range(threads)]
    for buffer in buffers:
        buffer.copy_(torch.randint(0, 256, (block_size,), dtype=torch.uint8))  # not zeros: some disks skip those
    try:
        try:
            fd, direct = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            fd, direct = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600), False
        try:
            write_s = _timed_blocks(os.pwritev, fd, buffers, blocks, block_size)
            read_s = _timed_blocks(os.preadv, fd, buffers, blocks, block_size)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    total = blocks * block_size
    return RawThroughput(total / write_s / 1e9, total / read_s / 1e9, total, direct)


def _timed_blocks(op: Callable, fd: int, buffers: list[Tensor], blocks: int, block_size: int) -> float:
    threads = len(buffers)

    def run(worker: int) -> None:
        view = byte_view(buffers[worker], block_size)
        for block in range(worker, blocks, threads):
            move_all(op, fd, view, block * block_size)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(run, worker) for worker in range(threads)]:
            done.result()
    return time.perf_counter() - start
