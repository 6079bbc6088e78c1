"""Learning-rate (and optional weight-decay) schedule driven by a step counter.

The learning rate rises linearly from ``init_lr`` to ``max_lr`` over ``warmup_steps``,
then decays to ``min_lr`` by ``decay_steps`` (``"constant"`` keeps ``max_lr``,
``"linear"`` falls in a straight line, ``"cosine"`` follows half a cosine), and stays at
``min_lr`` after that. Steps may count iterations or samples: ``step(increment)``
advances the counter by whatever unit the caller chose for the two step settings.

Weight decay, when both ``start_wd`` and ``end_wd`` are given, moves from one to the other
over ``wd_incr_steps`` (default ``decay_steps``) along ``wd_incr_style``.

Every param group gets ``lr = schedule_lr * group.get("lr_mult", 1.0)`` and, with a
weight-decay schedule, ``weight_decay = schedule_wd * group.get("wd_mult", 1.0)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

STYLES = ("constant", "linear", "cosine")

# The settings that define the schedule; a checkpoint stores them next to the counter.
SCHEDULE_SETTINGS = ("match", "checkpoint", "current")


class ScheduleMismatchError(ValueError):
    """A saved schedule whose settings differ from the scheduler loading it."""

    def __init__(self, differences: list[str]):
        self.differences = differences
        super().__init__(
            f"the saved schedule differs from this one ({'; '.join(differences)}); "
            "load_state_dict(settings='checkpoint') adopts the saved settings, "
            "settings='current' keeps these"
        )


_SETTINGS = (
    "max_lr",
    "min_lr",
    "init_lr",
    "warmup_steps",
    "decay_steps",
    "decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


def check_schedule(
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    decay_steps: int,
    decay_style: str,
    init_lr: float = 0.0,
    start_wd: float | None = None,
    end_wd: float | None = None,
    wd_incr_steps: int | None = None,
    wd_incr_style: str = "linear",
) -> None:
    """Raise ValueError naming the setting when a schedule cannot work; the rules of
    :class:`LRScheduler`, checkable before any optimizer exists."""
    if wd_incr_steps is None:
        wd_incr_steps = decay_steps
    if decay_style not in STYLES:
        raise ValueError(f"decay_style must be one of {STYLES}, got {decay_style!r}")
    if not 0.0 <= min_lr <= max_lr:
        raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
    if init_lr < 0.0:
        raise ValueError(f"init_lr must be >= 0, got {init_lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps > decay_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) must not exceed decay_steps "
            f"({decay_steps}); raise decay_steps or shorten the warmup"
        )
    if decay_style != "constant" and decay_steps <= 0:
        raise ValueError(f"decay_style={decay_style!r} needs decay_steps > 0")
    if (start_wd is None) != (end_wd is None):
        raise ValueError("give both start_wd and end_wd for a weight-decay schedule or neither")
    if start_wd is not None:
        if start_wd < 0.0 or end_wd < 0.0:
            raise ValueError(f"weight decay must be >= 0, got {start_wd}, {end_wd}")
        if wd_incr_style not in STYLES:
            raise ValueError(f"wd_incr_style must be one of {STYLES}, got {wd_incr_style!r}")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError("wd_incr_style='constant' needs start_wd == end_wd")
        if wd_incr_style != "constant" and wd_incr_steps <= 0:
            raise ValueError(f"wd_incr_style={wd_incr_style!r} needs wd_incr_steps > 0")


class LRScheduler:
    """Set ``lr`` (and optionally ``weight_decay``) in every param group of ``optimizer``.

    The constructor applies the step-0 values at once, so the first optimizer step already
    uses the warmup's starting learning rate.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
        init_lr: float = 0.0,
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_steps: int | None = None,
        wd_incr_style: str = "linear",
    ) -> None:
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.decay_style = decay_style
        self.start_wd = None if start_wd is None else float(start_wd)
        self.end_wd = None if end_wd is None else float(end_wd)
        self.wd_incr_steps = self.decay_steps if wd_incr_steps is None else int(wd_incr_steps)
        self.wd_incr_style = wd_incr_style
        self.num_steps = 0
        self._validate()
        self.step(0)

    def _validate(self) -> None:
        check_schedule(**{name: getattr(self, name) for name in _SETTINGS})

    def get_lr(self) -> float:
        """The schedule's learning rate at the current step (before any group's ``lr_mult``)."""
        step = self.num_steps
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step >= self.decay_steps:
            return self.min_lr
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_wd(self) -> float | None:
        """The scheduled weight decay at the current step, or None without a wd schedule."""
        if self.start_wd is None:
            return None
        if self.wd_incr_style == "constant" or self.num_steps >= self.wd_incr_steps:
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            # Rises slowly first, like the second half of a cosine decay mirrored.
            coeff = 0.5 * (1.0 + math.cos(math.pi * (1.0 - ratio)))
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        """Advance the counter by ``increment`` and write the new values into every group."""
        if increment < 0:
            raise ValueError(f"increment must be >= 0, got {increment}")
        self.num_steps += int(increment)
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The counter and the settings, as plain Python scalars (str for the styles)."""
        state = {name: getattr(self, name) for name in _SETTINGS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state: dict[str, Any], *, settings: str = "match") -> None:
        """Continue from a saved schedule and re-apply its values to the param groups.

        ``settings`` says whose schedule settings hold: ``"match"`` (default) requires the
        saved ones to equal this scheduler's, so a resumed run cannot silently change its
        schedule (:class:`ScheduleMismatchError` otherwise); ``"checkpoint"`` adopts the saved
        ones; ``"current"`` keeps this scheduler's and takes only the step count.
        """
        if settings not in SCHEDULE_SETTINGS:
            raise ValueError(f"settings must be one of {SCHEDULE_SETTINGS}, got {settings!r}")
        if settings == "checkpoint":
            for name in _SETTINGS:
                setattr(self, name, state[name])
            self._validate()
        elif settings == "match":
            changed = [
                f"{name}: saved {state[name]!r}, now {getattr(self, name)!r}"
                for name in _SETTINGS
                if state[name] != getattr(self, name)
            ]
            if changed:
                raise ScheduleMismatchError(changed)
        self.num_steps = int(state["num_steps"])
        self.step(0)
