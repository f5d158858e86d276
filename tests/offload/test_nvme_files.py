"""The NVMe file layer (lzero/offload/nvme.py): swap files round-trip tensors bitwise through O_DIRECT, fall back to
buffered I/O where O_DIRECT is refused, turn I/O errors into NvmeError without ever taking a half-written
file as complete, and their folders are owner-only and cleaned up, stale ones included, touching nothing else.

Folders live under the repository's disk (not tmpfs) so that O_DIRECT is really exercised.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from lzero.offload.nvme import NvmeError, SwapFiles, aligned_empty, round_up
from lzero.offload.nvme_checks import check_buffer, check_path, check_space, cleanup_stale, raw_throughput

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk():
    """A fresh folder on the work disk (the repository's file system)."""
    folder = Path(tempfile.mkdtemp(prefix=".nvme-test-", dir=REPO))
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=True)


def _random(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included) in an aligned buffer."""
    out = aligned_empty(numel, dtype)
    bits = torch.randint(-(2**15), 2**15, (out.numel() * out.element_size() // 2,), dtype=torch.int16)
    out.view(torch.int16).copy_(bits)
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def _fd_flags_spy(monkeypatch) -> list[int]:
    """Record the open flags of the fd of every pwritev / preadv call."""
    flags = []
    for name in ("pwritev", "preadv"):
        real = getattr(os, name)

        def spy(fd, buffers, offset, real=real):
            flags.append(fcntl.fcntl(fd, fcntl.F_GETFL))
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, name, spy)
    return flags


def test_aligned_empty_address_and_room() -> None:
    for numel, dtype, align in [(1, torch.float32, 4096), (100_003, torch.bfloat16, 4096), (5, torch.float64, 8192),
                                (0, torch.float32, 4096), (1025, torch.uint8, 512)]:
        t = aligned_empty(numel, dtype, align=align, pin=True)  # pin: ignored without CUDA
        storage = t.untyped_storage()
        room = storage.data_ptr() + storage.nbytes() - t.data_ptr()
        assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % align == 0
        assert room >= round_up(numel * t.element_size(), align)
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, torch.float32, align=1000)


def test_round_trip_bitwise_multi_chunk(disk: Path) -> None:
    with SwapFiles(disk, rank=0, block_size=64 << 10) as files:
        written = {}
        for key, numel, dtype in [("master.0", 100_003, torch.float32), ("bf16.0", 12_345, torch.bfloat16),
                                  ("tiny", 1, torch.float32), ("empty", 0, torch.float32)]:
            written[key] = _random(numel, dtype)
            assert files.write(key, written[key]).result(timeout=30) is None
            nbytes = numel * written[key].element_size()
            assert nbytes % 4096 or nbytes == 0
            assert (files.folder / key).stat().st_size == round_up(nbytes)  # padded to 4096 on disk
        for key, data in written.items():
            out = aligned_empty(data.numel(), data.dtype)
            assert files.read(key, out).result(timeout=30) is out
            assert torch.equal(_bits(out), _bits(data)), key
        total = sum(t.numel() * t.element_size() for t in written.values())
        assert files.bytes_written == files.bytes_read == total == 424_706
        assert files.write_seconds > 0 and files.read_seconds > 0
        # a shorter rewrite of a key leaves no tail of the longer one
        shorter = _random(1000, torch.float32)
        files.write("master.0", shorter).result(timeout=30)
        assert (files.folder / "master.0").stat().st_size == 4096


def test_many_keys_threads_and_queue_depth_reads_overlap_writes(disk: Path, monkeypatch) -> None:
    in_flight, peak, workers, lock = [0], [0], set(), threading.Lock()
    for name in ("pwritev", "preadv"):
        real = getattr(os, name)

        def counted(fd, buffers, offset, real=real):
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
                workers.add(threading.current_thread().name)
            try:
                return real(fd, buffers, offset)
            finally:
                with lock:
                    in_flight[0] -= 1

        monkeypatch.setattr(os, name, counted)
    with SwapFiles(disk, rank=1, threads=2, queue_depth=2, block_size=16 << 10) as files:
        data = {f"k{i}": _random(3_000 + 7_919 * i, torch.float32 if i % 2 else torch.bfloat16) for i in range(24)}
        first = {k: files.write(k, data[k]) for k in list(data)[:12]}
        for future in first.values():
            future.result(timeout=30)
        # reads of the first keys while the last keys are being written
        second = [files.write(k, data[k]) for k in list(data)[12:]]
        outs = {k: aligned_empty(data[k].numel(), data[k].dtype) for k in data}
        reads = [files.read(k, outs[k]) for k in list(data)[:12]]
        for future in second + reads:
            future.result(timeout=30)
        reads = [files.read(k, outs[k]) for k in list(data)[12:]]
        files.wait_all()
        assert all(r.done() for r in reads)
        for k in data:
            assert torch.equal(_bits(outs[k]), _bits(data[k])), k
        assert sorted(p.name for p in files.folder.iterdir()) == sorted(data)
    assert peak[0] <= 2, f"{peak[0]} chunks in flight with queue_depth=2"
    assert workers == {"MainThread", "lzero-nvme-rank1_0", "lzero-nvme-rank1_1"}  # the probe, then both workers


def test_o_direct_is_used_on_the_work_disk(disk: Path, monkeypatch) -> None:
    """The work disk here (ext4) takes O_DIRECT: every request uses it. A disk that refuses it (a CI machine's
    overlay file system, say) gets buffered I/O and exactly one warning: either way the choice is observable."""
    flags = _fd_flags_spy(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SwapFiles(disk, rank=0, block_size=1 << 20) as files:
            data = _random(300_001, torch.float32)
            files.write("a", data).result(timeout=30)
            out = aligned_empty(data.numel(), data.dtype)
            files.read("a", out).result(timeout=30)
            assert torch.equal(_bits(out), _bits(data))
            direct = files.direct
    ours = [w for w in caught if "O_DIRECT" in str(w.message)]
    if direct:
        assert len(flags) >= 4 and all(f & os.O_DIRECT for f in flags)  # probe (2) + 2 chunks each way
        assert ours == []
    else:
        assert len(ours) == 1 and not any(f & os.O_DIRECT for f in flags[2:])


def test_tmpfs_keeps_data_direct_or_buffered_with_one_warning() -> None:
    """/dev/shm as it is: kernels since 6.6 accept O_DIRECT on tmpfs; older ones refuse it (then one warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SwapFiles("/dev/shm", rank=0, block_size=64 << 10) as files:
            data = _random(70_001, torch.bfloat16)
            files.write("a", data).result(timeout=30)
            out = aligned_empty(data.numel(), data.dtype)
            files.read("a", out).result(timeout=30)
            assert torch.equal(_bits(out), _bits(data))
            direct, folder = files.direct, files.folder
    ours = [w for w in caught if "O_DIRECT" in str(w.message)]
    assert len(ours) == (0 if direct else 1)
    assert all(str(folder) in str(w.message) for w in ours)


def test_o_direct_refused_falls_back_to_buffered_with_one_warning(monkeypatch) -> None:
    """tmpfs of older kernels (and some network file systems): EINVAL when opening with O_DIRECT."""
    real_open = os.open

    def refuse_direct(path, flags, mode=0o777, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    flags = _fd_flags_spy(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SwapFiles("/dev/shm", rank=3, block_size=64 << 10, threads=2) as files:
            datas = [_random(n, torch.float32) for n in (1, 50_000, 123_457)]
            for i, data in enumerate(datas):
                files.write(f"k{i}", data).result(timeout=30)
            for i, data in enumerate(datas):
                out = aligned_empty(data.numel(), data.dtype)
                files.read(f"k{i}", out).result(timeout=30)
                assert torch.equal(_bits(out), _bits(data))
            assert not files.direct
            folder = files.folder
    ours = [str(w.message) for w in caught]
    assert len(ours) == 1, ours
    assert str(folder) in ours[0] and "refuses O_DIRECT" in ours[0] and "buffered" in ours[0]
    assert flags and not any(f & os.O_DIRECT for f in flags)


def test_modes_folder_0700_files_0600(disk: Path) -> None:
    old = os.umask(0)  # the modes must not come from the umask
    try:
        files = SwapFiles(disk, rank=0, run_id="modes")
        files.write("a", _random(10, torch.float32)).result(timeout=30)
    finally:
        os.umask(old)
    try:
        mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
        assert files.run_folder.name.startswith("lzero-") and files.run_folder.name.endswith("-modes")
        assert mode(files.run_folder) == mode(files.folder) == 0o700
        assert mode(files.folder / "a") == mode(files.lock_path) == 0o600
        lock = json.loads(files.lock_path.read_text())
        assert lock["pid"] == os.getpid() and lock["host"]
    finally:
        files.remove()


def test_enospc_on_second_chunk_is_a_clear_error_and_the_key_is_not_readable(disk: Path, monkeypatch) -> None:
    with SwapFiles(disk, rank=0, block_size=64 << 10, threads=1, queue_depth=1) as files:
        before = _random(50_000, torch.float32)  # 200,000 bytes: 4 chunks of 64 KiB
        files.write("m", before).result(timeout=30)  # a complete earlier version of the key
        real, calls = os.pwritev, [0]

        def full_disk(fd, buffers, offset):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", full_disk)
        future = files.write("m", _random(50_000, torch.float32))
        with pytest.raises(NvmeError) as failed:
            future.result(timeout=30)
        err = failed.value
        message = str(err)
        print(message)
        assert err.errno == errno.ENOSPC and err.op == "write" and err.nbytes == 200_000
        assert err.path == files.folder / "m"
        for part in (str(files.folder / "m"), "200,000 bytes", "byte 65,536", "No space left", "HINT",
                     "`nvme_path`", "needs 200,704"):
            assert part in message, part
        assert calls[0] == 2 and files.bytes_written == 200_000  # the failed write counts nothing
        with pytest.raises(NvmeError, match="incomplete: its last write failed"):
            files.read("m", aligned_empty(50_000, torch.float32))
        monkeypatch.setattr(os, "pwritev", real)
        again = _random(50_000, torch.float32)
        files.write("m", again).result(timeout=30)
        out = aligned_empty(50_000, torch.float32)
        files.read("m", out).result(timeout=30)
        assert torch.equal(_bits(out), _bits(again))


def test_reading_unwritten_or_in_flight_keys_and_bad_arguments(disk: Path, monkeypatch) -> None:
    with SwapFiles(disk, rank=0) as files:
        out = aligned_empty(100, torch.float32)
        with pytest.raises(NvmeError, match="was never written"):
            files.read("nothing", out)
        release, real = threading.Event(), os.pwritev

        def slow(fd, buffers, offset):
            release.wait(10)
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", slow)
        future = files.write("slow", _random(100, torch.float32))
        with pytest.raises(NvmeError, match="still being written"):
            files.read("slow", out)
        with pytest.raises(NvmeError, match="being written"):
            files.write("slow", out)
        release.set()
        future.result(timeout=30)
        with pytest.raises(ValueError, match="holds 400 bytes; `out` has 40"):
            files.read("slow", aligned_empty(10, torch.float32))
        for bad in ("a/b", "../x", ".hidden", "", "a\\b/c"):
            with pytest.raises(ValueError, match="no path separator"):
                files.write(bad, out)
        unaligned = torch.empty(5000, dtype=torch.uint8)[1:1001]
        with pytest.raises(ValueError, match="aligned_empty"):
            files.write("x", unaligned)
        with pytest.raises(ValueError, match="room for 8,192 bytes"):
            files.write("x", _without_padding(4097, keep_alive=[]))


def _without_padding(nbytes: int, keep_alive: list) -> torch.Tensor:
    """An aligned tensor whose storage ends right after its bytes (no room for the O_DIRECT padding)."""
    base = aligned_empty(round_up(nbytes), torch.uint8)
    keep_alive.append(base)
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(base.data_ptr()), dtype=torch.uint8)


def test_remove_is_idempotent_and_keeps_other_ranks(disk: Path) -> None:
    rank0 = SwapFiles(disk, rank=0, run_id="two")
    rank1 = SwapFiles(disk, rank=1, run_id="two")
    with pytest.raises(NvmeError, match="already using"):
        SwapFiles(disk, rank=1, run_id="two")
    rank0.write("a", _random(10, torch.float32)).result(timeout=30)
    rank0.remove()
    rank0.remove()
    assert not rank0.folder.exists() and not rank0.lock_path.exists() and rank1.folder.is_dir()
    with pytest.raises(NvmeError, match="removed"):
        rank0.write("a", _random(10, torch.float32))
    rank1.remove()
    assert not rank1.run_folder.exists() and list(disk.iterdir()) == []


def test_remove_with_requests_in_flight_fails_the_queued_ones(disk: Path, monkeypatch) -> None:
    files = SwapFiles(disk, rank=0, block_size=64 << 10, threads=1, queue_depth=1)
    release, real = threading.Event(), os.pwritev

    def slow(fd, buffers, offset):
        release.wait(10)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    future = files.write("big", _random(100_000, torch.float32))  # 7 chunks, 1 in flight
    threading.Timer(0.2, release.set).start()
    files.remove()  # waits for the chunk in flight, drops the 6 queued
    assert isinstance(future.exception(timeout=0), NvmeError)
    assert "removed before this write ran" in str(future.exception())
    assert not files.run_folder.exists()


def test_cleanup_stale_removes_only_dead_runs_of_this_user(disk: Path) -> None:
    code = ("import os, sys, torch; from lzero.offload.nvme import SwapFiles, aligned_empty;"
            "f = SwapFiles(sys.argv[1], rank=0, run_id='deadrun');"
            "f.write('m', aligned_empty(1000, torch.float32).zero_()).result();"
            "print(os.getpid(), f.run_folder, flush=True); os._exit(0)")  # killed: no remove()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, str(disk)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid, dead = done.stdout.split()
    dead = Path(dead)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    assert (dead / "rank0" / "m").is_file() and json.loads((dead / "rank0.lock").read_text())["pid"] == int(pid)

    live = SwapFiles(disk, rank=0, run_id="liverun")  # this process: alive
    prefix = dead.name[: -len("deadrun")]  # "lzero-<user>-"
    lock_text = (dead / "rank0.lock").read_text()
    kept = []
    for name, extra in [("lzero-someoneelse-abc", None), (prefix + "nolock", None), (prefix + "extra", "notes.txt")]:
        (disk / name / "rank0").mkdir(parents=True)
        if name != prefix + "nolock":
            (disk / name / "rank0.lock").write_text(lock_text)  # the dead pid
        if extra:
            (disk / name / extra).write_text("the user's")
        kept.append(disk / name)
    (disk / "mydata").mkdir()
    (disk / "mydata" / "rank0.lock").write_text(lock_text)
    (disk / (prefix + "x")).write_text("a file, not a run folder")
    (disk / (prefix + "y.txt")).mkdir()
    kept += [disk / "mydata", disk / (prefix + "x"), disk / (prefix + "y.txt"), live.run_folder]
    try:
        assert cleanup_stale(disk) == [dead]
        assert not dead.exists()
        assert all(path.exists() for path in kept)
        assert cleanup_stale(disk) == []
    finally:
        live.remove()


def test_exit_sweep_removes_the_folder_of_a_child_that_dies_during_its_check(disk: Path, monkeypatch) -> None:
    """The launcher's exit sweep (``sweep_at_exit``) with its killed rank dying *during* a staleness check: the
    check saw it alive, and it is a zombie by the time the sweep asks whether a child still holds the folder.
    The sweep must look again and remove the folder (it once gave up here: the Ctrl+C flake under load)."""
    from lzero.offload import nvme_checks
    from lzero.offload.nvme import host_name, start_time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_folder = disk / "lzero-user-run"
        (run_folder / "rank1").mkdir(parents=True)
        (run_folder / "rank1" / "unit0.master").write_bytes(b"x" * 4096)
        lock = {"lzero": 1, "pid": child.pid, "start": start_time(child.pid), "host": host_name()}
        (run_folder / "rank1.lock").write_text(json.dumps(lock))
        real_is_stale, checks = nvme_checks._is_stale, []

        def child_dies_during_the_check(folder: Path, exiting=None) -> bool:
            stale = real_is_stale(folder, exiting)
            checks.append(stale)
            if len(checks) == 1:
                child.kill()  # SIGKILL, as Lightning's launcher sends on Ctrl+C; not reaped: a zombie
                while nvme_checks.proc_stat(child.pid)[0] not in ("Z", "X"):
                    time.sleep(0.01)
            return stale

        monkeypatch.setattr(nvme_checks, "_is_stale", child_dies_during_the_check)
        nvme_checks._sweep(run_folder, wait_s=5.0)
        assert checks == [False, True]  # alive at the first check, dead at the second
        assert not run_folder.exists()
    finally:
        child.kill()
        child.wait()


def test_check_space(disk: Path) -> None:
    free = check_space(disk, 1 << 20)
    assert free > 1 << 20
    with pytest.raises(NvmeError) as absurd:
        check_space(disk / "not" / "yet", 1 << 62)  # a missing folder: its disk's space counts
    message = str(absurd.value)
    assert str(disk / "not" / "yet") in message and f"{round((1 << 62) * 1.1):,}" in message
    assert " free; the swap files need " in message and "HINT" in message and absurd.value.nbytes == round((1 << 62) * 1.1)


def test_check_path(disk: Path) -> None:
    created = check_path(disk / "a" / "b")
    assert created.is_dir() and stat.S_IMODE(created.stat().st_mode) == 0o700 & ~_umask()
    regular = disk / "file.txt"
    regular.write_text("x")
    with pytest.raises(NvmeError, match="is not a directory") as not_dir:
        check_path(regular)
    assert not_dir.value.path == regular
    with pytest.raises(NvmeError, match=r"does not exist and cannot be created \(\[Errno 20\] Not a directory") as sub:
        check_path(regular / "sub")
    assert str(regular / "sub") in str(sub.value) and "HINT" in str(sub.value)


def test_check_path_unwritable_injected(disk: Path, monkeypatch) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(NvmeError, match=r"is not writable \(\[Errno 13\] Permission denied\)") as err:
        check_path(disk)
    assert str(disk) in str(err.value) and err.value.errno == errno.EACCES


def test_check_buffer() -> None:
    check_buffer(1 << 20, 1 << 20)
    with pytest.raises(NvmeError, match=r"`buffer_size` \(524,288 bytes\) is smaller than aio `block_size` \(1,048,576"):
        check_buffer(1 << 19, 1 << 20)


def test_raw_throughput(disk: Path) -> None:
    raw = raw_throughput(disk, 8 << 20, block_size=1 << 20, threads=2)
    print(raw)
    assert raw.direct and raw.nbytes == 8 << 20
    assert raw.write_gbps > 0.01 and raw.read_gbps > 0.01
    assert list(disk.iterdir()) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
