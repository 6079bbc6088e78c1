"""Sends in flight, and the freeing of their activations' storage once they are done.

A send is known to be done when the plan proves it delivered
(:func:`~megapp.pipeline_parallel.messages.delivered_sends`) or, where the transport's
sends report completion (NCCL, not gloo), as soon as it says so. Its requests are
then waited for (which returns at once) and the sent activations no backward
needs lose their storage
(:func:`~megapp.pipeline_parallel.activation_storage.drop_storage`), so the
activations a rank holds are bounded by the schedule, not by the microbatch count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megapp.pipeline_parallel.activation_storage import drop_storage
from megapp.pipeline_parallel.messages import Message
from megapp.pipeline_parallel.p2p import Transport


class InFlightSends:
    """The sends of one pipeline rank that are posted but not yet known to be done.

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
        done = list(delivered)
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
