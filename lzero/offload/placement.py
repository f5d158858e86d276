"""Which store holds what: the optimizer store of each unit and the parameter store, as ``ZeroConfig``'s
offload blocks ask (see [Note: shard stores] in store.py)."""

from __future__ import annotations

import tempfile
from typing import Any, Optional

import torch

from lzero.log import info_on_rank_zero
from lzero.offload.nvme import SwapFiles
from lzero.offload.nvme_checks import check_buffer, check_path, check_space, cleanup_stale, sweep_at_exit
from lzero.offload.nvme_store import NvmeStore
from lzero.offload.store import DeviceStore, HostStore, ShardStore


def stores_for(config: Any, device: torch.device, numels: list[int], rank: int = 0, world_size: int = 1,
               run_id: Optional[str] = None) -> tuple[list[ShardStore], ShardStore]:
    """The optimizer store of each unit (``numels``: their sizes, in unit order) and the parameter store,
    as ``config.offload_optimizer`` / ``config.offload_param`` ask. With ``offload_optimizer.ratio`` < 1 the
    first units, up to ``1 - ratio`` of the elements, keep their state on the device (DeepSpeed's Twin-Flow).
    NVMe: ``rank``'s swap folder of the run ``run_id`` (the same on every rank)."""
    device_store = DeviceStore()
    optimizer_offload, param_offload = config.offload_optimizer, config.offload_param
    host = None
    if optimizer_offload.device == "cpu" or param_offload.device == "cpu":
        pin = optimizer_offload.pin_memory if optimizer_offload.device == "cpu" else param_offload.pin_memory
        host = HostStore(device, pin, huge_pages=optimizer_offload.huge_pages)
    param_store = host if param_offload.device == "cpu" else device_store
    nvme = None
    if optimizer_offload.device == "nvme" or param_offload.device == "nvme":
        # one store (one swap folder) for both blocks; this rank's bytes: 12 per offloaded optimizer element
        # (fp32 master and Adam's moments) and 4 per parameter element (at most; 2 in 16-bit)
        offloaded = sum(numels) / world_size
        masters = 4 * offloaded * optimizer_offload.ratio * (optimizer_offload.device == "nvme")
        params = 4 * offloaded * (param_offload.device == "nvme")
        nvme = _nvme_store(config, device, 3 * masters + params, masters + params, rank, run_id)
    if param_offload.device == "nvme":
        param_store = nvme
    if optimizer_offload.device == "nvme":
        host = nvme
    elif optimizer_offload.device != "cpu":
        return [device_store] * len(numels), param_store
    on_device = (1.0 - optimizer_offload.ratio) * sum(numels)
    stores, before = [], 0
    for numel in numels:
        stores.append(device_store if before + numel <= on_device else host)
        before += numel
    return stores, param_store


def _nvme_store(config: Any, device: torch.device, need: float, initial: float, rank: int,
                run_id: Optional[str]) -> ShardStore:
    """The NVMe store of ``offload_optimizer`` and/or ``offload_param`` (``need``: this rank's bytes in files;
    ``initial``: those written before the first step), after the checks its folder must pass."""
    optimizer, param, aio = config.offload_optimizer, config.offload_param, config.aio
    blocks = [b for b in (optimizer, param) if b.device == "nvme"]
    chosen = next((b.nvme_path for b in blocks if b.nvme_path is not None), None)  # ZeroConfig: they agree
    path = check_path(chosen if chosen is not None else tempfile.gettempdir())
    if param.device == "nvme":
        check_buffer(param.buffer_size * 4, aio.block_size)
    cleanup_stale(path)  # folders of this user's dead runs, found by their locks
    check_space(path, int(need))
    files = SwapFiles(path, rank, run_id, block_size=aio.block_size, queue_depth=aio.queue_depth,
                      threads=aio.intra_op_parallelism)
    sweep_at_exit(files.run_folder)  # ranks a launcher kills on Ctrl+C cannot remove their own files
    first = blocks[0]
    return NvmeStore(device, files, first.pin_memory, getattr(optimizer, "buffer_count", 4),
                     optimizer.pipeline_read if optimizer.device == "nvme" else False,
                     optimizer.pipeline_write if optimizer.device == "nvme" else False,
                     max_in_cpu=param.max_in_cpu if param.device == "nvme" else 0, initial_bytes=int(initial))


def announce_offload(engine: Any, optimizers: list[Any], threads: Optional[int]) -> None:
    """One line on rank 0: what is offloaded, the host step's kernel and its threads (``engine``: a ZeroEngine;
    ``optimizers``: its ZeroOptimizers)."""
    trainable = [u for u in engine.units if not u.spec.frozen]
    host = sum(u.spec.shard_numel for u in trainable if u.store.name != "device")
    total = sum(u.spec.shard_numel for u in trainable)
    kernels = ", ".join(sorted({z.host_kernel for z in optimizers if z.host_kernel}))
    where = {u.store.name for u in trainable if u.store.name != "device"}
    places = " and ".join("NVMe swap files" if w == "nvme" else "host memory" for w in sorted(where)) or "host memory"
    offloaded = [u for u in engine.units if u.param_store.name != "device"]
    in_files = sum(u.spec.shard_numel for u in offloaded if u.param_store.holds_in_file(u))
    in_host = sum(u.spec.shard_numel for u in offloaded) - in_files
    params = ""
    if offloaded:
        params = "; parameter shard elements per rank: " + ", ".join(
            f"{n:,} in {w}" for n, w in ((in_files, "NVMe swap files"), (in_host, "host memory")) if n)
        if in_files == 0 and any(u.param_store.name == "nvme" for u in offloaded):
            params += " (all within `offload_param.max_in_cpu`)"
    folders = {str(s.files.run_folder) for s in engine.stores if hasattr(s, "files")}
    if folders:
        params += f"; swap folder {', '.join(sorted(folders))} (removed at the end of fit" + (
            ", or at stage 3 once the model it leaves sharded is gathered back or freed)" if engine.gatherer else ")")
    count = threads or torch.get_num_threads()
    thread_note = f"{count} thread{'s' if count > 1 else ''} per process" + (" (torch.set_num_threads)" if threads else "")
    info_on_rank_zero(f"lzero offload: fp32 masters and optimizer state of {host:,} of {total:,} shard elements per rank in"
                   f" {places}{params}; host step: {kernels or 'none'}, {thread_note}.")
