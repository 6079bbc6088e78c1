"""The point-to-point messages a schedule implies, and the order they are posted in.

Both the engine and the simulator follow this plan, so what is validated is
what runs. Each rank walks its actions; before action ``k`` it posts the sends
that action ``k - 1`` produced and the receive that action ``k`` needs (as
Megatron's ``send_forward_recv_backward`` does), and waits for the receive;
:func:`delivered_sends` says at which later step each send is known to be done.
A final step flushes the last sends.

NCCL matches messages between two ranks purely by posting order (tags are
ignored), so the sends one rank posts to another must come in exactly the order
the other posts its receives: :func:`check_fifo` proves that. How the messages
are posted so that no plan stalls under NCCL's stream rules is the transport's
(:mod:`~megapp.pipeline_parallel.channels`), and
:mod:`~megapp.pipeline_parallel.network` models it for the simulator.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from megapp.pipeline_parallel.schedules import Action, Op, Schedule

_LETTERS = {op: op.value for op in Op}  # read once: an enum's value is a Python property


class ScheduleError(ValueError):
    """A schedule that cannot run: out-of-order actions, a FIFO violation or a deadlock."""


class Message(NamedTuple):
    """An activation (forward) or gradient (backward) of one microbatch between virtual stages.

    A named tuple: messages key the simulator's and the checks' tables, and a tuple of
    integers (and an ``Op``, a string) hashes and compares without a Python call."""

    op: Op
    microbatch: int
    src_stage: int
    dst_stage: int
    src: int
    dst: int

    @property
    def local(self) -> bool:
        """Both stages on one rank (the turn of a V): handed over in memory, never sent."""
        return self.src == self.dst

    def __str__(self) -> str:
        what = "activation" if self.op is Op.FORWARD else "gradient"
        src = f"stage {self.src_stage} on rank {self.src}"
        dst = f"stage {self.dst_stage} on rank {self.dst}"
        return f"{what} of microbatch {self.microbatch} ({src} -> {dst})"


class Step(NamedTuple):
    """Post ``sends`` and ``recvs`` together, wait for the receives, then run ``action``
    (``None`` for the final flush)."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    action: Action | None


def _links(schedule: Schedule, rank: int, action: Action) -> tuple[Message | None, Message | None]:
    """The message ``action`` on ``rank`` receives before it runs and the one it sends
    after, each None where there is none."""
    op = action.op
    if op is Op.FORWARD:
        kind, before, after = Op.FORWARD, -1, 1
    elif op is Op.BACKWARD or op is Op.INPUT_GRAD:  # the ops that send a gradient
        kind, before, after = Op.BACKWARD, 1, -1
    else:
        return None, None
    stage = schedule.placement[rank][action.chunk]  # on this rank
    src, dst = stage + before, stage + after
    recv = send = None
    if 0 <= src < schedule.num_virtual_stages:
        recv = Message(kind, action.microbatch, src, stage, schedule.rank_of(src), rank)
    if 0 <= dst < schedule.num_virtual_stages:
        send = Message(kind, action.microbatch, stage, dst, rank, schedule.rank_of(dst))
    return recv, send


def incoming(schedule: Schedule, rank: int, action: Action) -> Message | None:
    """The message ``action`` on ``rank`` must receive before it runs, if any."""
    return _links(schedule, rank, action)[0]


def outgoing(schedule: Schedule, rank: int, action: Action) -> Message | None:
    """The message ``action`` on ``rank`` sends after it runs, if any."""
    return _links(schedule, rank, action)[1]


Links = tuple[tuple[tuple[Message | None, Message | None], ...], ...]


def action_links(schedule: Schedule) -> Links:
    """:func:`incoming` and :func:`outgoing` of every rank's every action, ``[rank][k]``,
    each message one object (a sender's outgoing is its receiver's incoming): the tables
    keyed by messages then find it by identity, without comparing fields."""
    made: dict[Message, Message] = {}
    one = made.setdefault
    return tuple(
        tuple(
            (None if recv is None else one(recv, recv), None if send is None else one(send, send))
            for recv, send in (_links(schedule, rank, a) for a in actions)
        )
        for rank, actions in enumerate(schedule.actions)
    )


