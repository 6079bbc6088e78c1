"""Point-to-point transport between pipeline ranks.

A :class:`Transport` posts one step's sends and receives in the order the plan
gives, so every channel stays FIFO-consistent: on NCCL as one batch
(``batch_isend_irecv``, one NCCL group), on gloo each message on its own
(:attr:`Transport.posts_batches`). The runner waits for the receives and lets
the sends finish in the background; on gloo it also posts a step's receives
one step early (:attr:`Transport.posts_receives_early`) and learns that a send
is done from the plan rather than from the send
(:attr:`Transport.sends_report_completion`). Activation shapes are either
declared up front or negotiated: each activation is preceded by a small header
(number of tensors, dtypes, shapes) exchanged in its own batch on a second
process group over the same ranks, so headers never interleave with data on
one channel.

:class:`ActivationShapes` says what a rank's receives hold: an activation has the
declared shapes or those its header announces; a gradient has the shapes of the
floating-point tensors this rank sent forward for the same microbatch, so it never
needs a header.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megapp import comm
from megapp.pipeline_parallel.messages import Message, Step
from megapp.pipeline_parallel.schedules import Op

# Header layout: [num_tensors, then per tensor: dtype code, ndim, dims padded to _MAX_DIMS].
_MAX_TENSORS = 8
_MAX_DIMS = 6
_HEADER_LEN = 1 + _MAX_TENSORS * (2 + _MAX_DIMS)
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass
class Posted:
    """One posted batch: the receive buffers (one list per receive entry, filled once the
    receive requests complete), the send requests (one list per send entry) and the
    receive requests."""

    received: list[list[torch.Tensor]]
    sends: list[list[dist.Work]]
    recvs: list[dist.Work]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a stage's output."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def specs_of(tensors: Sequence[torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)


def encode_header(specs: Sequence[TensorSpec]) -> torch.Tensor:
    if len(specs) > _MAX_TENSORS:
        raise ValueError(f"a stage may send at most {_MAX_TENSORS} tensors, got {len(specs)}")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = len(specs)
    for i, spec in enumerate(specs):
        if len(spec.shape) > _MAX_DIMS or spec.dtype not in _CODE:
            raise ValueError(
                f"cannot send a {spec.dtype} tensor of shape {spec.shape} between stages "
                f"(at most {_MAX_DIMS} dims; dtypes {[str(d) for d in _DTYPES]})"
            )
        base = 1 + i * (2 + _MAX_DIMS)
        header[base] = _CODE[spec.dtype]
        header[base + 1] = len(spec.shape)
        header[base + 2 : base + 2 + len(spec.shape)] = torch.tensor(spec.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[TensorSpec, ...]:
    specs = []
    for i in range(int(header[0])):
        base = 1 + i * (2 + _MAX_DIMS)
        ndim = int(header[base + 1])
        shape = tuple(int(d) for d in header[base + 2 : base + 2 + ndim])
        specs.append(TensorSpec(shape, _DTYPES[int(header[base])]))
    return tuple(specs)


_TWINS: dict[int, dist.ProcessGroup] = {}


def _world_twin() -> dist.ProcessGroup:
    key = id(dist.group.WORLD)
    if key not in _TWINS:
        _TWINS[key] = comm.new_group(range(dist.get_world_size()), "pipeline-header")
    return _TWINS[key]


class Transport:
    """Batched sends and receives between ranks of one pipeline group.

    Args:
        group: the pipeline-parallel process group (``None``: the default group).
        device: where received tensors are allocated.
        on_wait: called with (start, end) of every wait, for timelines.
        timeout: longest wait for one batch (default: the process group's timeout).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        on_wait=None,
        timeout: timedelta | None = None,
    ):
        self.group = group
        self.device = device
        self.on_wait = on_wait
        self.timeout = timeout
        # header sends not waited for yet (gloo), with the buffers they read
        self.header_sends: list[tuple[dist.Work, torch.Tensor]] = []

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a pipeline-group rank (what P2POp addresses, on any group)."""
        return dist.get_global_rank(self.group, group_rank) if self.group else group_rank

    @property
    def meta_group(self) -> dist.ProcessGroup:
        """A group over the same ranks with its own channels, for headers only.

        For a pipeline group smaller than the world that is the world group;
        when the pipeline is the whole world, a twin of it made once per process
        (every rank must reach :meth:`prepare` together for that).
        """
        if self.group is not None and dist.get_world_size(self.group) < dist.get_world_size():
            return dist.group.WORLD
        return _world_twin()

    def prepare(self) -> None:
        """Create what header negotiation needs; call on every pipeline rank together."""
        self.meta_group  # noqa: B018 (creates the twin group now, not mid-schedule)

    @functools.cached_property
    def backend(self) -> str | None:
        """The group's backend (``"gloo"``, ``"nccl"``, ...), ``None`` without torch.distributed."""
        if not dist.is_initialized():
            return None
        return dist.get_backend(self.group if self.group is not None else dist.group.WORLD)

    @property
    def posts_batches(self) -> bool:
        """Whether a step's messages go out as one ``batch_isend_irecv`` (one NCCL group).

        On NCCL a lone send posted while the peer is itself sending would deadlock, so
        both directions are posted in one group. gloo has no groups to form: each message
        is posted on its own, in the batch's order, which costs half of
        ``batch_isend_irecv``'s bookkeeping.
        """
        return self.backend != "gloo"

    @property
    def posts_receives_early(self) -> bool:
        """Whether the runner posts a step's receives while the step before it finishes.

        gloo writes a message only once its receiver has posted the receive (the receiver
        notifies the sender, then the data follows), so a receive posted just before it is
        needed puts that round trip on the critical path; posted a step early, the
        notification crosses while this rank computes. Sends and receives of either
        direction queue separately and posting never blocks, and receives on each channel
        keep their order, so FIFO matching is unchanged. On NCCL a lone receive would hold
        the pair's stream and block the sends posted after it, so receives stay in their
        step's batch there.
        """
        return self.backend == "gloo"

    @property
    def sends_report_completion(self) -> bool:
        """Whether a send's request says it is complete before anyone waits for it.

        A gloo send reports completion only once waited for, so there the runner learns
        that a send is done from the plan
        (:func:`~megapp.pipeline_parallel.messages.delivered_sends`), not by polling it.
        """
        return self.backend != "gloo"

    def post(
        self,
        sends: Sequence[tuple[int, Sequence[torch.Tensor]]],
        recvs: Sequence[tuple[int, Sequence[TensorSpec]]],
        group: dist.ProcessGroup | None = None,
    ) -> Posted:
        """Post sends of each ``(peer, tensors)`` and receives of each ``(peer, specs)`` as
        one batch (see :attr:`posts_batches`), in that order; peers are ranks within the
        pipeline group."""
        group = group or self.group
        ops, received = [], []
        for peer, tensors in sends:
            ops += [dist.P2POp(dist.isend, t, self.global_rank(peer), group) for t in tensors]
        num_sends = len(ops)
        for peer, specs in recvs:
            buffers = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
            ops += [dist.P2POp(dist.irecv, b, self.global_rank(peer), group) for b in buffers]
            received.append(buffers)
        if not ops:
            requests = []
        elif self.posts_batches:
            requests = dist.batch_isend_irecv(ops)
        else:  # one by one, in this order
            requests = [op.op(op.tensor, op.peer, op.group) for op in ops]
        per_send, start = [], 0
        for _, tensors in sends:
            per_send.append(requests[start : start + len(tensors)])
            start += len(tensors)
        return Posted(received, per_send, requests[num_sends:])

    def exchange(
        self,
        sends: Sequence[tuple[int, Sequence[torch.Tensor]]],
        recvs: Sequence[tuple[int, Sequence[TensorSpec]]],
        group: dist.ProcessGroup | None = None,
    ) -> list[list[torch.Tensor]]:
        """:meth:`post` one batch and wait for all of it; returns the received tensors, one
        list per entry of ``recvs``."""
        posted = self.post(sends, recvs, group)
        self.timed_wait([r for requests in posted.sends for r in requests] + posted.recvs)
        return posted.received

    def timed_wait(self, requests: Sequence[dist.Work]) -> None:
        """:meth:`wait`, reported to ``on_wait`` as one wait of the timeline."""
        if not requests:
            return
        start = time.perf_counter()
        self.wait(requests)
        if self.on_wait is not None:
            self.on_wait(start, time.perf_counter())

    def wait(self, requests: Sequence[dist.Work]) -> None:
        for request in requests:
            if self.timeout is None:
                request.wait()
            else:
                request.wait(self.timeout)

    def exchange_headers(
        self, sends: Sequence[tuple[int, Sequence[TensorSpec]]], recv_peers: Sequence[int]
    ) -> list[tuple[TensorSpec, ...]]:
        """Negotiate activation shapes: one header per send, one per receive.

        Only the receives are waited for where sends finish in the background (gloo), as
        for the data, so negotiating shapes adds no wait for a peer that is not there
        yet; :meth:`finish_headers` waits for the sends at the end of the iteration.
        """
        headers = [(peer, [encode_header(specs).to(self.device)]) for peer, specs in sends]
        template = [TensorSpec((_HEADER_LEN,), torch.int64)]
        recvs = [(p, template) for p in recv_peers]
        if self.posts_batches:
            received = self.exchange(headers, recvs, self.meta_group)
        else:
            posted = self.post(headers, recvs, self.meta_group)
            for (_, buffers), requests in zip(headers, posted.sends, strict=True):
                self.header_sends += [(r, buffers[0]) for r in requests]
            self.timed_wait(posted.recvs)
            received = posted.received
        return [decode_header(buffers[0].cpu()) for buffers in received]

    def finish_headers(self) -> None:
        """Wait for the header sends still in flight."""
        pending, self.header_sends = self.header_sends, []
        self.wait([request for request, _ in pending])


