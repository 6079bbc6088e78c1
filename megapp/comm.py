"""Collectives and process-group helpers that every layer of megapp uses.

- Groups are created by :func:`new_group` with a name (``"tensor-parallel"``, ...) and the
  job's timeout, so a collective that waits on a dead or stuck rank fails within that
  timeout instead of torch's 30-minute default.
- Every collective here names what failed: a torch error (a timeout, a peer that closed its
  connection) is re-raised as :class:`CollectiveError` saying which operation over which
  group, after how long. Asynchronous ones return a :class:`Pending` whose ``wait`` does
  the same.
- ``None`` as a group means "no such parallelism" (one rank): sizes are 1, ranks 0 and
  the collectives are never called.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None

_blocked = [0.0]  # seconds this process has spent in blocking collectives and waits


def blocked_seconds() -> float:
    """Seconds this process has spent so far inside a collective of this module: a blocking
    call, or a :meth:`Pending.wait` (the communication time a profile reports)."""
    return _blocked[0]


__all__ = [
    "CollectiveError",
    "Group",
    "Pending",
    "all_gather_into",
    "all_reduce",
    "all_to_all_into",
    "barrier",
    "blocked_seconds",
    "broadcast_object",
    "default_timeout",
    "describe",
    "new_group",
    "one_line",
    "rank",
    "reduce_scatter_into",
    "ring_shift",
    "world_size",
]


def world_size(group: Group) -> int:
    """Ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def rank(group: Group) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def default_timeout() -> timedelta | None:
    """The default group's timeout, where torch lets it be read (gloo and NCCL do); None
    leaves torch's own default to a new group."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def new_group(
    ranks: Sequence[int], name: str, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` named ``name`` (errors and NCCL's watchdog say it) with
    ``timeout`` (default: the default group's, i.e. the job's). Collective over the
    default group: every rank calls it for every group, in the same order."""
    timeout = timeout if timeout is not None else default_timeout()
    return dist.new_group(list(ranks), timeout=timeout, group_desc=name)


def describe(group: Group) -> str:
    """``"the data-parallel group (ranks 0, 2)"``: what an error message calls ``group``."""
    if group is None or group is dist.group.WORLD:
        return f"the default group (all {dist.get_world_size()} ranks)"
    name = getattr(group, "group_desc", None) or "process"
    if name == "undefined":
        name = "process"
    ranks = ", ".join(str(r) for r in dist.get_process_group_ranks(group))
    return f"the {name} group (ranks {ranks})"


class CollectiveError(RuntimeError):
    """A collective that failed or timed out; the message names the operation and group."""


def one_line(error: BaseException, limit: int = 400) -> str:
    """``error``'s message on one line, at most ``limit`` characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failed(op: str, group: Group, started: float, error: Exception) -> CollectiveError:
    return CollectiveError(
        f"rank {dist.get_rank()}: {op} over {describe(group)} failed after "
        f"{time.monotonic() - started:.1f} s ({one_line(error)}). A rank of that group may "
        "have died or be stuck; look at its log first."
    )


class Pending:
    """An asynchronous collective in flight; :meth:`wait` raises :class:`CollectiveError`."""

    __slots__ = ("group", "op", "started", "work")

    def __init__(self, work: dist.Work, op: str, group: Group, started: float):
        self.work, self.op, self.group, self.started = work, op, group, started

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as error:
            raise _failed(self.op, self.group, self.started, error) from error
        finally:
            _blocked[0] += time.perf_counter() - started

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _run(what: str, group: Group, async_op: bool, call, *args: Any, **kwargs: Any):
    started, clock = time.monotonic(), time.perf_counter()
    try:
        work = call(*args, group=group, async_op=async_op, **kwargs)
    except RuntimeError as error:
        raise _failed(what, group, started, error) from error
    finally:
        _blocked[0] += time.perf_counter() - clock
    return Pending(work, what, group, started) if async_op else None


def _op_name(op: dist.ReduceOp) -> str:
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()


def all_reduce(
    x: torch.Tensor,
    group: Group,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Pending | None:
    """Reduce ``x`` in place over ``group``."""
    what = "all-reduce" if op == dist.ReduceOp.SUM else f"all-reduce ({_op_name(op)})"
    return _run(what, group, async_op, dist.all_reduce, x, op=op)


def all_gather_into(
    out: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False
) -> Pending | None:
    """Concatenate every rank's ``x`` along dimension 0 into ``out``."""
    # torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have the old
    # names. Looked up at call time, so wrappers installed on torch.distributed see them.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _run("all-gather", group, async_op, fn, out, x)


