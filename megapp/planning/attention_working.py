"""What context-parallel attention has alive while it runs, beyond what its layer keeps:
the working bytes :mod:`megapp.planning.memory` adds to a layer's forward and backward
under ``--context-parallel-size``. Every mechanism of :mod:`megapp.context_parallel`
attends block by block (:func:`~megapp.context_parallel.blocks.forward_in_tiles`): on a
CPU in torch's fused kernel, whole blocks whose scores never exist outside it
(:func:`fused_attention_working_bytes`), elsewhere in tiles of materialized scores
(:func:`tiled_attention_working_bytes`); the count is that and the tensors each mechanism
moves or accumulates beside them (docs/planning.md, "Context parallelism")."""

from __future__ import annotations

from megapp.models.gpt import GPTConfig
from megapp.planning.activations import compute_width, qkv_elements


def attention_working_bytes(
    config: GPTConfig, seq_length: int, mbs: int, backward: bool, fused: bool = False
) -> int:
    """Bytes context-parallel attention's forward (or ``backward``) has alive at its peak
    beyond what the layer keeps, on one tensor- and context-parallel rank of
    ``seq_length`` = ``n`` = ``s/cp`` tokens (0 without context parallelism: the
    ``sdpa`` kernel works in tiles). ``fused``: the blocks run in the fused kernel (on a
    CPU, :func:`fused_attention_working_bytes`), else in materialized tiles of ``n/2`` on a
    side (:func:`tiled_attention_working_bytes`):

    - ``p2p``: the rank's ``n`` queries against the ``n`` keys it holds at a step, with
      the keys and values held and the next ones arriving, and in the backward the
      gradient accumulator on its way;
    - ``all_gather``: the rank's ``n`` queries against the whole sequence, with the
      storages of the local k and v that q's does not hold, until attention returns;
    - ``a2a``: the whole sequence for ``a/cp`` heads, with the local q, k and v, which
      nothing keeps, until attention returns, and in the backward the output's gradient
      the reverse all-to-all and reorder made.

    The ring's and the all-gather's output is attention's own from its start, and its
    gradient is there twice in the backward (as the projection gives it and as attention
    takes it, made contiguous). The count is above the layer's held bytes, of which
    attention's successors (the second norm's input, the output, the MLP's) do not exist
    yet in its forward: they are taken off, but for the second norm's input, whose size
    the first norm's output has, alive until attention returns. In the backward the MLP's
    are freed, the second norm's input too but for the residual's gradient in its place
    (an all-to-all's output is freed for its gradient), and the output projection's
    weight gradient is alive.
    """
    cp = config.context_parallel_size
    if cp == 1:
        return 0
    n, b, s = seq_length, mbs, seq_length * config.context_parallel_size
    tp, d, h = config.tensor_model_parallel_size, config.kv_channels, config.hidden_size
    a, g = config.num_attention_heads // tp, config.num_query_groups // tp
    w, c = config.params_dtype.itemsize, compute_width(config)
    kind = config.cp_comm_type
    fc1 = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1) // tp
    local = qkv_elements(config, expand_kv=False)  # the local q, k and v's storages
    shape = (b, a, g, d, w, c, backward)
    if kind == "p2p":
        if fused:  # a step: all n queries against the rank's own keys, or half of either
            work = max(
                fused_attention_working_bytes(*shape, n, n, [(n, n, False)]),
                fused_attention_working_bytes(*shape, n, n, [(n, n // 2, True)]),
                fused_attention_working_bytes(*shape, n, n, [(n // 2, n, True)]),
            )
        else:
            work = tiled_attention_working_bytes(b, a, g, d, n, n, n // 2, w, c, backward)
        work += 2 * (2 * n * b * g * d * w)  # the keys and values held and the next ones
        if backward:  # the gradient accumulator on its way
            work += 2 * n * b * g * d * max(w, 4)
        kept = local
    elif kind == "all_gather":
        if fused:  # the first chunk's diagonal, then the last's keys before it and its own
            half = n // 2
            calls = [(half, half, False), (half, s - half, False), (half, half, True)]
            work = fused_attention_working_bytes(*shape, n, s, calls)
        else:
            work = tiled_attention_working_bytes(b, a, g, d, n, s, n // 2, w, c, backward)
        kept = qkv_elements(config, keep=("q",))
    else:
        from megapp.context_parallel.a2a import kv_repeats

        heads, kv_heads = a // cp, g * kv_repeats(g, cp) // cp
        if fused:  # the whole sequence's square in one block
            shape = (b, heads, kv_heads, d, w, c, backward)
            work = fused_attention_working_bytes(*shape, s, s, [(s, s, False)])
        else:
            work = tiled_attention_working_bytes(
                b, heads, kv_heads, d, s, s, n // 2, w, c, backward
            )
        kept = 0
    output = n * b * a * d * w  # the size of attention's output and of its gradient
    own = kind != "a2a"  # the ring's and the all-gather's output is attention's own
    if backward:  # the output's gradient, twice where attention takes it made contiguous
        work += (2 if own else 1) * output + h * a * d * w
        return max(0, work - n * b * fc1 * w)
    work += n * b * (local - kept) * w + (output if own else 0)
    return max(0, work - n * b * (a * d + fc1) * w)


def tiled_attention_working_bytes(
    b: int, heads: int, kv_heads: int, d: int, rows: int, keys: int, tile: int, w: int, c: int,
    backward: bool,
) -> int:  # fmt: skip
    """Bytes :func:`~megapp.context_parallel.blocks.attend_in_tiles` has alive at its peak
    beyond what it keeps, for ``rows`` queries of ``heads`` heads against ``keys`` keys of
    ``kv_heads`` heads in tiles of ``tile × tile`` scores (``w``/``c``: bytes per element of
    the inputs and of the arithmetic). With ``T = b·heads·tile²·c`` a tile's scores:

    - forward: ``3T`` (the scores, their shift by the log-sum-exp and its exponentials),
      the keys and values of the tile repeated to the query heads or converted to ``c``,
      the previous tile's output and log-sum-exp and this one's, and the output
      accumulated in ``c`` beyond the ``w`` it is kept in;
    - backward: ``4T`` (probabilities, their gradient, the softmax backward's two
      intermediates) and a tile's output-sized product, the tile's keys and values (and q)
      repeated or converted, the previous tile's gradients, and the gradients of q, k and
      v accumulated over the tiles in ``c``, the tile's ``rowsum(dO·O)`` (and dO and O
      converted).
    """
    scores = b * heads * tile * tile * c
    q_tile = b * heads * tile * d * c
    widened = heads > kv_heads or w != c
    kv_tile = 2 * b * (heads if heads > kv_heads else kv_heads) * tile * d * c if widened else 0
    narrow = w != c
    if not backward:
        accumulated = b * heads * rows * d * (c - w)  # wider than the output it becomes
        return 3 * scores + kv_tile + b * heads * tile * (d + 2) * c + accumulated
    previous = q_tile + 2 * b * kv_heads * tile * d * c
    grads = b * heads * (rows * d + tile) * c + 2 * b * kv_heads * keys * d * c
    converted = q_tile + 2 * b * heads * rows * d * c if narrow else 0
    summed = 2 * b * kv_heads * tile * d * c if heads > kv_heads else 0  # dk, dv to kv heads
    return 4 * scores + q_tile + kv_tile + previous + grads + converted + summed


def fused_attention_working_bytes(
    b: int, heads: int, kv_heads: int, d: int, w: int, c: int, backward: bool,
    rows: int, keys: int, calls: list[tuple[int, int, bool]],
) -> int:  # fmt: skip
    """Bytes :func:`~megapp.context_parallel.blocks.attend_in_tiles` (or one ring step's
    :func:`~megapp.context_parallel.blocks.forward_in_tiles`) has alive at its peak beyond
    what it keeps, its blocks run in the fused kernel: ``rows`` queries of ``heads`` heads
    against ``keys`` keys of ``kv_heads`` heads (``w``/``c``: bytes per element of the inputs
    and of the arithmetic), in ``calls``: each block's ``(query rows, keys, merged)`` in
    order. A block's results stay alive until the next block's are returned. Where the
    heads differ or ``w < c``, each block's keys and values are repeated to the query heads
    or converted to ``c`` (and its queries converted):

    - forward: a block's output and log-sum-exp beside the previous block's, or, merging
      into the running output, its output-sized product and two row statistics; and the
      output accumulated in ``c`` beyond the ``w`` it is kept in;
    - backward: a block's dq, dk and dv (dk and dv at the query heads, then summed to the
      key heads) beside the previous block's, the gradients of q, k and v accumulated in
      ``c``, and, for ``w < c``, the output and its gradient converted to ``c``.
    """
    narrow, grouped = w != c, heads > kv_heads
    widened = 2 * b * (heads if grouped else kv_heads) * d * c if grouped or narrow else 0
    convert_v = b * kv_heads * d * c if grouped and narrow else 0  # per key, while repeating
    q_row = b * heads * d * c if narrow else 0  # a query row converted
    peak = previous = 0
    for r, k, merged in calls:
        inputs = previous + k * widened + r * q_row
        if not backward:
            part = b * heads * r * (d + 1) * c
            peak = max(peak, previous + k * (widened + convert_v), inputs + part)
            if merged:
                peak = max(peak, part + b * heads * r * (d + 2) * c)
            previous = part
            continue
        part = b * heads * r * d * c + 2 * b * kv_heads * k * d * c  # dq, dk, dv
        at_heads = k * widened if grouped else 0  # dk and dv before the sum to kv heads
        peak = max(peak, previous + k * (widened + convert_v) + r * q_row)
        peak = max(peak, inputs + at_heads + part)
        previous = part
    if not backward:
        return peak + b * heads * rows * d * (c - w)
    grads = b * heads * rows * d * c + 2 * b * kv_heads * keys * d * c
    converted = 2 * b * heads * rows * d * c if narrow else 0
    return peak + grads + converted
