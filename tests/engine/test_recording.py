"""Where a recording lives ([Note: where recordings live] in lzero/engine/recording.py): a model's own tensors find
the recording that built it, however many were made since; the recording goes with its model; the open meta context
belongs to the context that opened it."""

from __future__ import annotations

import gc
import threading
import weakref

import torch


def _build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def test_a_model_finds_its_recording_after_six_more_were_made() -> None:
    """Six models built after it (lzero once kept the last four recordings of the process): it still starts from the
    eager weights, and the RNG continues where eager construction left it."""
    from lzero import ZeroConfig, ZeroEngine
    from lzero.lightning.wiring import meta_device

    torch.manual_seed(0)
    eager = _build().state_dict()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_device():
        model = _build()
    others = []
    for _ in range(6):  # meta draws: the global RNG does not move
        with meta_device():
            others.append(_build())
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3, exact_init=True))
    try:
        assert torch.equal(torch.get_rng_state(), after_eager)
        with engine.gathered(model):
            assert all(torch.equal(v, eager[k]) for k, v in model.state_dict().items())
    finally:
        engine.remove()


def test_a_recording_goes_with_its_model() -> None:
    from lzero.engine.recording import recorder_for, settle
    from lzero.lightning.wiring import meta_device

    with meta_device():
        model = _build()
    settle(model)
    recorder, why = recorder_for(list(model.parameters()))
    assert recorder is not None, why
    gone = weakref.ref(recorder)
    del recorder, model
    gc.collect()
    assert gone() is None


def test_the_open_meta_context_is_its_own_contexts() -> None:
    """Files for values are handed to the innermost open recording only; another thread sees no context open."""
    from lzero.engine import recording

    def provide() -> dict:
        return {}

    recording.read_values_from_files(provide)  # nothing open: a no-op
    seen = []
    with recording.record() as recorder:
        with recorder.building_on(torch.device("cpu")):
            recording.read_values_from_files(provide)
            recording.read_values_from_files(provide)
            thread = threading.Thread(target=lambda: seen.append(recording._innermost()))
            thread.start()
            thread.join()
            assert recording._innermost() is recorder
        assert recording._innermost() is None
    assert recorder.file_loads == [provide] and seen == [None]
