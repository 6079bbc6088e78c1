"""What a pipeline rank's receives hold: shapes declared up front or negotiated per step.

An activation has the shapes given as ``tensor_shapes`` or, without them, those
announced by the headers exchanged just before each step's data
(:meth:`~megapp.pipeline_parallel.p2p.Transport.exchange_headers`). A gradient
has the shapes of the floating-point tensors this rank sent forward for the same
microbatch, so it never needs a header.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megapp.pipeline_parallel.messages import Message, Step
from megapp.pipeline_parallel.p2p import TensorSpec, Transport, specs_of
from megapp.pipeline_parallel.schedules import Op

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
