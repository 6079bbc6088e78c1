"""Run any pipeline schedule on real processes.

The engine walks this rank's steps of the communication plan
(:mod:`megapp.pipeline_parallel.plan`): post the step's batch of sends and
receives, wait for it, run the step's forward or backward. Which tensors go
where follows from the schedule; the engine holds no schedule-specific code.

The user's ``forward_step_func(data_iterator, model_chunk, inputs)`` runs one
microbatch through one chunk. ``inputs`` is ``None`` on the first virtual
stage (the function reads its batch from the iterator) and the tuple of
tensors received from the previous stage otherwise. It returns the chunk's
output (a tensor or a tuple of tensors) and, on the last stage, a function
mapping that output to the microbatch's mean loss.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapp.pipeline_parallel.p2p import TensorSpec, Transport, specs_of
from megapp.pipeline_parallel.plan import Message, Step, communication_plan, incoming, outgoing
from megapp.pipeline_parallel.schedules import Action, Op, Schedule, build_schedule
from megapp.pipeline_parallel.simulate import Event

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
class PipelineResult:
    """What one call of :func:`forward_backward` measured.

    loss: mean microbatch loss of the iteration, identical on every rank of the
        pipeline (a 0-dim float tensor).
    microbatch_losses: per-microbatch losses; only on the rank holding the last stage.
    peak_in_flight: most microbatch activations this rank held at once.
    events: this rank's timeline when recording was asked for.
    """

    loss: torch.Tensor
    microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    peak_in_flight: int = 0
    events: list[Event] = field(default_factory=list)


@functools.lru_cache(maxsize=64)
def _plan(schedule: Schedule) -> list[list[Step]]:
    return communication_plan(schedule)  # validated once per schedule


def _as_tuple(output: Any, where: str) -> tuple[torch.Tensor, ...]:
    outputs = output if isinstance(output, tuple | list) else (output,)
    if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs):
        raise TypeError(f"{where} must return a tensor or a tuple of tensors, got {output!r}")
    return tuple(outputs)


def _storage_is_free_to_drop(t: torch.Tensor) -> bool:
    """True if no autograd node can need ``t``'s values: it is no view, and the op
    that made it did not save it for backward (as tanh or relu save their output)."""
    node = t.grad_fn
    if node is None or t._base is not None:
        return False
    for name in dir(node):
        if name.startswith("_saved_"):
            with contextlib.suppress(RuntimeError):
                saved = getattr(node, name)
                if isinstance(saved, torch.Tensor) and saved.data_ptr() == t.data_ptr():
                    return False
    return True


def _drop_storage(t: torch.Tensor) -> None:
    """Free a sent activation's memory but keep its autograd node (Megatron's trick):
    backward only needs the node and the incoming gradient, not the values."""
    if _storage_is_free_to_drop(t):
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


class _Runner:
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
        self.sent_specs: dict[tuple[int, int], tuple[TensorSpec, ...]] = {}
        self.saved: dict[tuple[int, int], tuple[tuple, tuple]] = {}
        self.losses: list[torch.Tensor] = []
        self.backwards_left = [schedule.num_microbatches] * schedule.num_chunks
        self.in_flight = self.peak = 0
        self.events: list[Event] = []

    # ----- communication ---------------------------------------------------
    def _peer(self, msg: Message) -> int:
        return msg.dst if msg.src == self.stage else msg.src

    def _recv_specs(self, step: Step) -> list[tuple[TensorSpec, ...]]:
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
        specs = []
        for msg in step.recvs:
            if msg.op is Op.FORWARD:
                specs.append(next(negotiated))
            else:  # gradients of what this rank sent: shapes it already knows
                chunk = self.schedule.chunk_of(msg.dst_stage)
                sent = self.sent_specs[(msg.microbatch, chunk)]
                specs.append(tuple(s for s in sent if s.dtype.is_floating_point))
        return specs

    def communicate(self, step: Step) -> None:
        if not step.sends and not step.recvs:
            return
        try:
            self._communicate(step)
        except RuntimeError as err:
            before = f"before {step.action}" if step.action else "at the end of the iteration"
            what = [f"send of the {m}" for m in step.sends]
            what += [f"receive of the {m}" for m in step.recvs]
            raise RuntimeError(
                f"pipeline rank {self.stage} {before} failed waiting for: {'; '.join(what)}. "
                f"A peer rank may have failed or be stuck; look at its log first. ({err})"
            ) from err

    def _communicate(self, step: Step) -> None:
        specs = self._recv_specs(step)
        sends = [(self._peer(m), self.outbox.pop(m)) for m in step.sends]
        received = self.transport.exchange(
            sends, [(self._peer(m), s) for m, s in zip(step.recvs, specs, strict=True)]
        )
        for msg, tensors in zip(step.recvs, received, strict=True):
            self.inbox[msg] = tensors
        for msg, (_, tensors) in zip(step.sends, sends, strict=True):
            if msg.op is Op.FORWARD:
                for t in tensors:
                    _drop_storage(t)

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
        grad_mode = torch.no_grad() if schedule.forward_only else contextlib.nullcontext()
        with grad_mode:
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
    def run(self, steps: list[Step]) -> None:
        for step in steps:
            self.communicate(step)
            action = step.action
            if action is None:
                continue
            start = self.clock()
            if action.op is Op.FORWARD:
                self.forward(action)
            else:
                self.backward(action)
            self.events.append(Event(self.stage, "compute", str(action), start, self.clock()))


def forward_backward(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | Sequence[Iterator] | None,
    model_chunks: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    *,
    schedule: str | Schedule | None = None,
    pp_group: dist.ProcessGroup | None = None,
    tensor_shapes: Sequence[TensorSpec] | None = None,
    forward_only: bool = False,
    hooks: PipelineHooks | None = None,
    record: bool = False,
    device: torch.device | str | None = None,
    timeout: float | None = None,
) -> PipelineResult:
    """Run one iteration (forward and backward of ``num_microbatches``) on this rank.

    Args:
        forward_step_func: ``(data_iterator, model_chunk, inputs) -> (output, loss_func)``.
        data_iterator: one iterator, or one per model chunk.
        model_chunks: this rank's model chunk(s); chunk ``c`` is virtual stage ``c·p + rank``.
        num_microbatches: microbatches per iteration.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` or a :class:`Schedule`;
            default 1f1b, or interleaved-1f1b with several chunks.
        pp_group: the pipeline group (default: the whole world; ``None`` without
            torch.distributed means one stage).
        tensor_shapes: the shapes and dtypes every stage sends, if fixed; ``None``
            negotiates them per message, so sequence length may change freely.
        forward_only: run the forwards only (evaluation), without keeping graphs.
        hooks: see :class:`PipelineHooks`.
        record: keep this rank's timeline of actions and waits in the result.
        device: where received tensors live (default: cuda if available, else cpu).
        timeout: seconds to wait for one batch of messages before failing (default:
            the process group's timeout), so a dead or stuck peer fails this rank too.

    Gradients accumulate into the chunks' parameters as ``d(mean loss)/dθ``.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
    if isinstance(data_iterator, Sequence):
        if len(data_iterator) != len(chunks):
            raise ValueError(
                f"got {len(data_iterator)} data iterators for {len(chunks)} model chunks; "
                "pass one iterator per chunk or a single one"
            )
        iterators = list(data_iterator)
    else:
        iterators = [data_iterator] * len(chunks)
    distributed = dist.is_available() and dist.is_initialized()
    p = dist.get_world_size(pp_group) if distributed else 1
    stage = dist.get_rank(pp_group) if distributed else 0
    if isinstance(schedule, Schedule):
        sched = schedule
        if (sched.num_stages, sched.num_microbatches, sched.num_chunks) != (
            p,
            num_microbatches,
            len(chunks),
        ):
            raise ValueError(
                f"schedule is for p={sched.num_stages}, m={sched.num_microbatches}, "
                f"v={sched.num_chunks} but this call has p={p}, m={num_microbatches}, "
                f"v={len(chunks)}"
            )
    else:
        name = schedule or ("interleaved-1f1b" if len(chunks) > 1 else "1f1b")
        sched = build_schedule(name, p, num_microbatches, len(chunks))
    if forward_only:
        sched = sched.without_backward()
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    if record and distributed and p > 1:
        dist.barrier(group=pp_group)  # one time origin for every rank's timeline
    origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - origin

    runner: _Runner | None = None

    def on_wait(start: float, end: float) -> None:
        if record and runner is not None:
            runner.events.append(Event(stage, "wait", "p2p", start - origin, end - origin))

    transport = Transport(
        pp_group if distributed else None,
        torch.device(device),
        on_wait,
        None if timeout is None else timedelta(seconds=timeout),
    )
    if distributed and p > 1 and tensor_shapes is None:
        transport.prepare()
    runner = _Runner(
        sched,
        stage,
        forward_step_func,
        iterators,
        chunks,
        transport,
        tensor_shapes=tensor_shapes,
        hooks=hooks or PipelineHooks(),
        clock=clock,
    )
    runner.run(_plan(sched)[stage])
    if not forward_only and runner.hooks.post_backward is not None:
        runner.hooks.post_backward()

    # Every rank reports the loss: the last stage's mean, summed over the pipeline group.
    holds_loss = stage == sched.rank_of(sched.num_virtual_stages - 1)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    if holds_loss:
        loss += torch.stack(runner.losses).float().mean()
    if distributed and p > 1:
        dist.all_reduce(loss, group=pp_group)
    return PipelineResult(
        loss=loss,
        microbatch_losses=runner.losses,
        peak_in_flight=runner.peak,
        events=runner.events if record else [],
    )


def get_forward_backward_func(schedule: str | None = None) -> Callable[..., PipelineResult]:
    """Megatron-style accessor: :func:`forward_backward` bound to the current layout's
    pipeline group and schedule (interleaved when virtual stages are set)."""
    from megapp import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    if schedule is None:
        schedule = (
            "interleaved-1f1b" if ps.get_virtual_pipeline_model_parallel_world_size() else "1f1b"
        )
    return functools.partial(forward_backward, schedule=schedule, pp_group=pp_group)
