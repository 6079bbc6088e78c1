"""Ring attention: keys and values travel around the context-parallel ranks.

Every cp rank keeps its queries and, in ``cp`` steps, sees every rank's keys and
values: at step ``t`` rank ``i`` holds those of rank ``(i − t) mod cp``, sends them
to rank ``i + 1`` and receives the next from rank ``i − 1``, the transfer posted
before the step's attention so that the two overlap. Partial results over
different keys are combined exactly by their log-sum-exp
(:func:`~megapp.context_parallel.blocks.merge_into`), and each step attends in
one fused block or in materialized tiles of half a slice on a side
(:func:`~megapp.context_parallel.blocks.forward_in_tiles`).

Causal, with the load-balanced layout (rank ``i`` holds chunks ``i`` and
``2cp − 1 − i``), each step is a lower triangle or half a square, never an idle
rank:

- step 0, the rank's own keys: causal attention of both query chunks;
- keys of a rank ``j < i``: both query chunks see the first key chunk (chunk ``j``)
  whole and never the second;
- keys of a rank ``j > i``: only the second query chunk sees them, both key chunks
  whole.

The backward (an exact autograd Function) sends the keys and values around
the ring again, and with them an accumulator of their gradients: each rank adds
its share of dK/dV for the keys it holds and passes the sum on, so after ``cp``
hops every rank's accumulator is back home, complete. The next keys' transfer
overlaps a step's compute and the accumulator's transfer overlaps the next step's.

Tensors are ``[b, heads, s/cp, d]`` (keys and values ``[b, kv_heads, s/cp, d]``);
keys and values travel as one ``[2, b, kv_heads, s/cp, d]`` message, unexpanded.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megapp import comm
from megapp.comm import Group
from megapp.context_parallel import blocks

__all__ = ["ring_attention"]


class _Shift:
    """Send a tensor to the next rank of the ring and receive one from the previous."""

    def __init__(self, group: Group):
        cp, me = comm.world_size(group), comm.rank(group)
        self.group = group
        self.next = dist.get_global_rank(group, (me + 1) % cp)
        self.prev = dist.get_global_rank(group, (me - 1) % cp)

    def start(self, send: torch.Tensor) -> _InFlight:
        received = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, group=self.group),
            dist.P2POp(dist.irecv, received, self.prev, group=self.group),
        ]
        started = time.monotonic()
        works = dist.batch_isend_irecv(ops)
        pending = [comm.Pending(w, "ring send/receive", self.group, started) for w in works]
        return _InFlight(send, received, pending)


class _InFlight:
    """A posted shift; :meth:`wait` returns the received tensor once both sides are done
    (the sent tensor is kept alive until then)."""

    def __init__(self, sent: torch.Tensor, received: torch.Tensor, pending: list[comm.Pending]):
        self.sent, self.received, self.pending = sent, received, pending

    def wait(self) -> torch.Tensor:
        for p in self.pending:
            p.wait()
        self.sent = None
        return self.received


def _block(step: int, me: int, cp: int, causal: bool, length: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend to which of the held keys at ``step``, and whether
    that block is causal (see the module docstring)."""
    everything = slice(None)
    if step == 0 or not causal:
        return everything, everything, causal
    first, second = slice(None, length // 2), slice(length // 2, None)
    if (me - step) % cp < me:  # an earlier rank's keys: their first chunk, for every query
        return everything, first, False
    return second, everything, False  # a later rank's: all of them, for the second chunk


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        cp, me = comm.world_size(group), comm.rank(group)
        ring = _Shift(group)
        kv = torch.stack([k, v])
        dtype, tile = blocks.compute_dtype(q.dtype), q.shape[2] // 2
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
        for step in range(cp):
            incoming = ring.start(kv) if step + 1 < cp else None
            rows, keys, block_causal = _block(step, me, cp, causal, q.shape[2])
            # step 0 gives every query row its first keys; later steps merge into them
            blocks.forward_in_tiles(
                q[..., rows, :], kv[..., keys, :], scale, block_causal, tile,
                out[..., rows, :], lse[..., rows], merge=step > 0,
            )  # fmt: skip
            if incoming is not None:
                kv = incoming.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, me = comm.world_size(group), comm.rank(group)
        ring = _Shift(group)
        dtype = blocks.compute_dtype(q.dtype)
        grad_out, out = grad_out.to(dtype), out.to(dtype)
        grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
        kv, tile = torch.stack([k, v]), q.shape[2] // 2
        accumulator = None  # the gradient of the keys held last step, on its way here
        for step in range(cp):
            incoming = ring.start(kv) if step + 1 < cp else None
            rows, keys, block_causal = _block(step, me, cp, causal, q.shape[2])
            grad_kv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
            blocks.backward_in_tiles(
                q[..., rows, :], kv[..., keys, :], grad_out[..., rows, :], out[..., rows, :],
                lse[..., rows], scale, block_causal, tile, grad_q[..., rows, :],
                grad_kv[..., keys, :],
            )  # fmt: skip
            if accumulator is not None:
                grad_kv += accumulator.wait()
            # On to the keys' next holder; the last hop brings each rank its own, complete.
            accumulator = ring.start(grad_kv)
            if incoming is not None:
                kv = incoming.wait()
        grad_kv = accumulator.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Attention of this cp rank's queries ``[b, heads, s/cp, d]`` over the whole sequence's
    keys and values (``[b, kv_heads, s/cp, d]`` here), sending them around ``group``;
    returns ``[b, heads, s/cp, d]``. Inputs are checked by
    :func:`megapp.context_parallel.attention`."""
    if comm.world_size(group) == 1:
        return blocks.attend(q, k, v, scale, causal)
    return _RingAttention.apply(q, k, v, group, causal, scale)