def _units(schedule: Schedule, rank: int) -> list[range]:
    """Indices of the groups of ``rank``'s actions that share one batch of messages: steady
    forward/backward pairs when the schedule pairs them, single actions otherwise."""
    actions, warmup = schedule.actions[rank], schedule.warmup[rank]
    if not schedule.paired_steady_state:
        return [range(k, k + 1) for k in range(len(actions))]
    forwards = sum(a.op is Op.FORWARD for a in actions)
    steady_end = warmup + 2 * (forwards - warmup)
    units = [range(k, k + 1) for k in range(warmup)]
    units += [range(k, min(k + 2, len(actions))) for k in range(warmup, steady_end, 2)]
    return units + [range(k, k + 1) for k in range(steady_end, len(actions))]


def send_order(
    schedule: Schedule, links: Links | None = None
) -> dict[tuple[int, int], list[Message]]:
    """Per ordered pair of ranks ``(src, dst)``, the messages ``src`` sends, in order
    (``links``: :func:`action_links`, made here when not given)."""
    links = action_links(schedule) if links is None else links
    channels: dict[tuple[int, int], list[Message]] = {}
    for row in links:
        for _, m in row:
            if m is not None and not m.local:
                channels.setdefault((m.src, m.dst), []).append(m)
    return channels


def rank_plan(
    schedule: Schedule,
    rank: int,
    channels: dict[tuple[int, int], list[Message]] | None = None,
    links: Links | None = None,
) -> list[Step]:
    """The steps of one rank: each action with the batch posted just before it.

    Receives follow each peer's send order (``channels``, from :func:`send_order`):
    the step of an action receives its message together with every message the same
    peer sent before it that has not been received yet. Such a message waits in the
    inbox for the later action that uses it, so messages between two ranks are always
    matched in the order they were sent, whatever order the actions use them in.
    """
    links = action_links(schedule) if links is None else links
    channels = send_order(schedule, links) if channels is None else channels
    position = {  # of each message to this rank in its channel
        m: k for (_, dst), queue in channels.items() if dst == rank for k, m in enumerate(queue)
    }
    received = dict.fromkeys(channels, 0)  # per channel, how many are received

    def receive(message: Message | None) -> tuple[Message, ...]:
        if message is None or message.local:
            return ()
        index = position.get(message)
        if index is None:
            return (message,)  # never sent: the checks name it
        pair = (message.src, message.dst)
        start = received[pair]
        if index < start:
            return ()  # received with an earlier message of its channel
        received[pair] = index + 1
        return tuple(channels[pair][start : index + 1])

    def sent(message: Message | None) -> tuple[Message, ...]:
        return () if message is None or message.local else (message,)

    actions, row = schedule.actions[rank], links[rank]
    steps, pending = [], ()
    for unit in _units(schedule, rank):
        first = unit[0]
        if len(unit) == 1:  # most steps: one action, at most one message each way
            recv, send = row[first]
            steps.append(Step(pending, receive(recv), actions[first]))
            pending = sent(send)
            continue
        recvs = tuple(m for k in unit for m in receive(row[k][0]))
        steps.append(Step(pending, recvs, actions[first]))
        steps += [Step((), (), actions[k]) for k in unit[1:]]
        pending = tuple(m for k in unit for m in sent(row[k][1]))
    steps.append(Step(pending, (), None))
    return steps


def delivered_sends(plan: list[list[Step]]) -> list[list[tuple[Message, ...]]]:
    """For every rank and step, the messages the rank sent whose delivery the step proves.

    A rank waits for every receive of a step before it posts the next step's sends, so a
    message ``m2`` that peer ``P`` posted at a later step than the one at which it received
    ``m`` proves that ``m`` arrived: once this rank has ``m2``, its send of ``m`` is done
    (waiting for it returns at once) and the tensor's storage can go. This needs no polling
    of the send, which gloo cannot do (its sends report completion only once waited for).
    """
    received_at: dict[Message, int] = {}
    posted_at: dict[Message, int] = {}
    for steps in plan:
        for index, step in enumerate(steps):
            received_at.update((m, index) for m in step.recvs)
            posted_at.update((m, index) for m in step.sends)
    result = []
    for steps in plan:
        undelivered: dict[int, list[Message]] = {}  # per peer, in posting order
        per_step = []
        for step in steps:
            for m in step.sends:
                undelivered.setdefault(m.dst, []).append(m)
            proven = []
            for later in step.recvs:
                pending = undelivered.get(later.src, [])
                proven += [m for m in pending if received_at[m] < posted_at[later]]
                undelivered[later.src] = [m for m in pending if received_at[m] >= posted_at[later]]
            per_step.append(tuple(proven))
        result.append(per_step)
    return result


