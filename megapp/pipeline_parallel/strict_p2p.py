"""gloo under NCCL's point-to-point rules, to prove on CPU what must hold on GPUs.

On NCCL a communicator runs one rank's operations in posting order on one stream: each
starts when the one before it has completed, and a send completes only once its receive
runs. gloo queues nothing: each message meets its peer on its own, so a posting order
that stalls on NCCL runs on gloo. Under :func:`post`, every operation on a process group
goes to a thread of its own for that group (its "stream") that runs the group's
operations one at a time, posting each and waiting until it has met its peer (a gloo
send completes only once its receive is posted), so on gloo a rank's operations on a
group are ordered exactly as NCCL orders them. The engine posts through here under
``--strict-p2p`` (:class:`~megapp.pipeline_parallel.p2p.Transport`); a plan that would
deadlock on NCCL then deadlocks on CPU too, and the transport's timeout reports it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import torch.distributed as dist

__all__ = ["StreamWork", "post"]


class StreamWork:
    """A request posted on a stream: :meth:`wait` blocks until it has met its peer."""

    def __init__(self, future: Future, what: str):
        self.future, self.what = future, what

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        try:
            self.future.result(seconds)
        except FutureTimeout:
            raise RuntimeError(
                f"{self.what} did not complete within {seconds:g} s: it waits for its peer "
                "or behind an earlier operation on the same communicator"
            ) from None
        return True

    def is_completed(self) -> bool:
        return self.future.done()


class _Stream:
    """One group's operations of this process, run one at a time in posting order."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], None]) -> Future:
        future: Future = Future()
        self.jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                job()
            except BaseException as err:
                future.set_exception(err)
            else:
                future.set_result(None)


_STREAMS: dict[int, _Stream] = {}
_LOCK = threading.Lock()


def _stream(group: dist.ProcessGroup) -> _Stream:
    with _LOCK:
        if id(group) not in _STREAMS:
            _STREAMS[id(group)] = _Stream(f"megapp-strict-p2p-{id(group):x}")
        return _STREAMS[id(group)]


def post(ops: Sequence[dist.P2POp]) -> list[StreamWork]:
    """Post ``ops`` as NCCL would run them, each on its group's stream after everything
    posted there before. Returns one request per op."""
    return [
        StreamWork(_stream(op.group).submit(lambda op=op: _run(op)), _describe(op)) for op in ops
    ]


def _run(op: dist.P2POp) -> None:
    op.op(op.tensor, op.peer, op.group).wait()


def _describe(op: dist.P2POp) -> str:
    what = "send to" if op.op is dist.isend else "receive from"
    return f"the {what} rank {op.peer}"
