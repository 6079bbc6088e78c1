"""The compute of one pipeline rank's forwards and whole backwards, given what it received.

:class:`StageCompute` runs one action at a time: it takes the action's input
from :attr:`StageCompute.inbox` and leaves what the action sends in
:attr:`StageCompute.outbox`, for the runner to post. The method that runs an
action is looked up by the action's op in :attr:`StageCompute.handlers`, so a
new kind of action is one method and one entry there. Which virtual stage a
chunk is, and where its messages come from and go, is asked of the schedule
(:func:`~megapp.pipeline_parallel.messages.incoming`,
:func:`~megapp.pipeline_parallel.messages.outgoing`), never derived from a placement.

This is all a flushed schedule with whole backwards (GPipe, 1F1B, interleaved) runs.
The others extend it: a split backward (``I``, ``W``) in
:mod:`~megapp.pipeline_parallel.split_backward`, the weight versions and optimizer
steps (``U``) of an asynchronous schedule in :mod:`~megapp.pipeline_parallel.weight_stash`;
the engine picks the one a schedule needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megapp.autograd.saved import SavedStorages, run_backward
from megapp.pipeline_parallel.messages import Message, incoming, outgoing
from megapp.pipeline_parallel.p2p import ActivationShapes
from megapp.pipeline_parallel.schedules import Action, Op, Schedule

LossFunc = Callable[[Any], torch.Tensor]
ForwardStepFunc = Callable[
    [Iterator | None, nn.Module, tuple[torch.Tensor, ...] | None], tuple[Any, LossFunc | None]
]


@dataclass
class PipelineHooks:
    """Callbacks for the training step.

    before_backward(chunk, is_last): runs before every backward action (``B``, ``I``
        or ``W``); ``is_last`` is True when data-parallel gradient reduction should be
        enabled for the action that follows (see :func:`sync_actions`).
    after_backward(chunk): runs after every backward action (``B``, ``I`` or ``W``),
        e.g. to settle the data-parallel reductions it started.
    post_backward(): runs once after every backward of the iteration, e.g. to
        all-reduce the tied embedding's gradient between first and last stage.
    update(step): an asynchronous schedule's optimizer step ``step`` of this rank
        (reduce the gradients, step, zero them); they are complete when it runs.
    """

    before_backward: Callable[[int, bool], None] | None = None
    after_backward: Callable[[int], None] | None = None
    post_backward: Callable[[], None] | None = None
    update: Callable[[int], None] | None = None


_BACKWARDS = frozenset((Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD))


@dataclass
class Outgoing:
    """What an action sends: its tensors, and those of them whose storage may be freed
    once the send is done (sent activations no backward node reads)."""

    tensors: tuple[torch.Tensor, ...]
    droppable: tuple[torch.Tensor, ...] = ()


def sync_actions(actions: Sequence[Action], num_chunks: int, single_stage: bool) -> set[Action]:
    """The actions before which a chunk's data-parallel reduction is enabled, chosen as
    below among the actions since the previous update ``U`` (or the start), for every
    update and for the end.

    Reduction of a bucket starts once every parameter in it has had a gradient while
    reduction is enabled (:class:`~megapp.distributed.ddp.DistributedDataParallel`), so
    from the first enabled action on each parameter may receive at most one more
    gradient, or part of it would miss the reduction. Hence: a chunk's last ``B``; or its
    last ``W`` together with the ``I`` of the same microbatch when that ``I`` is the
    chunk's action just before it (``I`` gives the gradients of every parameter the
    ``W`` does not); or the last ``W`` alone. Buckets with a parameter that received
    nothing in those actions are reduced by ``finish_grad_sync`` instead. The pair is
    not used when one chunk is the whole model (``single_stage``): there a tied
    embedding's weight gets gradients from both the lookup (``I``) and the output layer
    (``W``).
    """
    enabled: set[Action] = set()
    segment: list[Action] = []
    for action in [*actions, None]:
        if action is None or action.op is Op.UPDATE:
            enabled |= _sync_before_update(segment, num_chunks, single_stage)
            segment = []
        else:
            segment.append(action)
    return enabled


def _sync_before_update(
    actions: Sequence[Action], num_chunks: int, single_stage: bool
) -> set[Action]:
    enabled = set()
    for chunk in range(num_chunks):
        grads = [a for a in actions if a.chunk == chunk and a.op is not Op.FORWARD]
        if not grads:
            continue
        last = grads[-1]
        enabled.add(last)
        before = grads[-2] if len(grads) > 1 else None
        if (
            not single_stage
            and last.op is Op.WEIGHT_GRAD
            and before == Action(Op.INPUT_GRAD, last.microbatch, chunk)
        ):
            enabled.add(before)
    return enabled


def _as_tuple(output: Any, where: str) -> tuple[torch.Tensor, ...]:
    outputs = output if isinstance(output, tuple | list) else (output,)
    if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs):
        raise TypeError(f"{where} must return a tensor or a tuple of tensors, got {output!r}")
    return tuple(outputs)


class StageCompute:
    """Forward and backward actions of one pipeline rank during one iteration.

    Args:
        schedule: the iteration's schedule (stage placement, microbatches, forward-only).
        pp_rank: this rank in the pipeline group.
        forward_step_func: ``(data_iterator, model_chunk, inputs) -> (output, loss_func)``.
        iterators: one data iterator per model chunk.
        chunks: this rank's model chunks, by chunk index.
        shapes: records what each forward sends (and checks it against declared shapes).
        hooks: see :class:`PipelineHooks`.

    After the iteration, :attr:`losses` holds the last stage's per-microbatch losses,
    :attr:`peak` the most microbatches whose activations this rank held at once, and
    :attr:`weight_versions` / :attr:`weight_copies` the weights it held (one version, no
    copy, but for the asynchronous schedules).
    """

    def __init__(
        self,
        *,
        schedule: Schedule,
        pp_rank: int,
        forward_step_func: ForwardStepFunc,
        iterators: Sequence[Iterator | None],
        chunks: Sequence[nn.Module],
        shapes: ActivationShapes,
        hooks: PipelineHooks,
    ) -> None:
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.forward_step_func = forward_step_func
        self.iterators = iterators
        self.chunks = chunks
        self.shapes = shapes
        self.hooks = hooks
        self.inbox: dict[Message, list[torch.Tensor]] = {}
        self.outbox: dict[Message, Outgoing] = {}
        # Per (microbatch, chunk) whose backward is still due: the forward's inputs and outputs.
        self.saved: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], ...]] = {}
        self.losses: list[torch.Tensor] = []
        self.sync = sync_actions(
            schedule.actions[pp_rank],
            schedule.num_chunks,
            schedule.num_virtual_stages == 1,
        )
        self.in_flight = self.peak = 0
        self.weight_versions, self.weight_copies = 1, 0
        self.handlers: dict[Op, Callable[[Action], None]] = {
            Op.FORWARD: self.forward,
            Op.BACKWARD: self.backward,
        }

    def run(self, action: Action) -> None:
        """Run ``action``: what it receives must be in :attr:`inbox`; what it sends is left
        in :attr:`outbox`."""
        self.handlers[action.op](action)
        if action.op in _BACKWARDS and self.hooks.after_backward is not None:
            self.hooks.after_backward(action.chunk)

    def finish(self) -> None:
        """The iteration's last action has run."""

    def forward(self, action: Action) -> None:
        """Forward of one microbatch through one chunk; the last stage computes its loss."""
        schedule, chunk, microbatch = self.schedule, action.chunk, action.microbatch
        stage = schedule.virtual_stage(self.pp_rank, chunk)
        is_last = stage == schedule.num_virtual_stages - 1
        recv = incoming(schedule, self.pp_rank, action)
        inputs = tuple(self.inbox.pop(recv)) if recv else None
        if inputs is not None and not schedule.forward_only:
            for t in inputs:
                if t.is_floating_point():
                    t.requires_grad_()
        saved = SavedStorages()
        if schedule.forward_only:
            context = torch.no_grad()
        else:  # the loss is never sent, so the last stage records nothing
            context = contextlib.nullcontext() if is_last else saved.recording()
        with context:
            output, loss_func = self.forward_step_func(
                self.iterators[chunk], self.chunks[chunk], inputs
            )
            if is_last:
                outputs = (self._scaled_loss(output, loss_func),)
        if not is_last:
            outputs = _as_tuple(output, "forward_step_func")
            self.shapes.record_sent(microbatch, stage, outputs)
            droppable = () if schedule.forward_only else saved.droppable(outputs)
            self._deliver(outgoing(schedule, self.pp_rank, action), Outgoing(outputs, droppable))
        if not schedule.forward_only:
            self.saved[(microbatch, chunk)] = (inputs or (), outputs)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def _scaled_loss(self, output: Any, loss_func: LossFunc | None) -> torch.Tensor:
        """Record the microbatch's loss; return it divided by the microbatch count."""
        if loss_func is None:
            raise ValueError(
                "forward_step_func must return (output, loss_func) on the last "
                "pipeline stage; it returned no loss function"
            )
        loss = loss_func(output)
        loss = loss[0] if isinstance(loss, tuple) else loss
        self.losses.append(loss.detach())
        # The one place the loss is averaged over the microbatches of one optimizer step.
        return loss / self.schedule.microbatches_per_update

    def gradients_in(self, action: Action):
        """Run the hook; return the forward's inputs, its outputs needing a gradient and
        their gradients (received, or on the last stage the scaled loss's ones)."""
        self.before_backward(action)
        inputs, outputs = self.saved.pop((action.microbatch, action.chunk))
        recv = incoming(self.schedule, self.pp_rank, action)
        if recv is None:  # last stage: start from the scaled loss
            return inputs, outputs, [torch.ones_like(outputs[0])]
        return inputs, [o for o in outputs if o.is_floating_point()], self.inbox.pop(recv)

    def before_backward(self, action: Action) -> None:
        """The hook that enables data-parallel reduction before the chunk's last gradients."""
        if self.hooks.before_backward is not None:
            self.hooks.before_backward(action.chunk, action in self.sync)

    def send_input_grads(self, action: Action, inputs: Sequence[torch.Tensor]) -> None:
        """Leave the gradients of the forward's ``inputs`` for the previous stage."""
        send = outgoing(self.schedule, self.pp_rank, action)
        if send is not None:
            grads = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in inputs
                if t.is_floating_point()
            )
            self._deliver(send, Outgoing(grads))

    def _deliver(self, message: Message, out: Outgoing) -> None:
        """Leave ``out`` for the runner to send, or, for a stage on this same rank (the
        turn of a V), straight in the inbox: detached, so the receiving chunk's backward
        stops at its own input, and never dropped."""
        if message.local:
            self.inbox[message] = [t.detach() for t in out.tensors]
        else:
            self.outbox[message] = out

    def backward(self, action: Action) -> None:
        """Backward of one microbatch through one chunk, from the received gradient (or, on
        the last stage, from the scaled loss); sends the inputs' gradients back."""
        inputs, outputs, grads = self.gradients_in(action)
        run_backward(outputs, grads)
        self.send_input_grads(action, inputs)
        self.in_flight -= 1
