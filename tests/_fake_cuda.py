"""Stand-ins for CUDA streams, events and page-locked memory, so the host store's CUDA code path runs on this CPU.

Every tensor stays on the CPU and every copy runs at once; what the stand-ins record is what matters on a GPU:
which stream each copy was enqueued on, whether it was ``non_blocking``, whether its host side is page-locked,
and every host synchronization (``Event.synchronize``, ``Stream.synchronize``), with whether it happened inside
autograd's backward (where the host store's hooks run).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class Log:
    syncs_in_backward: int = 0
    syncs: int = 0
    copies: list[dict] = field(default_factory=list)  # every copy_/to enqueued on a side stream
    pinned: set[int] = field(default_factory=set)  # storage data_ptrs handed out as page-locked
    current: Any = None  # the stream work is enqueued on


class FakeStream:
    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: "FakeStream") -> None:
        pass

    def wait_event(self, event: "FakeEvent") -> None:
        pass

    def synchronize(self) -> None:
        self.log.syncs += 1
        self.log.syncs_in_backward += in_backward()


class FakeEvent:
    def __init__(self, log: Log) -> None:
        self.log = log

    def record(self, stream: FakeStream = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.syncs += 1
        self.log.syncs_in_backward += in_backward()


def _recording(log: Log, name: str) -> Any:
    """``Tensor.<name>`` (``copy_`` or ``to``), recording each call made while a side stream is current. A method
    patch, not a TorchFunctionMode: modes do not reach the gradient hooks that autograd's engine runs."""
    method = getattr(torch._C.TensorBase, name)

    def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        stream = log.current
        if stream is not None and stream.name != "compute":
            copy = name == "copy_"
            log.copies.append({
                "stream": stream.name, "op": name, "in_backward": in_backward(),
                "non_blocking": bool(kwargs.get("non_blocking", args[1] if copy and len(args) > 1 else False)),
                # the tensors themselves: alive until the test ends, no later tensor can take their addresses
                "dst": self if copy else None, "src": args[0] if copy else self,
                "dst_pinned": copy and self.untyped_storage().data_ptr() in log.pinned,
                "src_pinned": (args[0] if copy else self).untyped_storage().data_ptr() in log.pinned,
            })
        return method(self, *args, **kwargs)

    return call


@contextlib.contextmanager
def fake_cuda(monkeypatch: Any) -> Iterator[Log]:
    """Patch torch.cuda's stream and event API with the stand-ins; yields the log."""
    log = Log()
    compute = FakeStream(log, "compute")
    log.current = compute

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        before, log.current = log.current, s
        try:
            yield
        finally:
            log.current = before

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: log.current)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    for name in ("copy_", "to"):
        monkeypatch.setattr(torch.Tensor, name, _recording(log, name))
    yield log


def make_cuda_like(store: Any, log: Log) -> None:
    """Turn a CPU ``HostStore`` into one that takes its CUDA path (streams, events, page-locked buffers)."""
    store.cuda = True
    store.pin = True
    store.copy_stream = torch.cuda.Stream(store.device)

    def pinned(nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        log.pinned.add(buffer.untyped_storage().data_ptr())
        return buffer

    store._pinned = pinned
