"""One rank's side of a pipeline iteration: post each step's messages, run its action.

:class:`StageRunner` walks this rank's steps of the communication plan; which
tensors travel where follows from the schedule, so nothing here is specific
to one schedule. Sent activations give up their storage once the send is
done (their autograd nodes stay), so memory follows the theory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp.comm import CollectiveError
from megapp.pipeline_parallel.p2p import Posted, TensorSpec, specs_of
from megapp.pipeline_parallel.plan import Message, Step, incoming, outgoing
from megapp.pipeline_parallel.schedules import Action, Op
from megapp.pipeline_parallel.simulate import Event
from megapp.saved_tensors import observe_saved

LossFunc = Callable[[Any], torch.Tensor]
ForwardStepFunc = Callable[
    [Iterator | None, nn.Module, tuple[torch.Tensor, ...] | None], tuple[Any, LossFunc | None]
]


@dataclass
class PipelineHooks:
    """Callbacks for the training step.

    before_backward(chunk, is_last): runs before every backward; ``is_last`` is
        True for the chunk's last microbatch, when data-parallel gradient
        reduction should be enabled for the backward that follows.
    post_backward(): runs once after every backward of the iteration, e.g. to
        all-reduce the tied embedding's gradient between first and last stage.
    """

    before_backward: Callable[[int, bool], None] | None = None
    post_backward: Callable[[], None] | None = None


def _as_tuple(output: Any, where: str) -> tuple[torch.Tensor, ...]:
    outputs = output if isinstance(output, tuple | list) else (output,)
    if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs):
        raise TypeError(f"{where} must return a tensor or a tuple of tensors, got {output!r}")
    return tuple(outputs)


class SavedStorages:
    """Records the storage of every tensor autograd keeps for backward while a forward runs.

    A sent activation may be dropped only if no backward node keeps its values:
    its own node (tanh keeps its output) or a node that produced another sent
    tensor from it (a stage returning ``(h, h * s)`` keeps ``h`` in the product's
    node). megapp's own saved-tensor hooks (recompute) hide what they keep from
    outer hooks, so their observers are watched too.
    """

    def __init__(self) -> None:
        self.pointers: set[int] = set()

    def _add(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            self.pointers.add(t.untyped_storage().data_ptr())
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with (
            torch.autograd.graph.saved_tensors_hooks(self._add, lambda t: t),
            observe_saved(self._add),
        ):
            yield

    def droppable(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The outputs whose values no backward node needs: no view, no saved storage."""
        return tuple(
            t
            for t in outputs
            if t.grad_fn is not None
            and t._base is None
            and t.numel()
            and t.untyped_storage().data_ptr() not in self.pointers
        )


