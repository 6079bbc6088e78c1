"""Pipeline schedules as data.

A schedule is, for every pipeline rank, the ordered list of compute actions it
runs in one iteration: the forward or backward of one microbatch through one
model chunk. Everything else (which tensors travel where, when to wait, how
long it takes, how much memory it holds) follows from these lists, so the
engine, the simulator and the pictures all read the same data.

Which virtual stage each model chunk runs is part of the schedule too (its
*placement*). The looped placement puts chunk ``c`` of pipeline rank ``r`` at
virtual stage ``c * p + r``: a microbatch visits rank 0, 1, ..., p-1 for chunk
0, then wraps to rank 0 for chunk 1, and so on. The V placement (two chunks per
rank) runs down and back up: chunk 0 of rank ``r`` is stage ``r`` and chunk 1 is
stage ``2p - 1 - r``, so the first and the last stage share rank 0.

A backward is either one action (``B``) or split in two: ``I`` computes the
gradient of the stage's input, which is sent upstream at once, and ``W`` the
gradients of the weights, later, wherever the rank would otherwise idle.

The asynchronous schedules (:mod:`megapp.pipeline_parallel.asynchronous`) also
list the optimizer steps (``U``) among a rank's actions, and say which version of
the weights each forward uses; the flushed ones step once, after the schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from enum import Enum


class MicrobatchCountError(ValueError):
    """A schedule cannot run this many microbatches (too few to fill its pipeline, or a
    count its groups do not divide); a builder's other refusals are plain ValueErrors."""


class Op(str, Enum):
    """What an action computes: a forward, a whole backward, or one of its two halves
    (the input gradient ``I``, then the weight gradients ``W``)."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"
    UPDATE = "U"

    # An op hashes as its letter does (it equals it): in C, where Enum's own hash is a
    # Python call, and actions, messages and the tables keyed by them hash ops by the
    # million in a search.
    __hash__ = str.__hash__

    @property
    def sends_gradient(self) -> bool:
        """Whether the action receives its output's gradient and sends its input's."""
        return self is Op.BACKWARD or self is Op.INPUT_GRAD


@dataclass(frozen=True, order=True)
class Action:
    """One compute step on one rank: ``op`` of ``microbatch`` through model ``chunk``.
    An update ``U`` numbers the rank's optimizer steps instead: ``U3`` is its fourth."""

    op: Op
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        letter = self.op._value_  # the attribute behind Enum's ``value`` property
        if self.chunk:
            return f"{letter}{self.microbatch}.{self.chunk}"
        return f"{letter}{self.microbatch}"


def looped_placement(num_stages: int, num_chunks: int) -> tuple[tuple[int, ...], ...]:
    """Chunk ``c`` of rank ``r`` runs virtual stage ``c·p + r``."""
    return tuple(tuple(c * num_stages + r for c in range(num_chunks)) for r in range(num_stages))


