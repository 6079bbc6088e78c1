"""One rank's side of a pipeline iteration: post each step's messages, run its action.

:class:`StageRunner` walks this rank's steps of the communication plan; which
tensors travel where follows from the schedule, so nothing here is specific to
one schedule. Each job has its own part:

- :class:`~megapp.pipeline_parallel.shapes.ActivationShapes` says what each
  receive holds, negotiating headers when shapes are not declared;
- :class:`~megapp.pipeline_parallel.receives.EarlyReceives` posts the next
  step's receives ahead of it where the transport wants that (gloo);
- :class:`~megapp.pipeline_parallel.sends.InFlightSends` finishes sends once
  they are done and frees their activations' storage;
- :class:`~megapp.pipeline_parallel.compute.StageCompute` runs the forward and
  backward actions.

:func:`message_cpu_seconds` counts the CPU time this process spends on the messages
(posting, waiting, finishing), which a profile turns into the work a message costs.

A failed or timed-out wait raises :class:`~megapp.comm.CollectiveError` naming
the pipeline rank, the step, what was waited for and the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp.comm import CollectiveError
from megapp.pipeline_parallel.compute import ForwardStepFunc, PipelineHooks, StageCompute
from megapp.pipeline_parallel.messages import Message, Step
from megapp.pipeline_parallel.p2p import TensorSpec, Transport
from megapp.pipeline_parallel.receives import EarlyReceives
from megapp.pipeline_parallel.schedules import Action, Schedule
from megapp.pipeline_parallel.sends import InFlightSends
from megapp.pipeline_parallel.shapes import ActivationShapes, peer_of
from megapp.pipeline_parallel.simulate import Event
from megapp.pipeline_parallel.weight_stash import WeightStash

__all__ = ["ForwardStepFunc", "PipelineHooks", "StageRunner", "message_cpu_seconds"]

_message_cpu = [0.0]  # CPU seconds this process has spent on pipeline messages


def message_cpu_seconds() -> float:
    """CPU seconds (all of this process's threads) spent so far in :class:`StageRunner`'s
    message handling: posting sends and receives, waiting for them, finishing the last
    sends. With gloo that is the copies through the sockets; a blocked wait costs none."""
    return _message_cpu[0]


class StageRunner:
    """One pipeline rank during one iteration.

    Args:
        schedule: the iteration's schedule.
        pp_rank: this rank in the pipeline group.
        transport: point-to-point messages over the pipeline group.
        forward_step_func: ``(data_iterator, model_chunk, inputs) -> (output, loss_func)``.
        iterators: one data iterator per model chunk.
        chunks: this rank's model chunks, by chunk index.
        tensor_shapes: the shapes every stage sends, or ``None`` to negotiate them.
        hooks: see :class:`PipelineHooks`.
        clock: seconds since the iteration's time origin, for :attr:`events`.
        stash: an asynchronous schedule's weight versions, kept between runs.

    After :meth:`run`, :attr:`compute` holds the losses and the peak number of
    microbatches in flight, and :attr:`events` the timeline of this rank's actions
    (the engine adds the waits).
    """

    def __init__(
        self,
        *,
        schedule: Schedule,
        pp_rank: int,
        transport: Transport,
        forward_step_func: ForwardStepFunc,
        iterators: Sequence[Iterator | None],
        chunks: Sequence[nn.Module],
        tensor_shapes: Sequence[TensorSpec] | None,
        hooks: PipelineHooks,
        clock: Callable[[], float],
        stash: WeightStash | None = None,
    ) -> None:
        self.pp_rank = pp_rank
        self.transport = transport
        self.clock = clock
        self.shapes = ActivationShapes(transport, pp_rank, tensor_shapes)
        self.early = EarlyReceives(transport, self.shapes, pp_rank)
        self.sends = InFlightSends(transport)
        self.compute = StageCompute(
            schedule=schedule,
            pp_rank=pp_rank,
            forward_step_func=forward_step_func,
            iterators=iterators,
            chunks=chunks,
            shapes=self.shapes,
            hooks=hooks,
            stash=stash,
        )
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
        """Run ``action`` and add it to the timeline, with the CPU time it took."""
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
            if upcoming is not None and self.early.enabled:
                what += [f"receive of the {m} (posted ahead)" for m in upcoming.recvs]
            raise self._failure(f"{before} failed waiting for: {'; '.join(what)}", err) from err
        finally:
            _message_cpu[0] += time.process_time() - started

    def _communicate(self, step: Step, upcoming: Step | None, delivered: Sequence[Message]) -> None:
        outgoing = [self.compute.outbox.pop(m) for m in step.sends]
        peers = [peer_of(m, self.pp_rank) for m in step.sends]
        sends = [(peer, o.tensors) for peer, o in zip(peers, outgoing, strict=True)]
        # Where sends finish in the background (gloo) the data goes out before this step
        # waits for anything, headers included: a peer that needs it first is never held
        # up by what this rank still waits for.
        early_sends = None if self.transport.posts_batches else self.transport.post(sends, [])
        specs = self.shapes.for_step(step, [o.tensors for o in outgoing])  # also sends headers
        remaining = sends if early_sends is None else []
        receives = self.early.take()
        if receives is not None:  # this step's receives went out with the previous step
            posted = self.transport.post(remaining, [])
        else:
            sources = [peer_of(m, self.pp_rank) for m in step.recvs]
            receives = self.transport.post(remaining, list(zip(sources, specs, strict=True)))
            posted = receives
        self.early.post_ahead(upcoming)
        send_requests = (early_sends or posted).sends
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
        if self.compute.stash is not None:
            self.compute.stash.finish()
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
