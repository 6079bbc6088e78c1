"""Point-to-point transport between pipeline ranks.

A :class:`Transport` posts one step's sends and receives in the order the plan
gives, each message on its own, so every channel stays FIFO-consistent. The
runner waits for the receives and lets the sends finish in the background; it
posts a step's receives one step early and learns that a send is done from the
plan, or where sends report completion (NCCL), from the send
(:attr:`Transport.sends_report_completion`). On gloo the messages travel over
the pipeline group; on NCCL, and on gloo under NCCL's rules (``strict``), over
one group per direction of each pair of ranks
(:mod:`~megapp.pipeline_parallel.channels`), which is what keeps every schedule
free of deadlocks there (``docs/pipeline.md``, "Point-to-point rules").
Activation shapes are either declared up front or negotiated: each activation
is preceded by a small header (number of tensors, dtypes, shapes) on a group of
its own over the same ranks, so headers never interleave with data on one
channel.

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
from megapp.pipeline_parallel import strict_p2p
from megapp.pipeline_parallel.channels import Channels
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
    """Sends and receives between the ranks of one pipeline group, each posted on its own.

    Every message goes out alone, in the order the plan gives, and only receives are
    waited for: a rank's sends finish in the background. Where the messages travel:

    - on gloo, over the pipeline group (``channels`` None): gloo has no streams, every
      message meets its peer on its own;
    - on NCCL, and on gloo given :class:`Channels` (under NCCL's rules if they are
      ``strict``), over them: one
      group per direction of each pair of ranks, so on every NCCL stream the operations
      of one direction queue in the order both ranks post them and none waits behind a
      message going the other way. Strict channels run every group's operations one at
      a time in posting order (:mod:`~megapp.pipeline_parallel.strict_p2p`), as NCCL does.

    Args:
        group: the pipeline-parallel process group (``None``: the default group).
        device: where received tensors are allocated.
        on_wait: called with (start, end) of every wait, for timelines.
        timeout: longest wait for one message (default: the process group's timeout).
        channels: the pipeline's one-way groups, needed on NCCL; with ``channels.strict``,
            gloo orders each group's operations as NCCL does.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        on_wait=None,
        timeout: timedelta | None = None,
        *,
        channels: Channels | None = None,
    ):
        self.group = group
        self.device = device
        self.on_wait = on_wait
        self.timeout = timeout
        self.channels = channels
        self.strict = channels is not None and channels.strict
        if channels is None and self.backend == "nccl" and self.size > 1:
            raise ValueError(
                "on NCCL pipeline messages travel over one group per direction of each pair "
                "of ranks: pass channels=make_channels(...) (megapp.pipeline_parallel."
                "channels), as initialize_model_parallel() does on NCCL"
            )
        # header sends not waited for yet, with the buffers they read
        self.header_sends: list[tuple[dist.Work, torch.Tensor]] = []

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a pipeline-group rank (what P2POp addresses, on any group)."""
        return dist.get_global_rank(self.group, group_rank) if self.group else group_rank

    @property
    def meta_group(self) -> dist.ProcessGroup:
        """Without channels, a group over the same ranks with its own channels, for
        headers only.

        For a pipeline group smaller than the world that is the world group;
        when the pipeline is the whole world, a twin of it made once per process
        (every rank must reach :meth:`prepare` together for that).
        """
        if self.group is not None and dist.get_world_size(self.group) < dist.get_world_size():
            return dist.group.WORLD
        return _world_twin()

    def prepare(self) -> None:
        """Create what header negotiation needs; call on every pipeline rank together."""
        if self.channels is None:
            self.meta_group  # noqa: B018 (creates the twin group now, not mid-schedule)

    @property
    def size(self) -> int:
        """Ranks in the pipeline group (1 without torch.distributed: no message to send)."""
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(self.group if self.group is not None else dist.group.WORLD)

    @functools.cached_property
    def backend(self) -> str | None:
        """The group's backend (``"gloo"``, ``"nccl"``, ...), ``None`` without torch.distributed."""
        if not dist.is_initialized():
            return None
        return dist.get_backend(self.group if self.group is not None else dist.group.WORLD)

    @property
    def sends_report_completion(self) -> bool:
        """Whether a send's request says it is complete before anyone waits for it.

        A gloo send reports completion only once waited for, so there the runner learns
        that a send is done from the plan
        (:func:`~megapp.pipeline_parallel.messages.delivered_sends`), not by polling it.
        """
        return self.backend != "gloo" or self.strict

    def _group(self, src: int, dst: int, header: bool) -> dist.ProcessGroup | None:
        """The group carrying a message from global rank ``src`` to ``dst``."""
        if self.channels is not None:
            return self.channels.group(src, dst, header=header)
        return self.meta_group if header else self.group

    def post(
        self,
        sends: Sequence[tuple[int, Sequence[torch.Tensor]]],
        recvs: Sequence[tuple[int, Sequence[TensorSpec]]],
        *,
        header: bool = False,
    ) -> Posted:
        """Post sends of each ``(peer, tensors)`` and receives of each ``(peer, specs)``,
        each on its own, in that order; peers are ranks within the pipeline group.
        ``header``: these are shape headers, on the headers' groups."""
        me = dist.get_rank()
        ops, received = [], []
        for peer, tensors in sends:
            to = self.global_rank(peer)
            group = self._group(me, to, header)
            ops += [dist.P2POp(dist.isend, t, to, group) for t in tensors]
        num_sends = len(ops)
        for peer, specs in recvs:
            src = self.global_rank(peer)
            group = self._group(src, me, header)
            buffers = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
            ops += [dist.P2POp(dist.irecv, b, src, group) for b in buffers]
            received.append(buffers)
        if self.strict:
            requests = strict_p2p.post(ops)
        else:
            requests = [op.op(op.tensor, op.peer, op.group) for op in ops]
        per_send, start = [], 0
        for _, tensors in sends:
            per_send.append(requests[start : start + len(tensors)])
            start += len(tensors)
        return Posted(received, per_send, requests[num_sends:])

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

        Only the receives are waited for, as for the data, so negotiating shapes adds no
        wait for a peer that is not there yet; :meth:`finish_headers` waits for the sends
        at the end of the iteration.
        """
        headers = [(peer, [encode_header(specs).to(self.device)]) for peer, specs in sends]
        template = [TensorSpec((_HEADER_LEN,), torch.int64)]
        posted = self.post(headers, [(p, template) for p in recv_peers], header=True)
        for (_, buffers), requests in zip(headers, posted.sends, strict=True):
            self.header_sends += [(r, buffers[0]) for r in requests]
        self.timed_wait(posted.recvs)
        return [decode_header(buffers[0].cpu()) for buffers in posted.received]

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
