"""The pipeline messages a rank has alive while each of its actions runs, read off the
plan the runner walks: receives posted ahead or waiting for a later action, and the sends
gloo keeps until the plan proves them delivered. :mod:`megapp.planning.memory` adds them,
one hidden state each, to what the rank holds."""

from __future__ import annotations

import functools
from typing import NamedTuple

from megapp.pipeline_parallel.messages import action_links, communication_plan, delivered_sends
from megapp.pipeline_parallel.schedules import Action, Schedule

__all__ = ["Messages", "pipeline_messages"]


class Messages(NamedTuple):
    """Pipeline messages of one rank alive while one of its actions runs, beyond the input
    it consumes (counted with what the chunk holds or works with): ``kept``, sends gloo
    still holds; ``waiting``, receives posted or arrived for a later action, and messages
    between the rank's own chunks not yet used."""

    kept: int
    waiting: int


@functools.lru_cache(maxsize=64)
def pipeline_messages(schedule: Schedule) -> tuple[dict[Action, Messages], ...]:
    """Per rank, the pipeline messages alive while each of its actions runs, read off the
    plan the runner walks (:func:`~megapp.pipeline_parallel.messages.communication_plan`).

    - A send: gloo reports a send done only once it is waited for, so the runner keeps
      the sent tensor until the plan proves it delivered
      (:func:`~megapp.pipeline_parallel.messages.delivered_sends`), from the step that
      posts it to the step whose receives prove it arrived, which frees it before its
      action. Activations sent forward and gradients sent back alike; NCCL keeps none.
    - A receive: the runner posts a step's receives one step early (its buffers exist
      from then), and a message that arrives with an earlier one of its channel waits in
      the inbox until the action that uses it.
    - A message between two chunks of the same rank (the turn of a V) waits in the inbox
      from the action that makes it to the one that uses it."""
    plan = [list(steps) for steps in communication_plan(schedule)]
    links = action_links(schedule)
    out = []
    for rank, (steps, proven) in enumerate(zip(plan, delivered_sends(plan), strict=True)):
        link = dict(zip(schedule.actions[rank], links[rank], strict=True))  # (in, out)
        kept, posted, used, local, at = 0, len(steps[0].recvs), 0, 0, {}
        for index, (step, done) in enumerate(zip(steps, proven, strict=True)):
            kept += len(step.sends) - len(done)
            if index + 1 < len(steps):  # the next step's receives, posted ahead
                posted += len(steps[index + 1].recvs)
            if step.action is None:
                continue
            needs, made = link[step.action]
            if needs is not None:  # received (or left by this rank's other chunk): now its
                used += not needs.local
                local -= needs.local
            at[step.action] = Messages(kept, posted - used + local)
            local += made is not None and made.local  # for this rank's other chunk, later
        out.append(at)
    return tuple(out)