@functools.lru_cache(maxsize=64)
def communication_plan(schedule: Schedule) -> tuple[tuple[Step, ...], ...]:
    """:func:`rank_plan` for every rank, after :func:`check_actions`, then checked by
    :func:`check_fifo` and :func:`check_progress`. Built once per schedule (the engine,
    the simulator and the planner ask for the same one many times)."""
    links = action_links(schedule)
    check_actions(schedule, links)
    check_updates(schedule)
    channels = send_order(schedule, links)
    plan = tuple(
        tuple(rank_plan(schedule, rank, channels, links)) for rank in range(schedule.num_stages)
    )
    check_fifo(plan)
    check_progress(schedule.name, plan)
    return plan


def check_progress(name: str, plan: list[list[Step]]) -> None:
    """Every rank reaches the end of its steps when a rank waits for its receives only:
    a step's receives are there once their senders have posted them, at a step they
    have reached. This is gloo's rule, and NCCL's too as the transport posts there (a
    direction of a pair per stream, in the order :func:`check_fifo` proves); a plan that
    fails it would have its ranks wait on each other forever. Raises ScheduleError
    naming what each stuck rank waits for."""
    cursor, posted = [0] * len(plan), set()
    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(plan):
            at = cursor[rank]
            while at < len(steps):
                step = steps[at]
                posted.update(step.sends)
                if not posted.issuperset(step.recvs):
                    break
                at += 1
                progress = True
            cursor[rank] = at
    stuck = [rank for rank, steps in enumerate(plan) if cursor[rank] < len(steps)]
    if stuck:
        lines = []
        for rank in stuck:
            step = plan[rank][cursor[rank]]
            waits = "; ".join(f"receive of the {m}" for m in step.recvs if m not in posted)
            lines.append(f"  rank {rank} before {step.action} waits for: {waits}")
        raise ScheduleError(f"{name} deadlocks: its ranks wait on each other\n" + "\n".join(lines))


def check_actions(schedule: Schedule, links: Links | None = None) -> None:
    """Every (microbatch, chunk) runs its forward once, then either one backward ``B`` or
    an input-gradient ``I`` followed by a weight-gradient ``W``, on every rank; updates
    are as :func:`check_updates` says. (``links``: :func:`action_links`, made here when
    not given.)"""
    if len(schedule.actions) != schedule.num_stages:
        raise ScheduleError(
            f"{schedule.name}: {len(schedule.actions)} action lists for "
            f"{schedule.num_stages} stages"
        )
    links = action_links(schedule) if links is None else links
    pairs = {
        (mb, chunk)
        for mb in range(schedule.num_microbatches)
        for chunk in range(schedule.num_chunks)
    }
    allowed = ("F",) if schedule.forward_only else ("FB", "FIW")
    for rank, actions in enumerate(schedule.actions):
        _check_local_order(schedule, rank, actions, links[rank])
        seen: dict[tuple[int, int], str] = {}  # the ops of each pair, in order ("FIW")
        for action in actions:
            if action.op is Op.UPDATE:
                continue
            key = (action.microbatch, action.chunk)
            if key not in pairs:
                raise ScheduleError(f"{schedule.name}: rank {rank} runs {action}, out of range")
            seen[key] = seen.get(key, "") + _LETTERS[action.op]
        wrong = [key for key in pairs if seen.get(key, "") not in allowed]
        if wrong:
            key = min(wrong)
            ops, label = seen.get(key, ""), f"microbatch {key[0]} chunk {key[1]}"
            raise ScheduleError(
                f"{schedule.name}: rank {rank} runs {label} as {ops or 'nothing'!r}; "
                f"every microbatch and chunk must run as one of {', '.join(allowed)}, "
                "in that order"
            )