def v_placement(num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Two chunks per rank: rank ``r`` runs stages ``r`` and ``2p - 1 - r``."""
    return tuple((r, 2 * num_stages - 1 - r) for r in range(num_stages))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one iteration, and where each chunk's stage lives.

    Attributes:
        name: the builder that made it (``gpipe``, ``1f1b``, ``zb-v``, ...).
        num_stages: pipeline ranks ``p``.
        num_microbatches: microbatches ``m`` per iteration.
        num_chunks: model chunks per rank ``v`` (1 without virtual stages).
        actions: ``actions[rank]`` is that rank's ordered list.
        warmup: forwards each rank runs before its first backward (default: counted
            from ``actions``).
        paired_steady_state: whether a steady forward/backward pair exchanges
            its messages in one batch (Megatron's interleaved schedule) rather
            than one batch per action (its non-interleaved 1F1B). A paired schedule
            alternates one forward and one backward after its warmup.
        forward_only: evaluation: the forwards alone, in the same order.
        placement: ``placement[rank][chunk]`` is the virtual stage that chunk runs
            (default: :func:`looped_placement`).
        update_interval: microbatches whose gradients one optimizer step ``U`` applies, for
            schedules that step among their actions (0: one step after the schedule, with
            every microbatch's gradient).
        iterations: the training iterations the actions span, ``num_microbatches /
            iterations`` microbatches each (1 but for the asynchronous schedules).
        versions: ``versions[rank][microbatch]``: how many of the rank's steps the weights
            that microbatch's forward (and so its backward) uses have seen; -1 is the
            weights one step before those the schedule starts from. Empty: the current
            weights, always.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: tuple[tuple[Action, ...], ...]
    warmup: tuple[int, ...] = ()
    paired_steady_state: bool = False
    forward_only: bool = False
    placement: tuple[tuple[int, ...], ...] = ()
    update_interval: int = 0
    iterations: int = 1
    versions: tuple[tuple[int, ...], ...] = ()
    _where: dict[int, tuple[int, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __hash__(self) -> int:
        """By its name and sizes alone: schedules key caches (their communication plans,
        their messages), and hashing every action on each lookup cost more than the lookup
        saved. Equal schedules hash alike; those of one name and size differ by ``==``."""
        sizes = (self.num_stages, self.num_microbatches, self.num_chunks, self.iterations)
        return hash((self.name, *sizes, self.update_interval, self.forward_only))

    def __post_init__(self) -> None:
        p, v = self.num_stages, self.num_chunks
        if not self.placement:
            object.__setattr__(self, "placement", looped_placement(p, v))
        stages = sorted(s for row in self.placement for s in row)
        if len(self.placement) != p or any(len(row) != v for row in self.placement):
            raise ValueError(f"{self.name}: placement must list {v} stages for each of {p} ranks")
        if stages != list(range(p * v)):
            raise ValueError(
                f"{self.name}: placement must use every virtual stage 0..{p * v - 1} once, "
                f"got {self.placement}"
            )
        self._where.update(
            (stage, (rank, chunk))
            for rank, row in enumerate(self.placement)
            for chunk, stage in enumerate(row)
        )
        if not self.warmup:
            warmup = tuple(_forwards_before_backward(acts) for acts in self.actions)
            object.__setattr__(self, "warmup", warmup)

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule runs its own optimizer steps (no flush between them)."""
        return self.update_interval > 0

    @property
    def microbatches_per_update(self) -> int:
        """Microbatches whose mean loss one optimizer step descends."""
        return self.update_interval or self.num_microbatches

    def version(self, rank: int, microbatch: int) -> int:
        """The weights version the forward of ``microbatch`` on ``rank`` uses (0 without
        versions: the weights the schedule starts from)."""
        return self.versions[rank][microbatch] if self.versions else 0

    @functools.cached_property
    def num_virtual_stages(self) -> int:
        """``p · v`` (read once: the message plan asks for it for every action)."""
        return self.num_stages * self.num_chunks

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Whether any backward runs as separate ``I`` and ``W`` actions (read once)."""
        return any(a.op is Op.WEIGHT_GRAD for acts in self.actions for a in acts)

    def check_sizes(self, num_stages: int, num_microbatches: int, num_chunks: int) -> None:
        """Raise ``ValueError`` unless this schedule is for ``p``, ``m`` and ``v``."""
        sizes = (self.num_stages, self.num_microbatches, self.num_chunks)
        if sizes != (num_stages, num_microbatches, num_chunks):
            raise ValueError(
                f"schedule is for p={sizes[0]}, m={sizes[1]}, v={sizes[2]} but this call has "
                f"p={num_stages}, m={num_microbatches}, v={num_chunks}"
            )

    @property
    def ends_on_one_rank(self) -> bool:
        """Whether the first and the last virtual stage run on one rank (a V, or a single
        pipeline rank): the tied embedding's two copies are then summed on that rank."""
        return self.rank_of(0) == self.rank_of(self.num_virtual_stages - 1)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return self.placement[rank][chunk]

    def rank_of(self, virtual_stage: int) -> int:
        return self._where[virtual_stage][0]

    def chunk_of(self, virtual_stage: int) -> int:
        return self._where[virtual_stage][1]

    def without_backward(self) -> Schedule:
        """The same forwards in the same order, for evaluation (with the current weights)."""
        forwards = tuple(tuple(a for a in acts if a.op is Op.FORWARD) for acts in self.actions)
        warmup = tuple(len(acts) for acts in forwards)
        return replace(
            self,
            actions=forwards,
            warmup=warmup,
            paired_steady_state=False,
            forward_only=True,
            update_interval=0,
            versions=(),
        )

    def __str__(self) -> str:
        width = max(len(str(a)) for acts in self.actions for a in acts)
        rows = [
            f"rank {r}: " + " ".join(str(a).ljust(width) for a in acts)
            for r, acts in enumerate(self.actions)
        ]
        header = f"{self.name} p={self.num_stages} m={self.num_microbatches} v={self.num_chunks}"
        return "\n".join([header, *rows])


def _forwards_before_backward(actions: tuple[Action, ...]) -> int:
    for k, action in enumerate(actions):
        if action.op is not Op.FORWARD:
            return k
    return len(actions)


def check_sizes(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
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
    check_sizes(num_stages, num_microbatches, num_chunks)
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
    check_sizes(num_stages, num_microbatches, num_chunks)
    _one_chunk("1f1b", num_chunks)
    m = num_microbatches
    forwards = [Action(Op.FORWARD, i) for i in range(m)]
    backwards = [Action(Op.BACKWARD, i) for i in range(m)]
    warmup = tuple(min(num_stages - r - 1, m) for r in range(num_stages))
    per_rank = tuple(_warmup_steady_cooldown(forwards, backwards, w) for w in warmup)
    return Schedule("1f1b", num_stages, m, 1, per_rank, warmup)


def interleaved_order(
    name: str, p: int, m: int, v: int, group_size: int | None = None
) -> tuple[int, list[tuple[int, int]]]:
    """The group size ``g`` and a rank's forward order ``(microbatch, chunk)`` of an
    interleaved schedule: chunk 0 for microbatches 0..g-1, chunk 1 for the same group,
    ..., then the next group; the last group takes whatever remains. ``g`` defaults to
    the smallest size from ``p`` up that divides ``m`` or leaves a last group of at least
    ``p`` (a smaller one would stall the pipeline)."""
    g = group_size or next(k for k in range(p, m + 1) if m % k == 0 or m % k >= p)
    if not p <= g <= m:
        raise ValueError(
            f"the microbatch group size of {name} must lie between the pipeline "
            f"size {p} and the number of microbatches {m}, got {g}"
        )
    if 0 < m % g < p:
        raise MicrobatchCountError(
            f"{name} with {m} microbatches in groups of {g} leaves a last group of "
            f"{m % g}, fewer than the {p} pipeline stages, which stalls the pipeline; "
            f"choose a group size that divides {m} or leaves at least {p}"
        )
    order = []
    for first in range(0, m, g):
        order += [(mb, c) for c in range(v) for mb in range(first, min(first + g, m))]
    return g, order


def interleaved_1f1b(
    num_stages: int, num_microbatches: int, num_chunks: int = 2, group_size: int | None = None
) -> Schedule:
    """Interleaved 1F1B over ``v`` model chunks per rank (Megatron's virtual pipeline).

    Microbatches go through the chunks depth-first in groups of ``g`` (Megatron's
    ``microbatch_group_size_per_vp_stage``; default: the smallest valid size from
    ``p`` up, which is ``p`` when ``p`` divides ``m``): a rank runs chunk 0 for
    microbatches 0..g-1, then chunk 1 for the same group, ..., then chunk 0 for the
    next group; the last group takes whatever remains. Backwards walk the same
    order with the chunks reversed. ``g`` lies in ``[p, m]`` and the last group
    holds no fewer than ``p`` microbatches (a smaller one would stall the pipeline),
    so any ``m >= p`` runs.

    Rank ``r`` runs ``2 (p - r - 1) + (v - 1) g`` warmup forwards (capped at
    ``m v``): ``(v - 1) g`` to fill its earlier chunks for one group, and
    ``2 (p - r - 1)`` so the first backward, which has to travel back from the
    last stage, arrives as it is needed. With equal groups the bubble shrinks to
    ``(p - 1) / (v m + p - 1)`` at the cost of ``v`` times as many point-to-point
    messages. A steady pair posts its messages together, which keeps blocking sends
    from deadlocking.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v < 2 or p < 2:
        raise ValueError(
            f"interleaved-1f1b needs at least 2 pipeline stages and 2 chunks per rank, got "
            f"p={p}, v={v}; use 1f1b for one chunk per rank"
        )
    if m < p:
        raise MicrobatchCountError(
            f"interleaved-1f1b needs at least as many microbatches as pipeline stages "
            f"({p}), got {m}"
        )
    g, order = interleaved_order("interleaved-1f1b", p, m, v, group_size)
    forwards = [Action(Op.FORWARD, mb, c) for mb, c in order]
    backwards = [Action(Op.BACKWARD, mb, v - 1 - c) for mb, c in order]
    total = m * v
    warmup = tuple(min(2 * (p - r - 1) + (v - 1) * g, total) for r in range(p))
    per_rank = tuple(_warmup_steady_cooldown(forwards, backwards, w) for w in warmup)
    return Schedule("interleaved-1f1b", p, m, v, per_rank, warmup, paired_steady_state=True)


def looped_bfs(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Breadth-first over the chunks: every microbatch through chunk 0, then every one
    through chunk 1, ...; then the backwards, last chunk first and last microbatch
    first (torch.distributed.pipelining's order). It holds every activation at the
    turn, as GPipe, but a rank's later chunks wait for no other rank once the first
    microbatch has looped around."""
    check_sizes(num_stages, num_microbatches, num_chunks)
    m, v = num_microbatches, num_chunks
    forwards = [Action(Op.FORWARD, mb, c) for c in range(v) for mb in range(m)]
    backwards = [
        Action(Op.BACKWARD, mb, c) for c in reversed(range(v)) for mb in reversed(range(m))
    ]
    per_rank = (tuple(forwards + backwards),) * num_stages
    return Schedule("looped-bfs", num_stages, m, v, per_rank)
