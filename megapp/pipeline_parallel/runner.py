"""One rank's side of a pipeline iteration: post each step's messages, run its action.

:class:`StageRunner` walks this rank's steps of the communication plan; which
tensors travel where follows from the schedule, so nothing here is specific to
one schedule. Its messages have three jobs, here:

- :class:`StageRunner` posts each step's sends and receives and waits for the
  receives (:class:`~megapp.pipeline_parallel.p2p.ActivationShapes` says what
  each receive holds, negotiating headers when shapes are not declared);
- :class:`EarlyReceives` posts the next step's receives ahead of it;
- :class:`InFlightSends` finishes sends once they are done and frees their
  activations' storage.

The compute (:class:`~megapp.pipeline_parallel.compute.StageCompute`, or the
split-backward or stashing one the schedule needs) runs the actions.

:func:`message_cpu_seconds` counts the CPU time this process spends on the messages
(posting, waiting, finishing), which a profile turns into the work a message costs.

A failed or timed-out wait raises :class:`~megapp.comm.CollectiveError` naming
the pipeline rank, the step, what was waited for and the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megapp import comm
from megapp.autograd.saved import drop_storage
from megapp.comm import CollectiveError
from megapp.pipeline_parallel.compute import StageCompute
from megapp.pipeline_parallel.messages import Message, Step
from megapp.pipeline_parallel.p2p import ActivationShapes, Posted, Transport, peer_of
from megapp.pipeline_parallel.schedules import Action
from megapp.pipeline_parallel.simulate import Event

__all__ = ["EarlyReceives", "InFlightSends", "StageRunner", "message_cpu_seconds"]

_message_cpu = [0.0]  # CPU seconds this process has spent on pipeline messages


def message_cpu_seconds() -> float:
    """CPU seconds (all of this process's threads) spent so far in :class:`StageRunner`'s
    message handling: posting sends and receives, waiting for them, finishing the last
    sends. With gloo that is the copies through the sockets; a blocked wait costs none."""
    return _message_cpu[0]


class StageRunner:
    """One pipeline rank during one iteration.

    Args:
        pp_rank: this rank in the pipeline group.
        transport: point-to-point messages over the pipeline group.
        shapes: what each receive holds (the compute records what each forward sends).
        compute: runs the actions, from its inbox into its outbox.
        clock: seconds since the iteration's time origin, for :attr:`events`.
        record: keep the timeline of this rank's actions in :attr:`events` (the engine
            adds the waits); without it nothing is timed.
    """

    def __init__(
        self,
        *,
        pp_rank: int,
        transport: Transport,
        shapes: ActivationShapes,
        compute: StageCompute,
        clock: Callable[[], float],
        record: bool = False,
    ) -> None:
        self.pp_rank = pp_rank
        self.transport = transport
        self.clock = clock
        self.record = record
        self.shapes = shapes
        self.early = EarlyReceives(transport, self.shapes, pp_rank)
        self.sends = InFlightSends(transport)
        self.compute = compute
        self.events: list[Event] = []

    def run(self, steps: Sequence[Step], delivered: Sequence[tuple[Message, ...]]) -> None:
        """Walk this rank's ``steps``; ``delivered`` (:func:`delivered_sends` for this rank,
        one entry per step) says after which step each send is known to be done."""
        for index, (step, proven) in enumerate(zip(steps, delivered, strict=True)):
            upcoming = steps[index + 1] if index + 1 < len(steps) else None
            self.communicate(step, upcoming, proven)
            if step.action is not None:
                self.act(step.action)
        self.finish()

    def act(self, action: Action) -> None:
        """Run ``action``; when recording, add it to the timeline with the CPU time it took."""
        if not self.record:
            self.compute.run(action)
            return
        start, cpu = self.clock(), time.process_time()
        self.compute.run(action)
        cpu = time.process_time() - cpu
        self.events.append(Event(self.pp_rank, "compute", str(action), start, self.clock(), cpu))

    def communicate(self, step: Step, upcoming: Step | None, delivered: Sequence[Message]) -> None:
        """Post ``step``'s sends and receives (and, where the transport posts early,
        ``upcoming``'s receives), wait for the receives, then release the sends the step
        proves ``delivered``."""
        if not (step.sends or step.recvs or (upcoming is not None and upcoming.recvs)):
            return
        started = time.process_time()
        try:
            self._communicate(step, upcoming, delivered)
        except RuntimeError as err:
            before = f"before {step.action}" if step.action else "at the end of the iteration"
            what = [f"send of the {m}" for m in step.sends]
            what += [f"receive of the {m}" for m in step.recvs]
            if upcoming is not None:
                what += [f"receive of the {m} (posted ahead)" for m in upcoming.recvs]
            raise self._failure(f"{before} failed waiting for: {'; '.join(what)}", err) from err
        finally:
            _message_cpu[0] += time.process_time() - started

    def _communicate(self, step: Step, upcoming: Step | None, delivered: Sequence[Message]) -> None:
        outgoing = [self.compute.outbox.pop(m) for m in step.sends]
        peers = [peer_of(m, self.pp_rank) for m in step.sends]
        sends = [(peer, o.tensors) for peer, o in zip(peers, outgoing, strict=True)]
        # The data goes out before this step waits for anything, headers included: a peer
        # that needs it first is never held up by what this rank still waits for.
        send_requests = self.transport.post(sends, []).sends
        specs = self.shapes.for_step(step, [o.tensors for o in outgoing])  # also sends headers
        receives = self.early.take()
        if receives is None:  # this step's receives did not go out with the previous step
            sources = [peer_of(m, self.pp_rank) for m in step.recvs]
            receives = self.transport.post([], list(zip(sources, specs, strict=True)))
        self.early.post_ahead(upcoming)
        for msg, out, requests in zip(step.sends, outgoing, send_requests, strict=True):
            self.sends.add(msg, requests, out.droppable)
        # Only the receives are waited for: a late peer then delays just the action that
        # needs its data, not this rank's next step.
        self.transport.timed_wait(receives.recvs)
        for msg, tensors in zip(step.recvs, receives.received, strict=True):
            self.compute.inbox[msg] = tensors
        self.sends.release(delivered)

    def finish(self) -> None:
        """Wait for every send still in flight."""
        self.compute.finish()
        started = time.process_time()
        try:
            self.sends.wait_all()
            self.transport.finish_headers()
        except RuntimeError as err:
            raise self._failure("failed waiting for its last sends to be received", err) from err
        finally:
            _message_cpu[0] += time.process_time() - started

    def _failure(self, what: str, err: RuntimeError) -> CollectiveError:
        return CollectiveError(
            f"rank {dist.get_rank()}: pipeline rank {self.pp_rank} {what}, over "
            f"{comm.describe(self.transport.group)}. A peer rank may have failed or be stuck; "
            f"look at its log first. ({comm.one_line(err)})"
        )


class EarlyReceives:
    """The next step's receives, posted one step ahead of the step that needs them.

    gloo writes a message only once its receiver has posted the receive (the receiver
    notifies the sender, then the data follows), so a receive posted just before it is
    needed puts that round trip on the critical path; posted a step early, the
    notification crosses while this rank computes, and an NCCL receive is queued on its
    stream before the send arrives. Receives on each channel keep their order, so FIFO
    matching is unchanged, and on NCCL a receive posted early only queues behind earlier
    receives of the same direction. Only receives whose shapes are known a step ahead
    go early: gradients whose forward has run, and activations when their shapes are
    declared; negotiated activations wait for their headers.

    Args:
        transport: posts the receives.
        shapes: says which receives' shapes are known ahead.
        pp_rank: this rank in the pipeline group.
    """

    def __init__(self, transport: Transport, shapes: ActivationShapes, pp_rank: int) -> None:
        self.transport = transport
        self.shapes = shapes
        self.pp_rank = pp_rank
        self.posted: Posted | None = None

    def take(self) -> Posted | None:
        """The receives posted ahead for the step about to post its messages, or ``None``
        if that step's receives were not posted ahead; each posting is returned once."""
        posted, self.posted = self.posted, None
        return posted

    def post_ahead(self, upcoming: Step | None) -> None:
        """Post the receives of ``upcoming`` (the step after the current one) now, if their
        shapes are known."""
        if upcoming is None or not upcoming.recvs:
            return
        specs = self.shapes.ahead(upcoming)
        if specs is not None:
            peers = [peer_of(m, self.pp_rank) for m in upcoming.recvs]
            self.posted = self.transport.post([], list(zip(peers, specs, strict=True)))


