"""The file layer of NVMe offload (ZeRO-Infinity): one rank's swap folder, its files, and the checks run
before the first step. Pure Python and torch: no compiled extension, no libaio.

[Note: swap files]
A :class:`SwapFiles` owns ``nvme_path/lzero-<user>-<run id>/rank<r>/``. Each key names one file holding
exactly the bytes of one 1-D tensor, padded with whatever follows it in its buffer up to a multiple of
``align`` (4096) bytes. ``write(key, data)`` and ``read(key, out)`` return a ``concurrent.futures.Future``
at once; the request is cut into ``block_size`` chunks which a ``ThreadPoolExecutor`` of ``threads`` workers
(DeepSpeed's aio ``intra_op_parallelism``) moves with ``os.pwritev`` / ``os.preadv``, which release the GIL,
with at most ``queue_depth`` chunks of this object in flight (DeepSpeed's aio ``queue_depth``); the others
wait in a queue, oldest first. Short reads and writes are looped over.

A key has a state (:class:`KeyState`): a file counts as written only once every chunk of its last write
finished without error. A failed write (``ENOSPC`` above all) leaves the key ``FAILED``, and reading a key
that is ``FAILED``, still being written, or never written raises at once; a half-written file is never read
as if it were complete. Errors of the I/O itself surface on the request's future as :class:`NvmeError`,
which names the file, the operation, the bytes, the errno and a fix.

The swap files are scratch space, not checkpoints: nothing is ``fsync``-ed, and a crashed run's folder is
only good for :func:`cleanup_stale`.

[Note: O_DIRECT and alignment]
Files are opened with ``O_DIRECT``: the bytes go between the tensor and the drive without the page cache,
which would otherwise fill host memory with the very state that NVMe offload moves out of it. ``O_DIRECT``
needs the buffer address, the file offset and the length to be multiples of the logical block size; 4096
covers every drive. So buffers come from :func:`aligned_empty`, ``block_size`` is a multiple of ``align``,
and a request moves ``round_up(nbytes, align)`` bytes: a read overwrites the bytes after ``out`` up to that
length, which :func:`aligned_empty` reserves (a caller carving several tensors out of one buffer must leave
that room between them). A file system that refuses ``O_DIRECT`` (``EINVAL`` at open or at the first I/O;
older kernels' tmpfs) is found by a one-block probe when the folder is made; that folder then uses buffered
I/O, with one warning naming the path. Later ``EINVAL`` errors are errors.

[Note: life of the swap folder]
lzero makes the run folder and the rank folder (mode 0700) and the files (0600). Before making its rank
folder a rank claims it with a lock file ``rank<r>.lock`` in the run folder (``O_EXCL``), holding its pid,
the process start time and the host name. :meth:`SwapFiles.remove` deletes the rank folder and the lock, and
the run folder once it is empty; nothing is registered globally, the caller calls it at the end of ``fit``
and on an exception. A run killed before that leaves its folder; :func:`cleanup_stale` removes the run
folders of the same user on the same host whose every lock names a process that no longer exists (or
is a zombie: killed, not yet reaped), and
leaves anything it does not fully recognise alone. Every rank also registers an exit handler for its run
folder (``nvme_checks.sweep_at_exit``): Lightning's launcher, on Ctrl+C, SIGKILLs the ranks it started and
then exits, so the launcher's own exit removes the killed ranks' files (waiting up to 3 s for their deaths)
instead of leaving them to the next start.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import getpass
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
import uuid
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from lzero.errors import ZeroError

ALIGN = 4096
"""Bytes to which O_DIRECT buffers, offsets and lengths are aligned (the largest logical block size)."""

_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file name: no separator, no leading dot
RUN_ID = re.compile(r"[A-Za-z0-9_]+")  # no "-": the user name before it may contain one
LOCK_FILE = re.compile(r"rank(\d+)\.lock")
RANK_FOLDER = re.compile(r"rank(\d+)")

PathLike = Union[str, os.PathLike]


class NvmeError(ZeroError, RuntimeError):
    """NVMe offload cannot go on: a swap file's I/O failed or ``nvme_path`` is unusable. The message names
    the path, the bytes and the fix; ``path``, ``op``, ``nbytes`` and ``errno`` hold them where known."""

    def __init__(
        self,
        message: str,
        path: Optional[PathLike] = None,
        op: Optional[str] = None,
        nbytes: Optional[int] = None,
        errno: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.op = op
        self.nbytes = nbytes
        self.errno = errno


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def _check_align(align: int) -> None:
    if align < 512 or align & (align - 1):
        raise ValueError(f"align={align} is not a power of two of at least 512 (a disk's logical block size).")


# --- buffers -------------------------------------------------------------------------------------


def aligned_empty(numel: int, dtype: torch.dtype, align: int = ALIGN, pin: bool = False) -> Tensor:
    """A 1-D tensor of ``numel`` uninitialised elements whose address is a multiple of ``align`` and whose
    storage holds at least ``round_up(nbytes, align)`` bytes from that address (see [Note: O_DIRECT and
    alignment]). ``pin``: page-locked, when CUDA is available (otherwise ignored: nothing to pin for)."""
    _check_align(align)
    itemsize = torch.empty((), dtype=dtype).element_size()
    padded = round_up(numel * itemsize, align)
    base = _host_bytes(padded, pin)
    if base.data_ptr() % align:  # over-allocate only when needed: pinned blocks are rounded to powers of two
        base = _host_bytes(padded + align, pin)
    shift = -base.data_ptr() % align
    return base[shift : shift + padded].view(dtype)[:numel]


def _host_bytes(nbytes: int, pin: bool) -> Tensor:
    if pin and torch.cuda.is_available():
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as err:
            warnings.warn(
                f"lzero could not allocate {nbytes:,} bytes of pinned host memory for an NVMe buffer"
                f" ({str(err).splitlines()[0]}); this buffer is pageable, so its copies are synchronous."
                " HINT: set `pin_memory: false` or lower `buffer_count` / `buffer_size`.",
                stacklevel=3,
            )
    return torch.empty(nbytes, dtype=torch.uint8)


def byte_view(tensor: Tensor, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` bytes from the tensor's address (its padding included)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def move_all(op: Callable, fd: int, view: memoryview, offset: int) -> None:
    """``op`` (``os.pwritev`` or ``os.preadv``) all of ``view`` at ``offset``, looping over short transfers."""
    done = 0
    while done < len(view):
        moved = op(fd, [view[done:]], offset + done)
        if moved == 0:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done:,}")
        done += moved


# --- swap files ----------------------------------------------------------------------------------


class KeyState(enum.Enum):
    """Where a key's file stands; only ``COMPLETE`` files are read."""

    WRITING = "writing"
    """A write is in flight: some chunks may be on disk, others not."""
    COMPLETE = "complete"
    """The last write finished without error: the file holds the tensor's bytes."""
    FAILED = "failed"
    """The last write failed: the file's bytes are not to be read until a write completes."""


