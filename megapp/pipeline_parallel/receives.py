"""Receives posted one step ahead of the step that needs them.

Where the transport asks for it (on gloo, where a receive posted just before it
is needed puts the receiver's "ready" round trip on the critical path; see
``Transport.posts_receives_early``), the runner posts the next step's receives
while finishing the current one. Only receives whose shapes are known a step
ahead go early: gradients whose forward has run, and activations when their
shapes are declared; negotiated activations wait for their headers.
"""

from __future__ import annotations

from megapp.pipeline_parallel.messages import Step
from megapp.pipeline_parallel.p2p import Posted, Transport
from megapp.pipeline_parallel.shapes import ActivationShapes, peer_of


class EarlyReceives:
    """The next step's receives, posted ahead of it.

    Args:
        transport: posts the receives; they go early only where it
            :attr:`~megapp.pipeline_parallel.p2p.Transport.posts_receives_early`.
        shapes: says which receives' shapes are known ahead.
        pp_rank: this rank in the pipeline group.
    """

    def __init__(self, transport: Transport, shapes: ActivationShapes, pp_rank: int) -> None:
        self.transport = transport
        self.shapes = shapes
        self.pp_rank = pp_rank
        self.enabled = transport.posts_receives_early
        self.posted: Posted | None = None

    def take(self) -> Posted | None:
        """The receives posted ahead for the step about to post its messages, or ``None``
        if that step's receives were not posted ahead; each posting is returned once."""
        posted, self.posted = self.posted, None
        return posted

    def post_ahead(self, upcoming: Step | None) -> None:
        """Post the receives of ``upcoming`` (the step after the current one) now, if this
        transport posts early and their shapes are known."""
        if not self.enabled or upcoming is None or not upcoming.recvs:
            return
        specs = self.shapes.ahead(upcoming)
        if specs is not None:
            peers = [peer_of(m, self.pp_rank) for m in upcoming.recvs]
            self.posted = self.transport.post([], list(zip(peers, specs, strict=True)))