class InFlightSends:
    """The sends of one pipeline rank that are posted but not yet known to be done.

    A send is known to be done when the plan proves it delivered
    (:func:`~megapp.pipeline_parallel.messages.delivered_sends`) or, where the
    transport's sends report completion (NCCL, not gloo), as soon as it says so. Its
    requests are then waited for (which returns at once) and the sent activations no
    backward needs lose their storage (:func:`~megapp.autograd.saved.drop_storage`), so
    the activations a rank holds are bounded by the schedule, not by the microbatch count.

    Args:
        transport: waits for the sends and says whether they report completion.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        # Per message: its send requests and the tensors whose storage goes once it is done.
        self.pending: dict[Message, tuple[list[dist.Work], tuple[torch.Tensor, ...]]] = {}

    def add(
        self, message: Message, requests: list[dist.Work], droppable: tuple[torch.Tensor, ...]
    ) -> None:
        """Track the posted send of ``message``; ``droppable`` lose their storage once done."""
        self.pending[message] = (requests, droppable)

    def release(self, delivered: Sequence[Message]) -> None:
        """Finish the sends of ``delivered`` (proven so by the plan) and those that report
        completion, freeing their droppable tensors' storage."""
        # a send that reported completion earlier is finished already
        done = [m for m in delivered if m in self.pending]
        if self.transport.sends_report_completion:
            done += [
                m
                for m, (requests, _) in self.pending.items()
                if m not in delivered and all(r.is_completed() for r in requests)
            ]
        self._finish(done)

    def wait_all(self) -> None:
        """Wait for every send still in flight and free what it held."""
        self._finish(list(self.pending))

    def _finish(self, messages: Sequence[Message]) -> None:
        for message in messages:
            requests, droppable = self.pending.pop(message)
            self.transport.wait(requests)  # returns at once for a delivered message
            for t in droppable:
                drop_storage(t)
