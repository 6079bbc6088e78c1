"""Attention of one block of queries against one block of keys.

Every context-parallel mechanism ends in the same arithmetic: softmax(q kᵀ · scale) v
over some keys, in float32 (float64 stays float64). Tensors are ``[b, heads, s, d]``
as megapp's attention lays them out; keys and values may have fewer heads
(grouped-query attention), key/value head ``j`` serving query heads
``j·r … j·r + r − 1`` with ``r = heads / kv_heads``, as ``repeat_interleave`` makes them.

A causal block is aligned at its bottom-right corner: the last query sits at the
last key's position, so query ``i`` of ``sq`` sees keys ``0 … i + sk − sq``. With
``sq == sk`` that is the usual lower triangle.

A block runs in one of two ways (``fused``, by default :func:`fused_kernel` of its device):

- **fused**: torch's flash-attention kernel for the CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), which returns
  the log-sum-exp with the output and rebuilds the probabilities from it in its backward,
  never holding more than its own small tiles of scores; a causal block must be square
  (the kernel aligns its mask at the top-left corner, which is the bottom-right one only
  for a square);
- **materialized**: in plain PyTorch, the block's scores materialized and passed over
  elementwise, on any device; :func:`forward_in_tiles` then cuts a block into tiles of
  at most ``block × block`` scores to bound them.

- :func:`attend`: differentiable through autograd (saves the probabilities).
- :func:`attend_in_tiles`: the same result, computed block by block with an exact backward
  that keeps only q, k, v, the output and the log-sum-exp: memory linear in the sequence,
  as a fused attention kernel's.
- :func:`forward_with_lse` / :func:`backward_from_lse`: the two halves of an exact
  blockwise attention (flash-attention's recurrence). The forward returns each query
  row's log-sum-exp so that blocks over disjoint keys combine with :func:`merge_into`;
  the backward rebuilds the probabilities of a block from the final log-sum-exp.
"""

from __future__ import annotations

import torch

