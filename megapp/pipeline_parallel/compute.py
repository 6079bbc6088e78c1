"""The compute of one pipeline rank's actions, given what it received.

:class:`StageCompute` runs one action at a time: it takes the action's input
from :attr:`StageCompute.inbox` and leaves what the action sends in
:attr:`StageCompute.outbox`, for the runner to post. The method that runs an
action is looked up by the action's op in :attr:`StageCompute.handlers`, so a
new kind of action is one method and one entry there. Which virtual stage a
chunk is, and where its messages come from and go, is asked of the schedule
(:func:`~megapp.pipeline_parallel.plan.incoming`,
:func:`~megapp.pipeline_parallel.plan.outgoing`), never derived from a placement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megapp.pipeline_parallel.activation_storage import SavedStorages, run_backward
from megapp.pipeline_parallel.plan import Message, incoming, outgoing
from megapp.pipeline_parallel.schedules import Action, Op, Schedule
from megapp.pipeline_parallel.shapes import ActivationShapes

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


@dataclass
class Outgoing:
    """What an action sends: its tensors, and those of them whose storage may be freed
    once the send is done (sent activations no backward node reads)."""

    tensors: tuple[torch.Tensor, ...]
    droppable: tuple[torch.Tensor, ...] = ()


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

    After the iteration, :attr:`losses` holds the last stage's per-microbatch losses and
    :attr:`peak` the most microbatches whose activations this rank held at once.
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
        self.backwards_left = [schedule.num_microbatches] * schedule.num_chunks
        self.in_flight = self.peak = 0
        self.handlers: dict[Op, Callable[[Action], None]] = {
            Op.FORWARD: self.forward,
            Op.BACKWARD: self.backward,
        }

    def run(self, action: Action) -> None:
        """Run ``action``: what it receives must be in :attr:`inbox`; what it sends is left
        in :attr:`outbox`."""
        self.handlers[action.op](action)

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
            self.outbox[outgoing(schedule, self.pp_rank, action)] = Outgoing(outputs, droppable)
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
        # The one place the iteration's loss is averaged over microbatches.
        return loss / self.schedule.num_microbatches

    def backward(self, action: Action) -> None:
        """Backward of one microbatch through one chunk, from the received gradient (or, on
        the last stage, from the scaled loss); sends the inputs' gradients back."""
        chunk = action.chunk
        self.backwards_left[chunk] -= 1
        if self.hooks.before_backward is not None:
            self.hooks.before_backward(chunk, self.backwards_left[chunk] == 0)
        inputs, outputs = self.saved.pop((action.microbatch, chunk))
        recv = incoming(self.schedule, self.pp_rank, action)
        if recv is None:  # last stage: start from the scaled loss
            run_backward(outputs, [torch.ones_like(outputs[0])])
        else:
            floating = [o for o in outputs if o.is_floating_point()]
            run_backward(floating, self.inbox.pop(recv))
        send = outgoing(self.schedule, self.pp_rank, action)
        if send is not None:
            self.outbox[send] = Outgoing(
                tuple(
                    t.grad if t.grad is not None else torch.zeros_like(t)
                    for t in inputs
                    if t.is_floating_point()
                )
            )
        self.in_flight -= 1