def check_updates(schedule: Schedule) -> None:
    """A schedule that steps among its actions (``U``) numbers its steps 0, 1, ... on
    every rank, each after exactly ``update_interval`` more microbatches' backwards
    (per chunk) and the last after the last backward; every forward uses a weights
    version the rank has already made (at most its steps so far, at least -1)."""
    name, every = schedule.name, schedule.update_interval
    has_updates = any(a.op is Op.UPDATE for acts in schedule.actions for a in acts)
    if not schedule.asynchronous:
        if has_updates or schedule.versions:
            raise ScheduleError(f"{name}: updates and weight versions need an update_interval")
        return
    if schedule.forward_only:
        raise ScheduleError(f"{name}: a forward-only schedule takes no optimizer steps")
    if len(schedule.versions) != schedule.num_stages or any(
        len(row) != schedule.num_microbatches for row in schedule.versions
    ):
        raise ScheduleError(f"{name}: versions must list every microbatch for every rank")
    counts = set()
    for rank, actions in enumerate(schedule.actions):
        steps = backwards = 0
        for action in actions:
            if action.op is Op.UPDATE:
                if action.microbatch != steps or backwards != every * schedule.num_chunks:
                    raise ScheduleError(
                        f"{name}: rank {rank} runs {action} as step {steps} after {backwards} "
                        f"backwards; each step must follow {every} per chunk, numbered in order"
                    )
                steps, backwards = steps + 1, 0
            elif action.op in (Op.BACKWARD, Op.WEIGHT_GRAD):
                backwards += 1
            elif action.op is Op.FORWARD:
                version = schedule.version(rank, action.microbatch)
                if not -1 <= version <= steps:
                    raise ScheduleError(
                        f"{name}: rank {rank} runs {action} on weights version {version}, but "
                        f"has made versions -1..{steps} so far"
                    )
        if backwards:
            raise ScheduleError(f"{name}: rank {rank} ends with {backwards} gradients unapplied")
        counts.add(steps)
    if len(counts) > 1:
        raise ScheduleError(f"{name}: ranks take different numbers of steps: {sorted(counts)}")


def _check_local_order(schedule: Schedule, rank: int, actions, links) -> None:
    """An action fed by a stage on its own rank runs after the action that feeds it."""
    done: set[tuple[Op, int, int]] = set()
    for action, (message, _) in zip(actions, links, strict=True):
        if message is not None and message.local:
            chunk = schedule.chunk_of(message.src_stage)
            producers = (Op.FORWARD,) if message.op is Op.FORWARD else (Op.BACKWARD, Op.INPUT_GRAD)
            if not any((op, action.microbatch, chunk) in done for op in producers):
                raise ScheduleError(
                    f"{schedule.name}: rank {rank} runs {action} before the action on the same "
                    f"rank that produces its {message}"
                )
        done.add((action.op, action.microbatch, action.chunk))


def check_fifo(plan: list[list[Step]]) -> None:
    """Between every ordered pair of ranks, sends are posted in the order receives are."""
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for steps in plan:
        for step in steps:
            for msg in step.sends:
                sent.setdefault((msg.src, msg.dst), []).append(msg)
            for msg in step.recvs:
                received.setdefault((msg.src, msg.dst), []).append(msg)
    for pair in sorted(set(sent) | set(received)):
        sends, recvs = sent.get(pair, []), received.get(pair, [])
        if sends == recvs:  # element by element, each message found by identity
            continue
        for index, (s, r) in enumerate(zip(sends, recvs, strict=False)):
            if s != r:
                raise ScheduleError(
                    f"rank {pair[0]} -> rank {pair[1]}: message #{index} is sent as the {s} "
                    f"but received as the {r}; point-to-point messages between two ranks are "
                    "matched in posting order, so this schedule would swap tensors"
                )
        if len(sends) != len(recvs):
            raise ScheduleError(
                f"rank {pair[0]} -> rank {pair[1]}: {len(sends)} sends but {len(recvs)} receives"
            )
