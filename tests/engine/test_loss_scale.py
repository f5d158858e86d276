"""The loss scaler against hand-computed sequences (DeepSpeed's DynamicLossScaler rules)."""

from __future__ import annotations

import pytest

from lzero import LossScaleConfig, LossScaleError, LossScaler

O, _ = True, False  # overflow / clean step


def run(config: LossScaleConfig, overflows: list[bool]) -> list[float]:
    scaler = LossScaler(config)
    scales = []
    for overflow in overflows:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


def test_window_doubles_after_window_clean_steps() -> None:
    # steps count from 0 and the last overflow from -1: doublings after steps 2, 5, 8 for window 3
    assert run(LossScaleConfig(initial_scale_power=4, loss_scale_window=3), [_] * 9) == [
        16, 16, 32, 32, 32, 64, 64, 64, 128]


def test_hysteresis_without_refill_between_overflows() -> None:
    # hysteresis 2: the first overflow only uses up hysteresis; the counter is refilled only when the
    # scale grows, so the overflow at step 5 (no growth since step 2) halves at once
    cfg = LossScaleConfig(initial_scale_power=4, loss_scale_window=4, hysteresis=2)
    assert run(cfg, [_, O, _, O, _, O, _, _, _, O, O]) == [
        16, 16, 16, 8, 8, 4, 4, 4, 4, 2, 1]
    # step 1: 1 left; step 3: halve (last overflow 3); step 5: halve (last 5); steps 6-8 are three
    # clean steps, one short of the window; steps 9 and 10 each halve (left is still 1)


def test_window_refills_hysteresis() -> None:
    cfg = LossScaleConfig(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    # step 0 overflow: left 1; step 2: (2-0)%2==0 -> x2 and refill; step 3 overflow: left 1 (no halving)
    assert run(cfg, [O, _, _, O, _, O]) == [16, 16, 32, 32, 32, 16]


def test_consecutive_hysteresis_refills_after_every_clean_step() -> None:
    overflows = [O, _, O, _, O, O]
    plain = LossScaleConfig(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    consecutive = LossScaleConfig(initial_scale_power=4, loss_scale_window=100, hysteresis=2,
                                  consecutive_hysteresis=True)
    assert run(plain, overflows) == [16, 16, 8, 8, 4, 2]
    assert run(consecutive, overflows) == [16, 16, 16, 16, 16, 8]  # only two overflows in a row halve


def test_min_scale_floor_and_error_after_consecutive_overflows_at_min() -> None:
    cfg = LossScaleConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=1, max_overflows_at_min_scale=3)
    scaler = LossScaler(cfg)
    for expected in (2, 1, 1, 1):  # 4 -> 2 -> 1, then two overflows at the floor are tolerated
        scaler.update(True)
        assert scaler.scale == expected
    scaler.update(False)  # a clean step resets the count
    scaler.update(True)
    scaler.update(True)
    with pytest.raises(LossScaleError, match="3 consecutive steps at the minimum loss scale 1"):
        scaler.update(True)


def test_static_scale_never_changes_but_stuck_static_scale_errors() -> None:
    cfg = LossScaleConfig(loss_scale=128, max_overflows_at_min_scale=2)
    assert run(cfg, [_, O, _, _]) == [128, 128, 128, 128]
    scaler = LossScaler(cfg)
    scaler.update(True)
    with pytest.raises(LossScaleError):
        scaler.update(True)


def test_state_round_trip_continues_the_same_sequence() -> None:
    cfg = LossScaleConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    overflows = [_, O, _, _, O, _, _, _, _, O, _, _]
    whole = run(cfg, overflows)
    first = LossScaler(cfg)
    for o in overflows[:5]:
        first.update(o)
    second = LossScaler(cfg)
    second.load_state_dict(first.state_dict())
    rest = []
    for o in overflows[5:]:
        second.update(o)
        rest.append(second.scale)
    assert rest == whole[5:]
    with pytest.raises(ValueError, match="lacks"):
        second.load_state_dict({"scale": 2.0})


@pytest.mark.parametrize("field, value", [("loss_scale_window", 0), ("hysteresis", -1), ("initial_scale_power", 70),
                                          ("loss_scale", -1.0), ("min_loss_scale", 0.0),
                                          ("max_overflows_at_min_scale", 1.5)])
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LossScaleConfig(**{field: value})