__all__ = [
    "attend",
    "attend_in_tiles",
    "backward_from_lse",
    "backward_in_tiles",
    "compute_dtype",
    "expand_kv",
    "forward_in_tiles",
    "forward_with_lse",
    "fused_kernel",
    "merge_into",
]

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, the input's own type for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, kv_heads, s, d]`` -> ``[b, heads, s, d]``: each key/value head repeated for the
    query heads it serves."""
    repeat = heads // x.shape[1]
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _reduce_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Transpose of :func:`expand_kv`: sum each key/value head's query-head gradients."""
    b, heads, s, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, s, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = q.matmul(k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v, in the compute dtype, returned in q's dtype;
    differentiable. q ``[b, heads, sq, d]``, k and v ``[b, kv_heads, sk, d]``."""
    dtype = compute_dtype(q.dtype)
    heads = q.shape[1]
    k, v = (expand_kv(t.to(dtype), heads) for t in (k, v))
    probs = _scores(q.to(dtype), k, scale, causal).softmax(dim=-1)
    return probs.matmul(v).to(q.dtype)


def fused_kernel(device: torch.device) -> bool:
    """Whether blocks on ``device`` run fused by default: on a CPU, where torch's
    flash-attention kernel takes and returns the log-sum-exp; elsewhere materialized."""
    return device.type == "cpu"


def _runs_fused(fused: bool | None, q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """``fused``, or the device's default where None; a fused causal block must be square."""
    fused = fused_kernel(q.device) if fused is None else fused
    if fused and causal and q.shape[-2] != k.shape[-2]:
        sq, sk = q.shape[-2], k.shape[-2]
        raise ValueError(f"a fused causal block must be square, got {sq} queries and {sk} keys")
    return fused


def forward_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output ``[b, heads, sq, d]`` and log-sum-exp ``[b, heads, sq]``, both in the
    compute dtype. Every query row must see at least one key (true of every block the
    context-parallel mechanisms compute). ``fused``: as the module docstring says (None:
    :func:`fused_kernel` of q's device)."""
    dtype = compute_dtype(q.dtype)
    k, v = (expand_kv(t.to(dtype), q.shape[1]) for t in (k, v))
    if _runs_fused(fused, q, k, causal):
        return _FLASH_CPU(q.to(dtype), k, v, 0.0, causal, scale=scale)
    scores = _scores(q.to(dtype), k, scale, causal)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp().matmul(v)
    return out, lse


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold a block over further keys into the running ``out``/``lse`` (views allowed), in
    place: each side weighted by its share of the softmax denominator."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_((lse - total).exp().unsqueeze(-1))
    out.add_(block_out * (block_lse - total).exp().unsqueeze(-1))
    lse.copy_(total)


def backward_from_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv (compute dtype; dk and dv with k's heads).

    ``out`` ``[b, heads, sq, d]`` and ``lse`` ``[b, heads, sq]`` are the final output and
    log-sum-exp of these query rows over all keys (compute dtype), so the block's
    probabilities and the softmax's backward (through ``rowsum(grad_out · out)``) are
    exact without the other blocks. ``fused`` as :func:`forward_with_lse` takes it.
    """
    dtype = compute_dtype(q.dtype)
    kv_heads, heads = k.shape[1], q.shape[1]
    q, grad_out = q.to(dtype), grad_out.to(dtype)
    k, v = (expand_kv(t.to(dtype), heads) for t in (k, v))
    if _runs_fused(fused, q, k, causal):
        grad_q, grad_k, grad_v = _FLASH_CPU_BACKWARD(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return grad_q, _reduce_kv(grad_k, kv_heads), _reduce_kv(grad_v, kv_heads)
    delta = (grad_out * out).sum(dim=-1)
    probs = (_scores(q, k, scale, causal) - lse.unsqueeze(-1)).exp()
    grad_v = probs.transpose(-1, -2).matmul(grad_out)
    grad_probs = grad_out.matmul(v.transpose(-1, -2))
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale
    grad_q = grad_scores.matmul(k)
    grad_k = grad_scores.transpose(-1, -2).matmul(q)
    return grad_q, _reduce_kv(grad_k, kv_heads), _reduce_kv(grad_v, kv_heads)


def _tiles(
    sq: int, key_ends: tuple[int, ...], causal: bool, block: int
) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """The tiles that cover what ``sq`` queries see of their keys, the queries cut into
    ``len(key_ends)`` equal segments, segment ``m`` seeing keys ``[0, key_ends[m])`` with,
    causal, the diagonal at its bottom-right corner: for every block of at most ``block``
    query rows, its key blocks and whether each is causal. Causal, rows ``[i, j)`` of a
    segment of ``L`` rows and ``e`` keys see the keys before ``i + e − L`` whole, in blocks
    of ``block``, and the square ``[i + e − L, j + e − L)`` as a lower triangle; every tile
    gives each of its rows at least one key."""
    length = sq // len(key_ends)
    out = []
    for m, sk in enumerate(key_ends):
        if causal and sk < length:
            raise ValueError(f"causal attention needs as many keys as queries: {sk} < {length}")
        for i in range(0, length, block):
            j = min(i + block, length)
            end = i + sk - length if causal else sk  # the keys these rows all see whole
            keys = [(slice(lo, min(lo + block, end)), False) for lo in range(0, end, block)]
            if causal:
                keys.append((slice(end, j + sk - length), True))
            out.append((slice(m * length + i, m * length + j), keys))
    return out


def _way(q: torch.Tensor, kv: torch.Tensor, block: int, fused: bool | None) -> tuple[bool, int]:
    """Whether the blocks run fused (``fused``, or the device's default where None), and
    the tile side: ``block`` for materialized blocks; a fused kernel tiles by itself, so it
    takes each segment whole (its keys before the diagonal, then the diagonal)."""
    fused = fused_kernel(q.device) if fused is None else fused
    return fused, max(q.shape[2], kv.shape[3]) if fused else block


def forward_in_tiles(
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    causal: bool,
    block: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    merge: bool,
    key_ends: tuple[int, ...] | None = None,
    fused: bool | None = None,
) -> None:
    """Attend q ``[b, heads, sq, d]`` to ``kv[0]``/``kv[1]`` over the :func:`_tiles` of
    ``block`` (``key_ends`` as :func:`attend_in_tiles` takes them), into ``out`` and ``lse``
    (compute dtype, views allowed): written (``merge=False``) or merged with what they hold
    over other keys (:func:`merge_into`)."""
    ends = key_ends if key_ends is not None else (kv.shape[3],)
    fused, tile = _way(q, kv, block, fused)  # resolved once for all the blocks
    for rows, keys in _tiles(q.shape[2], ends, causal, tile):
        for n, (cols, diagonal) in enumerate(keys):
            part = forward_with_lse(
                q[..., rows, :], kv[0, ..., cols, :], kv[1, ..., cols, :], scale, diagonal,
                fused,
            )  # fmt: skip
            if n == 0 and not merge:
                out[..., rows, :], lse[..., rows] = part
            else:
                merge_into(out[..., rows, :], lse[..., rows], *part)


def backward_in_tiles(
    q: torch.Tensor,
    kv: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    block: int,
    grad_q: torch.Tensor,
    grad_kv: torch.Tensor,
    key_ends: tuple[int, ...] | None = None,
    fused: bool | None = None,
) -> None:
    """The backward of :func:`forward_in_tiles` from the final ``out`` and ``lse`` (see
    :func:`backward_from_lse`), added into ``grad_q`` and ``grad_kv`` (compute dtype, views
    allowed)."""
    ends = key_ends if key_ends is not None else (kv.shape[3],)
    fused, tile = _way(q, kv, block, fused)  # resolved once for all the blocks
    for rows, keys in _tiles(q.shape[2], ends, causal, tile):
        for cols, diagonal in keys:
            dq, dk, dv = backward_from_lse(
                q[..., rows, :],
                kv[0, ..., cols, :],
                kv[1, ..., cols, :],
                grad_out[..., rows, :],
                out[..., rows, :],
                lse[..., rows],
                scale,
                diagonal,
                fused,
            )
            grad_q[..., rows, :] += dq
            grad_kv[0, ..., cols, :] += dk
            grad_kv[1, ..., cols, :] += dv


class _InBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, scale, causal, block, key_ends, fused):
        dtype = compute_dtype(q.dtype)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
        forward_in_tiles(
            q, kv, scale, causal, block, out, lse, merge=False, key_ends=key_ends, fused=fused
        )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.scale, ctx.causal, ctx.block, ctx.key_ends = scale, causal, block, key_ends
        ctx.fused = fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        dtype = compute_dtype(q.dtype)
        grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
        grad_kv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        backward_in_tiles(
            q, kv, grad_out.to(dtype), out.to(dtype), lse, ctx.scale, ctx.causal, ctx.block,
            grad_q, grad_kv, ctx.key_ends, ctx.fused,
        )  # fmt: skip
        return grad_q.to(q.dtype), grad_kv.to(kv.dtype), None, None, None, None, None


def attend_in_tiles(
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    causal: bool,
    block: int,
    key_ends: tuple[int, ...] | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """:func:`attend`'s result for keys ``kv[0]`` and values ``kv[1]``, returned in q's
    dtype, computed block by block (fused, or materialized in tiles of ``block``: see the
    module docstring): its forward and backward never hold the whole square of scores, and
    it keeps q, the keys and values (unexpanded), the output and the log-sum-exp
    ``[b, heads, sq]`` (compute dtype) for the backward, never the probabilities. q
    ``[b, heads, sq, d]``, kv ``[2, b, kv_heads, sk, d]``. ``key_ends``: cut the queries
    into that many equal segments, each seeing the keys up to its end (default: one segment
    seeing all ``sk``)."""
    if block < 1:
        raise ValueError(f"attention block must be >= 1, got {block}")
    ends = tuple(key_ends) if key_ends is not None else (kv.shape[3],)
    if q.shape[2] % len(ends) or max(ends) > kv.shape[3]:
        raise ValueError(
            f"{q.shape[2]} queries cannot be cut into {len(ends)} equal segments seeing "
            f"keys up to {ends} of {kv.shape[3]}"
        )
    return _InBlocks.apply(q, kv, scale, causal, block, ends, fused)