Specs = tuple[TensorSpec, ...]


def peer_of(message: Message, pp_rank: int) -> int:
    """The pipeline rank at the other end of ``message`` from ``pp_rank``."""
    return message.dst if message.src == pp_rank else message.src


class ActivationShapes:
    """The shapes of one pipeline rank's receives during one iteration.

    Args:
        transport: exchanges the headers when no shapes are declared.
        pp_rank: this rank in the pipeline group.
        declared: the shapes and dtypes every stage sends, or ``None`` to negotiate
            them per message.
    """

    def __init__(
        self, transport: Transport, pp_rank: int, declared: Sequence[TensorSpec] | None
    ) -> None:
        self.transport = transport
        self.pp_rank = pp_rank
        self.declared: Specs | None = None if declared is None else tuple(declared)
        # What each (microbatch, virtual stage) sent forward: its gradient comes back alike.
        self.sent: dict[tuple[int, int], Specs] = {}

    def record_sent(self, microbatch: int, stage: int, outputs: Sequence[torch.Tensor]) -> None:
        """Note the ``outputs`` virtual ``stage`` sends forward for ``microbatch``; raises
        ValueError if they differ from the declared shapes."""
        specs = specs_of(outputs)
        if self.declared is not None and specs != self.declared:
            raise ValueError(
                f"stage {stage} produced {[(s.shape, s.dtype) for s in specs]} but tensor_shapes "
                f"declares {[(s.shape, s.dtype) for s in self.declared]}; fix the declared "
                "shapes or pass tensor_shapes=None to negotiate them"
            )
        self.sent[(microbatch, stage)] = specs

    def gradient(self, message: Message) -> Specs | None:
        """Shapes of the gradient ``message`` carries back to this rank (``None`` before the
        forward it belongs to has run)."""
        sent = self.sent.get((message.microbatch, message.dst_stage))
        return None if sent is None else tuple(s for s in sent if s.dtype.is_floating_point)

    def for_step(self, step: Step, sending: Sequence[Sequence[torch.Tensor]]) -> list[Specs]:
        """Shapes of each of ``step``'s receives. Without declared shapes this first exchanges
        the headers of the step's activations, sent (``sending``: the tensors of each of
        ``step.sends``) and received, in one batch."""
        activations = [m for m in step.recvs if m.op is Op.FORWARD]
        negotiated: Sequence[Specs] = ()
        if self.declared is not None:
            negotiated = [self.declared] * len(activations)
        else:
            headers = [
                (peer_of(m, self.pp_rank), specs_of(tensors))
                for m, tensors in zip(step.sends, sending, strict=True)
                if m.op is Op.FORWARD
            ]
            if headers or activations:
                peers = [peer_of(m, self.pp_rank) for m in activations]
                negotiated = self.transport.exchange_headers(headers, peers)
        forwards = iter(negotiated)
        return [next(forwards) if m.op is Op.FORWARD else self.gradient(m) for m in step.recvs]

    def ahead(self, step: Step) -> list[Specs] | None:
        """Shapes of ``step``'s receives if they are known now without negotiating, else
        ``None``: gradients once their forward has run, activations when declared."""
        specs = []
        for message in step.recvs:
            known = self.declared if message.op is Op.FORWARD else self.gradient(message)
            if known is None:
                return None
            specs.append(known)
        return specs
