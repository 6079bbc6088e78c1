"""Loss scalers step by step, and the overflow check agreeing across ranks."""

import json

import pytest
import torch

from megapp.optimizer import ConstantGradScaler, DynamicGradScaler, found_inf_in
from megapp.testing import distributed


def _scales(scaler, found_infs):
    """The scale after each ``update`` in turn."""
    scales = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        scales.append(scaler.scale_value)
    return scales


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(2.0**12, device="cpu")
    assert _scales(scaler, [True, False, True] + [False] * 5) == [4096.0] * 8
    assert scaler.scale.tolist() == [4096.0]
    assert scaler.inv_scale.tolist() == [1 / 4096]
    assert scaler.scale.dtype == scaler.inv_scale.dtype == torch.float32


def test_hysteresis_then_backoff_floored_at_min_scale():
    scaler = DynamicGradScaler(
        initial_scale=2.0**10, min_scale=2.0**8, growth_interval=3, hysteresis=2, device="cpu"
    )
    # First overflow only spends hysteresis; then each overflow halves, down to min_scale.
    assert _scales(scaler, [True, True, True, True]) == [1024.0, 512.0, 256.0, 256.0]
    assert scaler.inv_scale.tolist() == [1 / 256]


def test_growth_after_interval_and_overflow_restarts_the_count():
    scaler = DynamicGradScaler(
        initial_scale=8.0, growth_factor=2.0, growth_interval=3, hysteresis=2, device="cpu"
    )
    sequence = [False, False, True, False, False, False, False, False, False]
    # The overflow at step 3 spends one unit of hysteresis (no backoff) and restarts the
    # clean count, so growth comes 3 clean steps later (step 6), then again at step 9.
    assert _scales(scaler, sequence) == [8.0, 8.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0]


def test_hysteresis_is_refilled_only_by_growth():
    scaler = DynamicGradScaler(initial_scale=64.0, growth_interval=2, hysteresis=2, device="cpu")
    # Overflows separated by a single clean step still add up: the second one backs off.
    assert _scales(scaler, [True, False, True]) == [64.0, 64.0, 32.0]
    # Two clean steps grow the scale and refill hysteresis: the next overflow is absorbed.
    assert _scales(scaler, [False, False, True, True]) == [32.0, 64.0, 64.0, 32.0]


def test_hysteresis_one_backs_off_immediately_and_min_scale_holds():
    scaler = DynamicGradScaler(
        initial_scale=4.0, min_scale=1.0, backoff_factor=0.25, hysteresis=1, device="cpu"
    )
    assert _scales(scaler, [True, True, True]) == [1.0, 1.0, 1.0]


def test_state_dict_round_trip_continues_identically():
    options = dict(initial_scale=2.0**16, growth_interval=3, hysteresis=3, device="cpu")
    original = DynamicGradScaler(**options)
    history = [True, False, True, False, False]
    _scales(original, history)
    state = original.state_dict()
    json.dumps(state)  # plain Python scalars only
    resumed = DynamicGradScaler(**options)
    resumed.load_state_dict(state)
    future = [True, False, False, False, True, True, False]
    assert _scales(resumed, future) == _scales(original, future)
    assert resumed.state_dict() == original.state_dict()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(min_scale=0.0), "min_scale must be > 0"),
        (dict(initial_scale=0.5), "must be >= min_scale"),
        (dict(growth_factor=1.0), "growth_factor must be > 1"),
        (dict(backoff_factor=1.0), "backoff_factor must be in"),
        (dict(growth_interval=0), "growth_interval must be >= 1"),
        (dict(hysteresis=0), "hysteresis must be >= 1"),
    ],
)
def test_bad_settings_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        DynamicGradScaler(device="cpu", **overrides)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_found_inf_locally(bad):
    grads = [torch.ones(3, 4), torch.zeros(5, dtype=torch.bfloat16)]
    assert found_inf_in(grads) is False
    grads[1][2] = bad
    assert found_inf_in(grads) is True
    assert found_inf_in([]) is False


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), None])
@distributed(world_size=2)
def test_found_inf_agrees_across_ranks(bad):
    rank = torch.distributed.get_rank()
    grads = [torch.full((4, 3), 65504.0, dtype=torch.float16), torch.randn(7)]
    if bad is not None and rank == 1:
        grads[1][3] = bad
    # Rank 0's own grads are finite; it must still report the overflow seen on rank 1.
    assert found_inf_in(grads, group=torch.distributed.group.WORLD) is (bad is not None)
