"""Host buffers that live for the whole run: page-locked where a GPU copies them, backed by huge pages where asked.

[Note: persistent host buffers]
The host store's hot path (a gradient landing, the publish of a stepped master) writes whole units every step. Memory
a step allocates anew costs a page fault per 4 KiB on its first write, and on this CPU that fault is three times the
copy itself (0.6 s per GB into fresh memory against 0.19 s per GB into a reused buffer; issue 46), so every host
buffer of the hot path is allocated once, at its first use, and kept until the store closes.

On CUDA those buffers are page-locked, so copies to and from them run as DMA beside the host and the device
(``non_blocking``). They are page-locked by registering an ordinary allocation with the driver
(``cudaHostRegister``), not through torch's caching host allocator: that allocator rounds every block up to a
power of two, up to twice the bytes asked for, which on a host short of memory is the difference between a run and
an out-of-memory error. A registration that fails raises, and the store falls back to pageable memory with one
warning (see [Note: host store copies] in store.py).

``huge_pages`` asks the kernel (``madvise(MADV_HUGEPAGE)``) to back the buffer with 2 MiB pages: 512 times fewer
faults and TLB entries for buffers that are streamed through every step. It is a request: a kernel without
transparent huge pages, or with them set to ``never``, gives 4 KiB pages and the run is unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def host_empty(nbytes: int, pin: bool = False, huge_pages: bool = False) -> Tensor:
    """``nbytes`` of host memory (1-D uint8), kept for the run: page-locked for a GPU's copies with ``pin`` (raises
    RuntimeError when the driver refuses), on huge pages with ``huge_pages`` where the kernel offers them."""
    if huge_pages and nbytes >= HUGE_PAGE and sys.platform.startswith("linux"):
        base = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        skip = -base.data_ptr() % HUGE_PAGE
        out = base[skip : skip + nbytes]
        _advise_huge(out.data_ptr(), nbytes - nbytes % HUGE_PAGE)  # before the first write faults the pages in
    else:
        out = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        register(out)
    return out


def register(buffer: Tensor) -> None:
    """Page-lock ``buffer``'s memory for the CUDA driver (exact size; see the Note)."""
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {int(code)}")


def unregister(buffer: Tensor) -> None:
    """Undo :func:`register` (the store closes); errors are ignored: the process may be shutting CUDA down."""
    try:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except Exception:  # noqa: BLE001 - nothing to do about a driver that is already gone
        pass


_LIBC: Optional[ctypes.CDLL] = None


def _advise_huge(address: int, length: int) -> None:
    global _LIBC
    if length <= 0:
        return
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)  # a request: errors change nothing

