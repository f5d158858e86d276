"""The host store's CUDA path, run on this CPU with stand-ins for streams, events and page-locked memory
(tests/_fake_cuda.py): nothing inside backward's hooks waits for the host, every gradient copy off the device is
``non_blocking`` into page-locked memory, and the results are bitwise those of the CPU path (issue 46, point 2).

On the code before issue 46 this fails: a landing completed the copies already done inside the hook that landed the
next one (``Event.synchronize``, then a host ``add_`` from a staging buffer), 2 or more per backward here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _engine_cases import Net
from _fake_cuda import fake_cuda, make_cuda_like
from lzero import ZeroConfig, ZeroEngine, ZeroOptimizer


def _train(stage: int, log=None, steps: int = 4, acc: int = 2, clip: float = 0.05):  # noqa: ANN001, ANN202
    """An offloaded fp32 AdamW run with accumulation and clipping, an overflow at step 2 skipped; ``log``: the store
    takes its CUDA path."""
    torch.manual_seed(0)
    model = Net(width=24, depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    options = {"offload_optimizer": "cpu", **({"offload_param": "cpu"} if stage == 3 else {})}
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, reduce_bucket_size=300,
                                                 unit_modules=("Linear",) if stage == 3 else None, **options))
    stores = [s for s in engine.stores if s.name == "cpu"]
    from_device = []  # the device's figures handed to the non-finite check and the clipping norm
    if log is not None:
        for store in stores:
            make_cuda_like(store, log)
            inner = store.grad_stat

            def counted(*args, inner=inner):  # noqa: ANN001, ANN202
                stat = inner(*args)
                from_device.append(args[-1] if stat is not None else "reread on the host")
                return stat

            store.grad_stat = counted
    zopt = ZeroOptimizer(opt, engine, 0)
    gen = torch.Generator().manual_seed(7)
    losses, norms, skipped = [], [], []
    for step in range(steps):
        for micro in range(acc):
            x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 5, generator=gen)
            if step == 1 and micro == 0:
                x[0, 0] = float("inf")  # an overflow, as fp16 would make: the check must see it, from the device
            engine.gather_root()
            loss = nn.functional.mse_loss(model(x), y) / acc
            loss.backward()
            losses.append(loss.item())
        skipped.append(engine.found_nonfinite(engine.units))
        if skipped[-1]:
            engine.release_grads(engine.units)
        else:
            norms.append(engine.clip_grad_norm_(engine.units, clip).item())
            zopt.step()
        zopt.zero_grad()
    assert skipped == [i == 1 for i in range(steps)], skipped
    grads = [t.untyped_storage().data_ptr() for s in stores for t in getattr(s, "gradient_buffers", list)()]
    used_stats = sorted(set(from_device))
    engine.unshard()
    params = [p.detach().clone() for p in model.parameters()]
    engine.remove()
    return params, losses, norms, grads, used_stats


@pytest.mark.parametrize("stage", [2, 3])
def test_no_host_wait_in_backward_and_pinned_non_blocking_copies(stage: int, monkeypatch) -> None:
    reference, ref_losses, ref_norms, _, _ = _train(stage)
    with fake_cuda(monkeypatch) as log:
        params, losses, norms, grads, used_stats = _train(stage, log)
    def ptr(t):  # noqa: ANN001, ANN202
        return None if t is None else t.untyped_storage().data_ptr()

    landings = [c for c in log.copies if c["op"] == "copy_" and ptr(c["dst"]) in grads]
    in_hooks = [c for c in landings if c["in_backward"]]
    print(f"stage {stage}: {len(landings)} gradient copies off the device ({len(in_hooks)} from backward's hooks),"
          f" host synchronizations {log.syncs} ({log.syncs_in_backward} inside backward)")
    assert log.syncs_in_backward == 0 and log.syncs > 0  # the step waits, once per store and step
    assert len(in_hooks) >= 4 * 2 * 3  # steps x micro-batches x units, at least: the hooks are exercised
    assert all(c["non_blocking"] and c["stream"] == "side" for c in landings)
    assert all(c["dst_pinned"] for c in landings)
    # accumulation reads the host sum back to the device, from page-locked memory too, never on the host
    ups = [c for c in log.copies if c["op"] == "to" and ptr(c["src"]) in grads]
    assert ups and all(c["non_blocking"] and c["src_pinned"] for c in ups)
    # the overflow check and the clipping norm took the device's figures, never rereading the host gradients
    assert used_stats == ["sq_norm", "sum"]
    assert len(norms) == 3 and norms == ref_norms
    assert all(a == b or (a != a and b != b) for a, b in zip(losses, ref_losses, strict=True))  # NaN at the overflow
    assert all(torch.equal(a, b) for a, b in zip(params, reference))
