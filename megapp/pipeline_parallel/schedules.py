"""Pipeline schedules as data.

A schedule is, for every pipeline rank, the ordered list of compute actions it
runs in one iteration: the forward or backward of one microbatch through one
model chunk. Everything else (which tensors travel where, when to wait, how
long it takes, how much memory it holds) follows from these lists, so the
engine, the simulator and the pictures all read the same data.

With ``v`` model chunks per rank, chunk ``c`` of pipeline rank ``r`` is virtual
stage ``c * p + r``: a microbatch visits rank 0, 1, ..., p-1 for chunk 0, then
wraps to rank 0 for chunk 1, and so on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum


class Op(str, Enum):
    """What an action computes. Zero-bubble schedules will add kinds that split
    ``BACKWARD`` into an input-gradient and a weight-gradient part."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Action:
    """One compute step on one rank: ``op`` of ``microbatch`` through model ``chunk``."""

    op: Op
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one iteration.

    Every schedule here has the same shape on each rank: ``warmup[rank]``
    forwards, then steady pairs of one forward and one backward, then the
    remaining backwards (cooldown). GPipe is the case where warmup is every
    forward.

    Attributes:
        name: the builder that made it (``gpipe``, ``1f1b``, ``interleaved-1f1b``).
        num_stages: pipeline ranks ``p``.
        num_microbatches: microbatches ``m`` per iteration.
        num_chunks: model chunks per rank ``v`` (1 without virtual stages).
        actions: ``actions[rank]`` is that rank's ordered list.
        warmup: forwards each rank runs before its first backward is due.
        paired_steady_state: whether a steady forward/backward pair exchanges
            its messages in one batch (Megatron's interleaved schedule) rather
            than one batch per action (its non-interleaved 1F1B).
        forward_only: evaluation: the forwards alone, in the same order.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: tuple[tuple[Action, ...], ...]
    warmup: tuple[int, ...]
    paired_steady_state: bool = False
    forward_only: bool = False

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_stages + rank

    def rank_of(self, virtual_stage: int) -> int:
        return virtual_stage % self.num_stages

    def chunk_of(self, virtual_stage: int) -> int:
        return virtual_stage // self.num_stages

    def without_backward(self) -> Schedule:
        """The same forwards in the same order, for evaluation."""
        forwards = tuple(tuple(a for a in acts if a.op is Op.FORWARD) for acts in self.actions)
        warmup = tuple(len(acts) for acts in forwards)
        return replace(
            self, actions=forwards, warmup=warmup, paired_steady_state=False, forward_only=True
        )

    def __str__(self) -> str:
        width = max(len(str(a)) for acts in self.actions for a in acts)
        rows = [
            f"rank {r}: " + " ".join(str(a).ljust(width) for a in acts)
            for r, acts in enumerate(self.actions)
        ]
        header = f"{self.name} p={self.num_stages} m={self.num_microbatches} v={self.num_chunks}"
        return "\n".join([header, *rows])


def _check_sizes(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _warmup_steady_cooldown(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> tuple[Action, ...]:
    """``warmup`` forwards, then alternate forward/backward, then the rest of the backwards."""
    steady = len(forwards) - warmup
    actions = forwards[:warmup]
    for k in range(steady):
        actions += [forwards[warmup + k], backwards[k]]
    return tuple(actions + backwards[steady:])


def _one_chunk(name: str, num_chunks: int) -> None:
    if num_chunks != 1:
        raise ValueError(
            f"{name} runs one model chunk per rank, got num_chunks={num_chunks}; "
            "use interleaved-1f1b for virtual pipeline stages"
        )


def gpipe(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """All forwards, then all backwards (GPipe): warmup is all ``m`` forwards.

    With one microbatch it is the naive pipeline. Every rank holds all ``m``
    microbatches' activations at the turn from forward to backward. Backwards
    run in forward order so every channel sees messages in the order sent.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    _one_chunk("gpipe", num_chunks)
    m = num_microbatches
    forwards = [Action(Op.FORWARD, i) for i in range(m)]
    backwards = [Action(Op.BACKWARD, i) for i in range(m)]
    per_rank = tuple(_warmup_steady_cooldown(forwards, backwards, m) for _ in range(num_stages))
    return Schedule("gpipe", num_stages, m, 1, per_rank, (m,) * num_stages)


def one_f_one_b(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """One-forward-one-backward (PipeDream-Flush, Megatron's non-interleaved schedule).

    Rank ``r`` runs ``w = min(p - r - 1, m)`` warmup forwards: exactly enough
    for the first backward to reach it from the last stage as soon as that
    stage finishes its first forward. Then ``m - w`` steady steps of one
    forward and one backward, then ``w`` cooldown backwards. A rank never
    holds more than ``min(p - r, m)`` microbatches' activations, instead of
    GPipe's ``m``; the bubble is the same ``(p - 1) / (m + p - 1)``.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    _one_chunk("1f1b", num_chunks)
    m = num_microbatches
    forwards = [Action(Op.FORWARD, i) for i in range(m)]
    backwards = [Action(Op.BACKWARD, i) for i in range(m)]
    warmup = tuple(min(num_stages - r - 1, m) for r in range(num_stages))
    per_rank = tuple(_warmup_steady_cooldown(forwards, backwards, w) for w in warmup)
    return Schedule("1f1b", num_stages, m, 1, per_rank, warmup)


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B over ``v`` model chunks per rank (Megatron's virtual pipeline).

    Microbatches go through the chunks depth-first in groups of ``p``: a rank
    runs chunk 0 for microbatches 0..p-1, then chunk 1 for the same group, ...,
    then chunk 0 for the next group. Backwards walk the chunks in reverse.
    This needs ``m`` to be a multiple of ``p`` (so every group is full).

    Rank ``r`` runs ``2 (p - r - 1) + (v - 1) p`` warmup forwards (capped at
    ``m v``): ``(v - 1) p`` to fill its earlier chunks for one group, and
    ``2 (p - r - 1)`` so the first backward, which has to travel back from the
    last stage, arrives as it is needed. When ``m == p`` every forward is
    warmup. The bubble shrinks to ``(p - 1) / (v m + p - 1)`` at the cost of
    ``v`` times as many point-to-point messages. A steady pair posts its
    messages together, which keeps blocking sends from deadlocking.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v < 2 or p < 2:
        raise ValueError(
            f"interleaved-1f1b needs at least 2 pipeline stages and 2 chunks per rank, got "
            f"p={p}, v={v}; use 1f1b for one chunk per rank"
        )
    if m % p != 0:
        lower, upper = (m // p) * p, (m // p + 1) * p
        hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise ValueError(
            f"interleaved-1f1b groups microbatches by the {p} pipeline stages, so the number of "
            f"microbatches must be a multiple of {p}; got {m}, use {hint}"
        )
    total, group = m * v, p * v
    # k-th forward of a rank: microbatch (k // pv) p + k % p through chunk (k % pv) // p
    forwards = [
        Action(Op.FORWARD, (k // group) * p + k % p, (k % group) // p) for k in range(total)
    ]
    backwards = [
        Action(Op.BACKWARD, (k // group) * p + k % p, v - 1 - (k % group) // p)
        for k in range(total)
    ]
    warmup = tuple(total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total) for r in range(p))
    per_rank = tuple(_warmup_steady_cooldown(forwards, backwards, w) for w in warmup)
    return Schedule("interleaved-1f1b", p, m, v, per_rank, warmup, paired_steady_state=True)


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
}


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches, num_chunks)