def _drop_storage(t: torch.Tensor) -> None:
    """Free a sent activation's memory but keep its autograd node (Megatron's trick):
    backward only needs the node and the incoming gradient, not the values."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    # The engine call skips autograd's shape check, which a dropped output would fail.
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    if pairs:
        torch.autograd.Variable._execution_engine.run_backward(
            tuple(o for o, _ in pairs),
            tuple(g for _, g in pairs),
            keep_graph=False,
            create_graph=False,
            inputs=(),
            allow_unreachable=True,
            accumulate_grad=True,
        )


class StageRunner:
    """The state of one rank during one iteration."""

    def __init__(self, schedule, stage, forward_step_func, iterators, chunks, transport, **opts):
        self.schedule = schedule
        self.stage = stage
        self.forward_step_func = forward_step_func
        self.iterators = iterators
        self.chunks = chunks
        self.transport = transport
        self.tensor_shapes: Sequence[TensorSpec] | None = opts["tensor_shapes"]
        self.hooks: PipelineHooks = opts["hooks"]
        self.clock = opts["clock"]
        self.inbox: dict[Message, list[torch.Tensor]] = {}
        self.outbox: dict[Message, tuple[torch.Tensor, ...]] = {}
        self.droppable: dict[Message, tuple[torch.Tensor, ...]] = {}
        # Sends not yet known to be done: their requests and the tensors to drop then.
        self.sending: dict[Message, tuple[list, tuple[torch.Tensor, ...]]] = {}
        self.delivered: Sequence[tuple[Message, ...]] = ()  # per step, see delivered_sends
        self.early: Posted | None = None  # the next step's receives, posted ahead
        self.sent_specs: dict[tuple[int, int], tuple[TensorSpec, ...]] = {}
        self.saved: dict[tuple[int, int], tuple[tuple, tuple]] = {}
        self.losses: list[torch.Tensor] = []
        self.backwards_left = [schedule.num_microbatches] * schedule.num_chunks
        self.in_flight = self.peak = 0
        self.events: list[Event] = []

    # ----- communication ---------------------------------------------------
    def _peer(self, msg: Message) -> int:
        return msg.dst if msg.src == self.stage else msg.src

    def _gradient_specs(self, msg: Message) -> tuple[TensorSpec, ...] | None:
        """Shapes of a gradient of what this rank sent (None before that forward ran)."""
        sent = self.sent_specs.get((msg.microbatch, self.schedule.chunk_of(msg.dst_stage)))
        return None if sent is None else tuple(s for s in sent if s.dtype.is_floating_point)

    def _recv_specs(self, step: Step) -> list[tuple[TensorSpec, ...]]:
        """Shapes of the step's receives; negotiates this step's activation headers (the
        sends' and the receives') when shapes are not declared."""
        activations = [m for m in step.recvs if m.op is Op.FORWARD]
        if self.tensor_shapes is not None:
            negotiated = iter([tuple(self.tensor_shapes)] * len(activations))
        else:
            sends = [(self._peer(m), specs_of(self.outbox[m])) for m in step.sends]
            sends = [s for s, m in zip(sends, step.sends, strict=True) if m.op is Op.FORWARD]
            if sends or activations:
                negotiated = iter(
                    self.transport.exchange_headers(sends, [self._peer(m) for m in activations])
                )
        return [
            next(negotiated) if msg.op is Op.FORWARD else self._gradient_specs(msg)
            for msg in step.recvs
        ]

    def _specs_ahead(self, step: Step) -> list[tuple[TensorSpec, ...]] | None:
        """The step's receive shapes if known now, without negotiation; else None."""
        specs = []
        for msg in step.recvs:
            if msg.op is Op.FORWARD:
                if self.tensor_shapes is None:
                    return None
                specs.append(tuple(self.tensor_shapes))
            else:
                gradient = self._gradient_specs(msg)
                if gradient is None:
                    return None
                specs.append(gradient)
        return specs

    def communicate(self, index: int, step: Step, upcoming: Step | None = None) -> None:
        if not (step.sends or step.recvs or (upcoming is not None and upcoming.recvs)):
            return
        try:
            self._communicate(index, step, upcoming)
        except RuntimeError as err:
            before = f"before {step.action}" if step.action else "at the end of the iteration"
            what = [f"send of the {m}" for m in step.sends]
            what += [f"receive of the {m}" for m in step.recvs]
            if upcoming is not None and self.transport.posts_receives_early:
                what += [f"receive of the {m} (posted ahead)" for m in upcoming.recvs]
            raise CollectiveError(
                f"rank {dist.get_rank()}: pipeline rank {self.stage} {before} failed waiting "
                f"for: {'; '.join(what)}, over {comm.describe(self.transport.group)}. A peer "
                f"rank may have failed or be stuck; look at its log first. ({comm.one_line(err)})"
            ) from err

    def _communicate(self, index: int, step: Step, upcoming: Step | None) -> None:
        specs = self._recv_specs(step)  # also negotiates the sends' headers
        sends = [(self._peer(m), self.outbox.pop(m)) for m in step.sends]
        if self.early is not None:  # this step's receives went out with the previous step
            posted, early = self.transport.post(sends, []), self.early
            received, recv_requests = early.received, early.recvs
            self.early = None
        else:
            recvs = [(self._peer(m), s) for m, s in zip(step.recvs, specs, strict=True)]
            posted = self.transport.post(sends, recvs)
            received, recv_requests = posted.received, posted.recvs
        if upcoming is not None and upcoming.recvs and self.transport.posts_receives_early:
            ahead = self._specs_ahead(upcoming)
            if ahead is not None:
                peers = [self._peer(m) for m in upcoming.recvs]
                self.early = self.transport.post([], list(zip(peers, ahead, strict=True)))
        for msg, requests in zip(step.sends, posted.sends, strict=True):
            self.sending[msg] = (requests, self.droppable.pop(msg, ()))
        # Only the receives are waited for: a late peer then delays just the action that
        # needs its data, not this rank's next step.
        self.transport.timed_wait(recv_requests)
        for msg, tensors in zip(step.recvs, received, strict=True):
            self.inbox[msg] = tensors
        self._release(self.delivered[index] if self.delivered else ())

    def _release(self, delivered: Sequence[Message]) -> None:
        """Finish the sends known to be done and free their activations' storage: those the
        plan proves delivered and, where the transport can tell (NCCL), those complete."""
        done = list(delivered)
        if self.transport.sends_report_completion:
            done += [
                m
                for m, (requests, _) in self.sending.items()
                if m not in delivered and all(r.is_completed() for r in requests)
            ]
        self._release_all(done)

    def _release_all(self, messages: Sequence[Message]) -> None:
        for msg in messages:
            requests, dropped = self.sending.pop(msg)
            self.transport.wait(requests)  # returns at once for a delivered message
            for t in dropped:
                _drop_storage(t)

    def finish(self) -> None:
        """Wait for every send still in flight."""
        try:
            self._release_all(list(self.sending))
        except RuntimeError as err:
            raise CollectiveError(
                f"rank {dist.get_rank()}: pipeline rank {self.stage} failed waiting for its "
                f"last sends to be received, over {comm.describe(self.transport.group)}. A peer "
                f"rank may have failed or be stuck; look at its log first. ({comm.one_line(err)})"
            ) from err

    # ----- compute ---------------------------------------------------------
    def forward(self, action: Action) -> None:
        schedule, chunk, mb = self.schedule, action.chunk, action.microbatch
        stage = schedule.virtual_stage(self.stage, chunk)
        is_last = stage == schedule.num_virtual_stages - 1
        recv = incoming(schedule, self.stage, action)
        inputs = tuple(self.inbox.pop(recv)) if recv else None
        if inputs is not None and not schedule.forward_only:
            for t in inputs:
                if t.is_floating_point():
                    t.requires_grad_()
        saved = SavedStorages()
        if schedule.forward_only:
            context = torch.no_grad()
        else:
            context = contextlib.nullcontext() if is_last else saved.recording()
        with context:
            output, loss_func = self.forward_step_func(
                self.iterators[chunk], self.chunks[chunk], inputs
            )
            if is_last:
                if loss_func is None:
                    raise ValueError(
                        "forward_step_func must return (output, loss_func) on the last "
                        "pipeline stage; it returned no loss function"
                    )
                loss = loss_func(output)
                loss = loss[0] if isinstance(loss, tuple) else loss
                self.losses.append(loss.detach())
                # The one place the iteration's loss is averaged over microbatches.
                outputs = (loss / schedule.num_microbatches,)
        if not is_last:
            outputs = _as_tuple(output, "forward_step_func")
            self._check_declared(outputs, stage)
            send = outgoing(schedule, self.stage, action)
            self.outbox[send] = outputs
            if not schedule.forward_only:
                self.droppable[send] = saved.droppable(outputs)
            self.sent_specs[(mb, chunk)] = specs_of(outputs)
        if not schedule.forward_only:
            self.saved[(mb, chunk)] = (inputs or (), outputs)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def backward(self, action: Action) -> None:
        schedule, chunk, mb = self.schedule, action.chunk, action.microbatch
        self.backwards_left[chunk] -= 1
        if self.hooks.before_backward is not None:
            self.hooks.before_backward(chunk, self.backwards_left[chunk] == 0)
        inputs, outputs = self.saved.pop((mb, chunk))
        recv = incoming(schedule, self.stage, action)
        if recv is None:  # last stage: start from the scaled loss
            _run_backward(outputs, [torch.ones_like(outputs[0])])
        else:
            floating = [o for o in outputs if o.is_floating_point()]
            _run_backward(floating, self.inbox.pop(recv))
        send = outgoing(schedule, self.stage, action)
        if send is not None:
            self.outbox[send] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in inputs
                if t.is_floating_point()
            )
        self.in_flight -= 1

    def _check_declared(self, outputs: tuple[torch.Tensor, ...], stage: int) -> None:
        if self.tensor_shapes is None:
            return
        got = specs_of(outputs)
        if got != tuple(self.tensor_shapes):
            raise ValueError(
                f"stage {stage} produced {[(s.shape, s.dtype) for s in got]} but tensor_shapes "
                f"declares {[(s.shape, s.dtype) for s in self.tensor_shapes]}; fix the declared "
                "shapes or pass tensor_shapes=None to negotiate them"
            )

    # ----- the loop --------------------------------------------------------
    def run(self, steps: list[Step], delivered: Sequence[tuple[Message, ...]]) -> None:
        """Walk this rank's ``steps``; ``delivered`` (:func:`delivered_sends` for this rank)
        says after which step each send is known to be done."""
        self.delivered = delivered
        for index, step in enumerate(steps):
            upcoming = steps[index + 1] if index + 1 < len(steps) else None
            self.communicate(index, step, upcoming)
            action = step.action
            if action is None:
                continue
            start = self.clock()
            if action.op is Op.FORWARD:
                self.forward(action)
            else:
                self.backward(action)
            self.events.append(Event(self.stage, "compute", str(action), start, self.clock()))
        self.finish()
