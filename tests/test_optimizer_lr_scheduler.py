"""The learning-rate schedule against hand-computed values, and an exact resume."""

import json

import pytest
import torch

from megapp.optimizer import LRScheduler, ScheduleMismatchError

# max 1.0, min 0.1, 10 warmup steps, decay ends at step 110 (a 100-step decay span).
SCHEDULE = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)

# step -> lr, worked out by hand from the formulas in the module docstring.
EXPECTED = {
    "constant": {0: 0.0, 5: 0.5, 10: 1.0, 35: 1.0, 60: 1.0, 110: 1.0, 500: 1.0},
    # 0.1 + 0.9 * (1 - ratio), ratio = (step - 10) / 100
    "linear": {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.775, 60: 0.55, 110: 0.1, 500: 0.1},
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi * ratio)); cos(pi/4) = 0.7071067811865476
    "cosine": {
        0: 0.0,
        5: 0.5,
        10: 1.0,
        35: 0.1 + 0.45 * (1 + 0.7071067811865476),
        60: 0.55,
        85: 0.1 + 0.45 * (1 - 0.7071067811865476),
        110: 0.1,
        500: 0.1,
    },
}


def _optimizer(**group_options):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    groups = [{"params": params[:1]}, {"params": params[1:], **group_options}]
    return torch.optim.SGD(groups, lr=123.0)


@pytest.mark.parametrize("style", sorted(EXPECTED))
def test_lr_at_chosen_steps(style):
    optimizer = _optimizer(lr_mult=0.5)
    scheduler = LRScheduler(optimizer, decay_style=style, **SCHEDULE)
    for step, expected in sorted(EXPECTED[style].items()):
        scheduler.step(step - scheduler.num_steps)
        assert scheduler.get_lr() == pytest.approx(expected, rel=1e-12, abs=1e-15), step
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert optimizer.param_groups[1]["lr"] == pytest.approx(expected * 0.5, rel=1e-12)


def test_construction_applies_step_zero_and_init_lr():
    optimizer = _optimizer()
    scheduler = LRScheduler(optimizer, decay_style="linear", init_lr=0.2, **SCHEDULE)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    scheduler.step(5)  # halfway through warmup from 0.2 to 1.0
    assert scheduler.get_lr() == pytest.approx(0.6)


def test_no_warmup_starts_at_max_lr():
    scheduler = LRScheduler(
        _optimizer(), max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=4, decay_style="linear"
    )
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.get_lr())
        scheduler.step()
    assert lrs == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


@pytest.mark.parametrize(
    "style, expected",
    [
        # start + (end - start) * ratio, ratio = step / 20
        ("linear", {0: 0.01, 5: 0.01 + 0.09 * 0.25, 10: 0.055, 20: 0.1, 90: 0.1}),
        # start + (end - start) * 0.5 * (1 + cos(pi * (1 - ratio)))
        ("cosine", {0: 0.01, 5: 0.01 + 0.045 * (1 - 0.7071067811865476), 10: 0.055, 20: 0.1}),
        ("constant", {0: 0.1, 7: 0.1, 90: 0.1}),
    ],
)
def test_weight_decay_schedule_respects_wd_mult(style, expected):
    optimizer = _optimizer(wd_mult=0.0)
    start_wd = 0.1 if style == "constant" else 0.01
    scheduler = LRScheduler(
        optimizer,
        decay_style="cosine",
        start_wd=start_wd,
        end_wd=0.1,
        wd_incr_steps=20,
        wd_incr_style=style,
        **SCHEDULE,
    )
    for step, value in expected.items():
        scheduler.step(step - scheduler.num_steps)
        assert scheduler.get_wd() == pytest.approx(value, rel=1e-12)
        assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(value, rel=1e-12)
        assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_without_wd_schedule_group_weight_decay_is_untouched():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], weight_decay=0.3)
    scheduler = LRScheduler(optimizer, decay_style="cosine", **SCHEDULE)
    scheduler.step(50)
    assert scheduler.get_wd() is None
    assert optimizer.param_groups[0]["weight_decay"] == 0.3


@pytest.mark.parametrize("style", sorted(EXPECTED))
def test_state_dict_round_trip_continues_identically(style):
    options = dict(decay_style=style, start_wd=0.0, end_wd=0.1, **SCHEDULE)
    original = LRScheduler(_optimizer(), **options)
    for _ in range(37):
        original.step()
    state = original.state_dict()
    json.dumps(state)  # plain Python scalars only
    resumed_optimizer = _optimizer()
    resumed = LRScheduler(resumed_optimizer, **options)
    resumed.load_state_dict(state)
    assert resumed_optimizer.param_groups[0]["lr"] == original.get_lr()
    for _ in range(100):
        original.step()
        resumed.step()
        assert (resumed.get_lr(), resumed.get_wd()) == (original.get_lr(), original.get_wd())


def test_load_state_dict_refuses_a_changed_schedule_unless_asked():
    state = LRScheduler(_optimizer(), decay_style="cosine", **SCHEDULE).state_dict()
    state["num_steps"] = 60
    other = LRScheduler(_optimizer(), decay_style="linear", **{**SCHEDULE, "max_lr": 2.0})
    with pytest.raises(ScheduleMismatchError, match=r"max_lr: saved 1.0, now 2.0.*decay_style"):
        other.load_state_dict(state)
    kept = LRScheduler(_optimizer(), decay_style="linear", **{**SCHEDULE, "max_lr": 2.0})
    kept.load_state_dict(state, settings="current")  # Megatron's --override-opt_param-scheduler
    assert (kept.decay_style, kept.max_lr, kept.num_steps) == ("linear", 2.0, 60)
    other.load_state_dict(state, settings="checkpoint")
    assert (other.decay_style, other.max_lr, other.num_steps) == ("cosine", 1.0, 60)
    assert other.get_lr() == pytest.approx(0.55)
    with pytest.raises(ValueError, match="settings must be one of"):
        other.load_state_dict(state, settings="mine")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(min_lr=2.0), "min_lr <= max_lr"),
        (dict(warmup_steps=200), "must not exceed decay_steps"),
        (dict(decay_style="exponential"), "decay_style must be one of"),
        (dict(warmup_steps=0, decay_steps=0), "needs decay_steps > 0"),
        (dict(start_wd=0.1), "both start_wd and end_wd"),
        (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
    ],
)
def test_bad_settings_raise(overrides, message):
    options = dict(decay_style="cosine", **SCHEDULE)
    options.update(overrides)
    with pytest.raises(ValueError, match=message):
        LRScheduler(_optimizer(), **options)