def reduce_scatter_into(
    out: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False
) -> Pending | None:
    """Sum ``x`` over ``group`` and leave this rank its slice (dimension 0) in ``out``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _run("reduce-scatter", group, async_op, fn, out, x)


def ring_shift(send: torch.Tensor, recv: torch.Tensor, group: Group) -> list[Pending]:
    """Send ``send`` to the next rank of ``group`` (in its rank order, the last to the
    first) and receive the previous rank's into ``recv``, both in flight: wait on every
    returned one before touching either tensor."""
    n, me = world_size(group), rank(group)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r % n) if group is not None else r % n

    ops = [
        dist.P2POp(dist.isend, send, peer(me + 1), group),
        dist.P2POp(dist.irecv, recv, peer(me - 1), group),
    ]
    started, clock = time.monotonic(), time.perf_counter()
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as error:
        raise _failed("ring send/receive", group, started, error) from error
    finally:
        _blocked[0] += time.perf_counter() - clock
    return [Pending(work, "ring send/receive", group, started) for work in works]


def all_to_all_into(
    out: torch.Tensor, x: torch.Tensor, group: Group, async_op: bool = False
) -> Pending | None:
    """Send ``x``'s i-th slice (dimension 0, in equal slices) to rank i of ``group`` and put
    rank i's slice for this rank at ``out``'s i-th slice."""
    return _run("all-to-all", group, async_op, dist.all_to_all_single, out, x)


def all_to_all_split(
    out: torch.Tensor,
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: Group,
    async_op: bool = False,
) -> Pending | None:
    """Send ``x``'s i-th slice of ``in_splits[i]`` rows (dimension 0) to rank i of
    ``group`` and put rank i's ``out_splits[i]`` rows for this rank at ``out``'s i-th
    slice: an all-to-all of uneven slices, each rank's sizes agreed beforehand."""
    return _run(
        "all-to-all", group, async_op, dist.all_to_all_single, out, x,
        output_split_sizes=out_splits, input_split_sizes=in_splits,
    )  # fmt: skip


def barrier(group: Group = None) -> None:
    """Wait until every rank of ``group`` (default: all) arrives."""
    _run("barrier", group, False, dist.barrier)


def broadcast_object(value: Any, src: int = 0, group: Group = None) -> Any:
    """``value`` of global rank ``src``, on every rank of ``group`` (picklable objects only;
    use between ranks of one job, never on data read from elsewhere)."""
    box = [value]
    started = time.monotonic()
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    except RuntimeError as error:
        raise _failed("broadcast", group, started, error) from error
    return box[0]


def all_gather_object(value: Any, group: Group = None) -> list[Any]:
    """Every rank's ``value`` of ``group``, in rank order (picklable objects; between ranks of
    one job only)."""
    out: list[Any] = [None] * world_size(group)
    started = time.monotonic()
    try:
        dist.all_gather_object(out, value, group=group)
    except RuntimeError as error:
        raise _failed("all-gather (objects)", group, started, error) from error
    return out


def gather_object(value: Any, group: Group = None) -> list[Any] | None:
    """Every rank's ``value`` on the group's first rank (in rank order), None elsewhere
    (picklable objects; between ranks of one job only)."""
    first = 0 if group is None else dist.get_global_rank(group, 0)
    out: list[Any] | None = [None] * world_size(group) if dist.get_rank() == first else None
    started = time.monotonic()
    try:
        dist.gather_object(value, out, dst=first, group=group)
    except RuntimeError as error:
        raise _failed("gather (objects)", group, started, error) from error
    return out