class _Key:
    __slots__ = ("state", "nbytes", "readers")

    def __init__(self, nbytes: int) -> None:
        self.state = KeyState.WRITING
        self.nbytes = nbytes  # the tensor's bytes, without padding
        self.readers = 0  # reads in flight


class _Request:
    """One write or read: its chunks, how many are not done yet, and the first error among them."""

    def __init__(self, op: str, key: str, path: Path, tensor: Tensor, nbytes: int, block_size: int) -> None:
        padded = round_up(nbytes)
        self.op = op  # "write" or "read"
        self.key = key
        self.path = path
        self.tensor = tensor  # keeps the buffer alive while the workers use it
        self.nbytes = nbytes
        self.view = byte_view(tensor, padded)
        self.chunks = [(at, min(block_size, padded - at)) for at in range(0, padded, block_size)]
        self.left = len(self.chunks)
        self.fd: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.future: Future = Future()

    def chunk_done(self, error: Optional[BaseException]) -> bool:
        """Account for one chunk; True when it was the last."""
        self.left -= 1
        if error is not None and self.error is None:
            self.error = error
        return self.left == 0


class SwapFiles:
    """One rank's swap folder and its files. See [Note: swap files] and [Note: life of the swap folder].

    ``run_id`` must be the same on every rank of a run (make it with :func:`new_run_id` on rank 0 and
    broadcast it); ``block_size`` (a multiple of 4096), ``queue_depth`` and ``threads`` are DeepSpeed's aio
    ``block_size``, ``queue_depth`` and ``intra_op_parallelism``. ``odirect=False`` uses buffered I/O.
    """

    def __init__(
        self,
        nvme_path: PathLike,
        rank: int,
        run_id: Optional[str] = None,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 1,
        odirect: bool = True,
    ) -> None:
        run_id = new_run_id() if run_id is None else run_id
        if not RUN_ID.fullmatch(run_id):
            raise ValueError(f"run_id={run_id!r}: use letters, digits and '_' only.")
        if block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"block_size={block_size:,} is not a positive multiple of {ALIGN} bytes (O_DIRECT).")
        if queue_depth < 1 or threads < 1 or rank < 0:
            raise ValueError(f"queue_depth={queue_depth}, threads={threads}, rank={rank}: need >= 1, >= 1, >= 0.")
        self.nvme_path = Path(nvme_path).expanduser().absolute()
        self.rank, self.run_id = rank, run_id
        self.block_size, self.queue_depth, self.threads = block_size, queue_depth, threads
        self.run_folder = self.nvme_path / f"lzero-{user_name()}-{run_id}"
        self.lock_path = self.run_folder / f"rank{rank}.lock"
        self.folder = self.run_folder / f"rank{rank}"
        self.bytes_written = self.bytes_read = 0  # payload bytes of completed requests
        self.write_seconds = self.read_seconds = 0.0  # wall time with at least one write (read) in flight
        self._busy = {"write": [0, 0.0], "read": [0, 0.0]}  # op -> [requests in flight, since]
        self._keys: dict[str, _Key] = {}
        self._requests: set[_Request] = set()
        self._pending: deque[tuple[_Request, int]] = deque()  # chunks waiting for a free slot
        self._in_flight = 0  # chunks handed to the executor
        self._lock = threading.Lock()
        self._closed = self._removed = False
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=f"lzero-nvme-rank{rank}")
        self._make_folders()
        try:
            self.direct = odirect and self._probe_direct()  # True: files are opened with O_DIRECT
        except BaseException:
            self.remove()
            raise

    def __enter__(self) -> "SwapFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # --- folders -----------------------------------------------------------------------------

    def _make_folders(self) -> None:
        try:
            self.nvme_path.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                self.run_folder.mkdir(mode=0o700)
                os.chmod(self.run_folder, 0o700)  # mkdir's mode passes through the umask
            except FileExistsError:
                _check_own_folder(self.run_folder)
        except OSError as err:
            raise path_error(self.nvme_path, f"cannot make the swap folder {self.run_folder}", err) from err
        try:
            fd = os.open(self.lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise NvmeError(
                f"{self.lock_path} exists: rank {self.rank} of run {self.run_id!r} is already using {self.run_folder}."
                " HINT: give every run its own run_id (the default makes a new one).",
                path=self.lock_path,
            ) from None
        except OSError as err:
            raise path_error(self.nvme_path, f"cannot write the lock file {self.lock_path}", err) from err
        with os.fdopen(fd, "w") as lock:
            json.dump({"lzero": 1, "pid": os.getpid(), "start": start_time(os.getpid()), "host": host_name()}, lock)
        try:
            self.folder.mkdir(mode=0o700)
            os.chmod(self.folder, 0o700)
        except OSError as err:
            self.lock_path.unlink(missing_ok=True)
            raise path_error(self.nvme_path, f"cannot make the swap folder {self.folder}", err) from err

    def _probe_direct(self) -> bool:
        """Whether this folder takes O_DIRECT: open, write and read one aligned block (see [Note: O_DIRECT and
        alignment]); warns once and returns False when ``EINVAL`` says no."""
        probe, block = self.folder / ".probe", aligned_empty(ALIGN, torch.uint8).fill_(1)
        fd = None
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            move_all(os.pwritev, fd, byte_view(block, ALIGN), 0)
            move_all(os.preadv, fd, byte_view(block, ALIGN), 0)
            return True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise path_error(self.nvme_path, f"cannot write in the swap folder {self.folder}", err) from err
            warnings.warn(
                f"lzero's swap folder {self.folder} refuses O_DIRECT ([Errno {err.errno}] {os.strerror(err.errno)});"
                " its files use buffered I/O, which goes through the page cache (host memory). HINT: point"
                " `nvme_path` at a local disk's file system (ext4, xfs) for direct I/O.",
                stacklevel=3,
            )
            return False
        finally:
            if fd is not None:
                os.close(fd)
            probe.unlink(missing_ok=True)

    def remove(self) -> None:
        """Stop, wait for the chunks in flight, then delete the rank folder, the lock and (once empty) the run
        folder. Requests not started fail with :class:`NvmeError`. Idempotent."""
        with self._lock:
            if self._removed:
                return
            self._closed = True
            finished = self._pump()  # drops the chunks still queued
            requests = list(self._requests)
        self._finish_all(finished)
        for request in requests:
            request.future.exception()  # waits; its error, if any, is on its future
        self._executor.shutdown(wait=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.lock_path.unlink(missing_ok=True)
        try:
            self.run_folder.rmdir()
        except OSError:  # other ranks' files are still there, or it is gone already
            pass
        self._removed = True

    # --- requests ----------------------------------------------------------------------------

    def write(self, key: str, data: Tensor) -> Future:
        """Write ``data`` (1-D, contiguous, from :func:`aligned_empty`) to the file ``key``. The future's result
        is None once the file holds the bytes; a failed write raises :class:`NvmeError` from ``result()``."""
        path, nbytes = self._path(key), self._check_buffer(data, "data")
        with self._lock:
            self._check_open()
            held = self._keys.get(key)
            if held is not None and (held.state is KeyState.WRITING or held.readers):
                raise NvmeError(f"swap file {path} is being {'written' if held.readers == 0 else 'read'};"
                                " HINT: wait for that request's future before writing it again.", path=path)
            self._keys[key] = _Key(nbytes)
        return self._start(_Request("write", key, path, data, nbytes, self.block_size), os.O_WRONLY | os.O_CREAT)

    def read(self, key: str, out: Tensor) -> Future:
        """Read the file ``key`` into ``out`` (1-D, contiguous, from :func:`aligned_empty`, as many bytes as were
        written). The future's result is ``out``; errors of the I/O raise :class:`NvmeError` from ``result()``."""
        path, nbytes = self._path(key), self._check_buffer(out, "out")
        with self._lock:
            self._check_open()
            held = self._keys.get(key)
            if held is None or held.state is not KeyState.COMPLETE:
                why = ("was never written" if held is None else "is still being written"
                       if held.state is KeyState.WRITING else "is incomplete: its last write failed")
                raise NvmeError(f"cannot read swap file {path}: it {why}. HINT: read a key only after its write's"
                                " future completed without error.", path=path, op="read", nbytes=nbytes)
            if held.nbytes != nbytes:
                raise ValueError(f"swap file {path} holds {held.nbytes:,} bytes; `out` has {nbytes:,}.")
            held.readers += 1
        return self._start(_Request("read", key, path, out, nbytes, self.block_size), os.O_RDONLY)

    def wait_all(self) -> None:
        """Wait for every request in flight; raises the first :class:`NvmeError` among them (each error is also
        on its own future)."""
        with self._lock:
            requests = list(self._requests)
        errors = [request.future.exception() for request in requests]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"swap file key {key!r}: use letters, digits, '_', '.' and '-' (no path separator,"
                             " no leading dot).")
        return self.folder / key

    def _check_buffer(self, tensor: Tensor, name: str) -> int:
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        room = storage.data_ptr() + storage.nbytes() - tensor.data_ptr()
        if (tensor.device.type != "cpu" or tensor.dim() != 1 or not tensor.is_contiguous()
                or tensor.data_ptr() % ALIGN or room < round_up(nbytes)):
            raise ValueError(f"`{name}` must be a 1-D contiguous CPU tensor at a {ALIGN}-byte aligned address with"
                             f" room for {round_up(nbytes):,} bytes (it has {room:,} from its address, device"
                             f" {tensor.device}, shape {tuple(tensor.shape)}). HINT: allocate it with aligned_empty.")
        return nbytes

    def _check_open(self) -> None:
        if self._closed:
            raise NvmeError(f"the swap files of {self.folder} were removed.", path=self.folder)

    def _start(self, request: _Request, flags: int) -> Future:
        flags |= os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            request.fd = os.open(request.path, flags, 0o600)
        except OSError as err:
            request.error = self._io_error(request, 0, err)
            request.left = 0
        with self._lock:
            self._requests.add(request)
            busy = self._busy[request.op]
            if busy[0] == 0:
                busy[1] = time.perf_counter()
            busy[0] += 1
            self._pending.extend((request, index) for index in range(request.left))
            finished = self._pump() + ([request] if request.left == 0 else [])
        self._finish_all(finished)
        return request.future

    def _pump(self) -> list[_Request]:
        """(Under the lock.) Hand queued chunks to the executor while fewer than ``queue_depth`` are in flight;
        chunks of failed requests, or of a removed folder, are dropped. Returns the requests that finished."""
        finished = []
        while self._pending and (self._closed or self._in_flight < self.queue_depth):
            request, index = self._pending.popleft()
            if self._closed or request.error is not None:
                error = request.error or NvmeError(f"swap file {request.path}: its folder was removed before this"
                                                   f" {request.op} ran.", path=request.path, op=request.op)
                if request.chunk_done(error):
                    finished.append(request)
                continue
            self._in_flight += 1
            self._executor.submit(self._run_chunk, request, index)
        return finished

    def _run_chunk(self, request: _Request, index: int) -> None:
        at, length = request.chunks[index]
        error = None
        try:
            move_all(os.pwritev if request.op == "write" else os.preadv, request.fd, request.view[at : at + length], at)
        except OSError as err:
            error = self._io_error(request, at, err)
        except BaseException as err:  # a bug: still fail the request rather than hang its future
            error = err
        with self._lock:
            self._in_flight -= 1
            last = request.chunk_done(error)  # first: a failed request's queued chunks are then dropped
            finished = self._pump() + ([request] if last else [])
        self._finish_all(finished)

    def _finish_all(self, requests: list[_Request]) -> None:
        for request in requests:
            self._finish(request)

    def _finish(self, request: _Request) -> None:
        """Close the file, record the key's state and the counters, then complete the future."""
        if request.fd is not None:
            try:
                if request.op == "write" and request.error is None and os.fstat(request.fd).st_size > len(request.view):
                    os.ftruncate(request.fd, len(request.view))  # an earlier, longer write of the key
                os.close(request.fd)
            except OSError as err:
                request.error = request.error or self._io_error(request, len(request.view), err)
        with self._lock:
            held = self._keys.get(request.key)
            if request.op == "write":
                held.state = KeyState.COMPLETE if request.error is None else KeyState.FAILED
            else:
                held.readers -= 1
            if request.error is None:
                self._count(request.op, request.nbytes)
            busy = self._busy[request.op]
            busy[0] -= 1
            if busy[0] == 0:
                self._count(request.op, 0, time.perf_counter() - busy[1])
            self._requests.discard(request)
        if request.error is not None:
            request.future.set_exception(request.error)
        else:
            request.future.set_result(request.tensor if request.op == "read" else None)

    def _count(self, op: str, nbytes: int, seconds: float = 0.0) -> None:
        if op == "write":
            self.bytes_written += nbytes
            self.write_seconds += seconds
        else:
            self.bytes_read += nbytes
            self.read_seconds += seconds

    def _io_error(self, request: _Request, at: int, err: OSError) -> NvmeError:
        padded = len(request.view)
        mode = "O_DIRECT" if self.direct else "buffered"
        where = "to" if request.op == "write" else "from"
        return NvmeError(
            f"lzero could not {request.op} {request.nbytes:,} bytes ({padded:,} with padding) {where} swap file"
            f" {request.path} ({mode} I/O, failed at byte {at:,}): [Errno {err.errno}]"
            f" {os.strerror(err.errno) if err.errno else err}. HINT: {_hint(err.errno, self.nvme_path, padded)}",
            path=request.path, op=request.op, nbytes=request.nbytes, errno=err.errno,
        )


def _hint(code: Optional[int], folder: Path, padded: int) -> str:
    """How to fix an I/O error ``code`` on a file of ``padded`` bytes under ``folder`` (``nvme_path``)."""
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(folder)
        what = "is full" if code == errno.ENOSPC else "is over your disk quota"
        return (f"the file system of `nvme_path` ({folder}) {what} ({free:,} bytes free; this file"
                f" needs {padded:,}): free space there or point `nvme_path` at a disk with room (check_space says"
                " how much a run needs).")
    if code == errno.EINVAL:
        return (f"O_DIRECT refused the request: buffers must come from aligned_empty and block_size be a multiple"
                f" of {ALIGN}.")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"lzero may not write in {folder}: check its permissions and that the disk is mounted read-write."
    if code == errno.ENOENT:
        return f"the swap folder under {folder} was removed while the run used it (by another process?)."
    return f"the disk under {folder} reported an error: check it (dmesg) or point `nvme_path` at another disk."


def new_run_id() -> str:
    """A short unique id for a run's swap folder."""
    return f"{time.strftime('%Y%m%d%H%M%S')}_{uuid.uuid4().hex[:8]}"


def user_name() -> str:
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        name = str(os.getuid())
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def host_name() -> str:
    return socket.gethostname()


def proc_stat(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first); None where /proc
    does not say."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), telling a reused
    pid from the process that wrote a lock; None where /proc does not say."""
    fields = proc_stat(pid)
    try:
        return None if fields is None else int(fields[19])
    except (IndexError, ValueError):
        return None


def _check_own_folder(folder: Path) -> None:
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise NvmeError(f"{folder} exists and is not a folder of this user; lzero will not use it. HINT: use"
                        " another run_id or `nvme_path`.", path=folder)


def free_bytes(path: Path) -> int:
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def path_error(path: Path, what: str, err: OSError) -> NvmeError:
    return NvmeError(
        f"{what} ([Errno {err.errno}] {os.strerror(err.errno) if err.errno else err}). HINT: create it or make it"
        " writable for this user, or point `nvme_path` at a folder on a local disk you can write.",
        path=path, errno=err.errno,
    )
