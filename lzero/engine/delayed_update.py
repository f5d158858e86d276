"""The one-step delayed parameter update of offloaded units (``offload_optimizer.delayed_update``).

[Note: one-step delayed update]
The ZeRO-Offload paper (section 5.3, "DPU") hides the host's optimizer step behind the device's next forward
and backward: the host step of step t runs while the device computes step t+1, which therefore uses the
parameters of step t-1. With masters m and gradients g:

    m(t+1) = step(m(t), g(t)),   g(t) computed at m(t-1)   (m(-1) = m(0))

so each step's gradient is one update stale; the paper reports the same convergence once a few steps have
run without the delay. lzero runs it as follows (``optimizer.step()`` of step t, every rank):

1. Clipping, the non-finite check and loss scaling have run on step t's own gradients, as without the delay.
2. ``finish``: wait for the step launched by the previous call (the worker thread's), then publish its
   masters into the compute shards and, at stages 1-2, all-gather them (stage 3 gathers on demand): the
   parameters are now m(t). The worker already cast each stepped master into its store's outgoing buffer
   (``FlatUnit.cast_for_publish``, right after its bucket's step), so publishing only enqueues the uploads on a
   GPU, or swaps the outgoing buffer in as the stage-3 shard kept in host memory: the main thread does no
   host arithmetic for the step.
3. ``launch``: each unit with a gradient hands it to its master's ``.grad`` (``FlatUnit.hand_grad_to_step``)
   and its gradient buffers are freed for the next backward; the user's hyperparameters are copied into the
   inner optimizers now, on the main thread (an LR scheduler steps right after); then a single worker thread
   steps every bucket, m(t+1) = step(m(t), g(t)), while ``optimizer.step()`` returns and step t+1's forward
   starts.

While a unit is ``stepping`` the worker owns its master and the master's ``.grad`` (the step's gradient, kept
until ``finish`` drops it: one more fp32 gradient shard per rank in host memory, which the estimator and the
memory log count): the main thread's gradient bookkeeping (``mark_reduced``, ``release_grads``) leaves that
``.grad`` alone and reads each step's gradient from ``shard_grad`` (``has_step_grad``). The compute shards the forward reads are separate tensors,
written only by ``finish`` on the main thread. Torch's kernels release the GIL, so the host step runs beside
the main thread's work; on CUDA that work is launching kernels, so the host step is hidden behind the device's
compute. On a CPU model (this project's test machine) both share the same cores, and the delay buys nothing.

Everything that reads or writes the masters, the optimizer state or the parameters as the user sees them first
calls ``ZeroEngine.flush_delayed_update`` (steps 2 without 3): checkpoint saving and loading, the optimizer's
state dicts, validate/test/predict, and the end of fit. A checkpoint therefore holds no step in flight, and a
run resumed from it continues exactly as the run that saved it. An exception on the worker is raised by the
next ``finish``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, ContextManager, Optional, Sequence

from lzero.engine.flat_unit import FlatUnit

Steps = Sequence[tuple[list[FlatUnit], Callable[[], None]]]


class DelayedUpdate:
    """The step in flight on the worker thread, and the buckets it steps. See [Note: one-step delayed update]."""

    def __init__(self, resident: Callable[..., ContextManager[None]]) -> None:
        self._resident = resident  # ZeroEngine.resident: the masters and optimizer state in memory
        self._pool: Optional[ThreadPoolExecutor] = None
        self._future: Optional[Future] = None
        self._buckets: list[list[FlatUnit]] = []  # the buckets of the step in flight, in step order
        self._stepped: list[FlatUnit] = []  # the units it steps (those with a gradient)

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def launch(self, steps: Steps) -> None:
        """Start stepping ``steps`` (each bucket's units and the call that steps them) on the worker thread. The
        units' gradients are handed to their masters and their buffers freed; the calls must not read anything
        the main thread changes afterwards (hyperparameters are copied before)."""
        assert self._future is None, "finish() the step in flight first"
        buckets = [list(bucket) for bucket, _ in steps]
        stepped = [unit for bucket in buckets for unit in bucket if unit.has_step_grad]
        for unit in stepped:
            unit.hand_grad_to_step()
        for bucket in buckets:
            for unit in bucket:
                unit.release_grads()  # the next backward's reductions allocate new buffers
        work = [([u for u in bucket if u.stepping], step) for bucket, (_, step) in zip(buckets, steps)]

        def run() -> None:
            for units, step in work:
                if units:
                    with self._resident(units, write=True):
                        step()
                    for unit in units:  # the host side of the publish, while the values are fresh
                        unit.cast_for_publish()

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lzero-delayed-update")
        self._buckets, self._stepped = buckets, stepped
        self._future = self._pool.submit(run)

    def finish(self) -> tuple[list[list[FlatUnit]], list[FlatUnit]]:
        """Wait for the step in flight (raising its exception, if it failed); returns its buckets and the units it
        stepped, whose masters now hold the new values (nothing when no step was in flight)."""
        if self._future is None:
            return [], []
        future, buckets, stepped = self._future, self._buckets, self._stepped
        self._future, self._buckets, self._stepped = None, [], []
        try:
            future.result()
        finally:
            for unit in stepped:  # the gradient is consumed, as a step without the delay leaves it
                unit.master_shard.grad = None
                unit.stepping = False
        return buckets, stepped

    def close(self, after_failure: bool = False) -> None:
        """Stop the worker. ``after_failure``: a step in flight is waited for, and its exception dropped (the
        failure being handled is the one to report)."""
        try:
            if after_failure:
                try:
                    self.finish()
                except Exception:  # noqa: BLE001 - reported by the failure already on its way
                    pass
            else:
                self.finish()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

