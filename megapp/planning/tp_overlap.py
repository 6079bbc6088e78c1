"""Tensor-parallel collectives run against the matmuls beside them: Megatron-Core's
``--tp-comm-overlap``, priced.

With sequence parallelism every linear layer of a transformer layer sits next to a
collective of its activations (``[s, b, h]`` gathered or scattered over the tp ranks).
Megatron-Core's ``--tp-comm-overlap`` hands them to Transformer Engine's userbuffers, which
run each against a matmul by one of three methods. The pairs and the settings are TE's
defaults (``initialize_ub``):

- **ring exchange** (forward: the all-gathers into QKV and fc1; backward: the all-gathers
  of the output gradient into the projection's and fc2's input gradients): the matmul is
  cut into ``tp`` pieces of ``s/tp`` rows and each piece runs as soon as its rows arrive
  from the ring neighbour. Copy engines move them, so every piece has the whole device:
  ``(tp − 1) · max(piece, hop) + piece``.
- **pipeline** (forward: the reduce-scatters after the projection and fc2): the matmul in
  ``4`` pieces on the multiprocessors ``16`` communication ones leave, each piece's
  reduce-scatter under the next piece: ``piece + 3 · max(piece, scatter/4) + scatter/4``.
- **bulk** (backward: the all-gather of QKV's and fc1's input, which their weight
  gradients need, under their input-gradient matmul; the reduce-scatter of that input
  gradient under their weight-gradient matmul): both at once, the matmul on the
  multiprocessors ``16`` communication ones leave: ``max(matmul, collective)``.

What a layer pays is each pair's time less its matmul alone, summed: the collectives'
exposed part and the matmuls' loss to smaller pieces and fewer multiprocessors. Matmuls are
priced by :meth:`~megapp.planning.operations.OpRates.matmul` where the profile has
operation rates (pieces then pay their own tile and wave quantization, and a matmul beside
communication runs at the rate of the multiprocessors left); else at ``gemm_flops``,
where pieces and margins cost nothing. Collectives are
:class:`~megapp.planning.hardware.Link`'s. The embedding's, the output layer's and the
loss's collectives, and a mixture-of-experts layer's gathering and scattering of its
tokens, are not overlapped (TE's userbuffers serve the dense linears only; megapp's
overlap is in those same linears): :func:`~megapp.planning.layer_costs.tensor_parallel_seconds`
prices them as without it, and prices every collective so on hardware that runs no
communication beside compute (``Hardware.overlap_communication`` off).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.planning.hardware import Hardware, group_link

PIPELINE_PIECES = 4  # TE's num_splits of a pipeline overlap
COMMUNICATION_SMS = 16  # TE's num_sm of a pipeline or bulk overlap (set_sm_margin: on)


def ring_exchange(piece: float, hop: float, tp: int) -> float:
    """Seconds of a matmul cut into ``tp`` pieces of ``piece`` seconds, each run once its
    rows have come one ``hop`` round the ring."""
    return (tp - 1) * max(piece, hop) + piece


def pipeline(piece: float, scatter: float, pieces: int = PIPELINE_PIECES) -> float:
    """Seconds of a matmul in ``pieces`` pieces of ``piece`` seconds, each piece's output
    reduce-scattered (``scatter`` seconds) under the next piece's matmul."""
    return piece + (pieces - 1) * max(piece, scatter) + scatter


def bulk(matmul: float, collective: float) -> float:
    """Seconds of a matmul and a collective run at once."""
    return max(matmul, collective)


@dataclass(frozen=True)
class OverlapPair:
    """One matmul and the collective run against it: ``[m, k] × [k, n]`` in ``layout`` (0
    forward, 1 input gradient, 2 weight gradient), by ``method`` (``ring``, ``pipeline``,
    ``bulk``), in the ``forward`` or the backward of the layer. TE names it ``name``."""

    name: str
    method: str
    m: int
    n: int
    k: int
    layout: int
    forward: bool


def overlap_pairs(gpt: GPTConfig, tokens: int, dense_mlp: bool = True) -> list[OverlapPair]:
    """The pairs of one layer on one rank over ``tokens`` (gathered) rows: QKV and the
    projection, and with ``dense_mlp`` fc1 and fc2."""
    tp = gpt.tensor_model_parallel_size
    h, d = gpt.hidden_size, gpt.kv_channels
    heads, groups = gpt.num_attention_heads // tp, gpt.num_query_groups // tp
    ffn = gpt.ffn_hidden_size // tp
    gated = ffn * (2 if gpt.activation == "swiglu" else 1)
    columns = [("qkv", h, (heads + 2 * groups) * d)]  # [in, out]
    rows = [("proj", heads * d, h)]
    if dense_mlp:
        columns.append(("fc1", h, gated))
        rows.append(("fc2", ffn, h))
    pairs = []
    for name, inputs, outputs in columns:
        pairs += [
            OverlapPair(f"{name}_fprop", "ring", tokens, outputs, inputs, 0, True),
            OverlapPair(f"{name}_dgrad", "bulk", tokens, inputs, outputs, 1, False),
            OverlapPair(f"{name}_wgrad", "bulk", outputs, inputs, tokens, 2, False),
        ]
    for name, inputs, outputs in rows:
        pairs += [
            OverlapPair(f"{name}_fprop", "pipeline", tokens, outputs, inputs, 0, True),
            OverlapPair(f"{name}_dgrad", "ring", tokens, inputs, outputs, 1, False),
        ]
    return pairs


def pair_cut(pair: OverlapPair, tp: int) -> tuple[int, int, bool]:
    """How ``pair``'s method cuts its matmul: rows per piece, pieces, and whether they run
    beside communication (on the multiprocessors it leaves): ``tp`` of ``m/tp`` rows on the
    whole device (ring), ``4`` of ``m/4`` beside communication (pipeline), the whole
    matmul beside communication (bulk)."""
    if pair.method == "ring":
        return pair.m // tp, tp, False
    if pair.method == "pipeline":
        return pair.m // PIPELINE_PIECES, PIPELINE_PIECES, True
    return pair.m, 1, True


def pair_piece(pair: OverlapPair, tp: int, whole, margin) -> tuple[float, int]:
    """One piece of ``pair``'s matmul as :func:`pair_cut` cuts it, in seconds from the
    pricers ``whole`` (every multiprocessor) and ``margin`` (those communication leaves),
    and how many pieces."""
    rows, pieces, beside = pair_cut(pair, tp)
    return (margin if beside else whole)(rows, pair.n, pair.k, pair.layout), pieces


def overlapped_seconds(
    gpt: GPTConfig,
    seq_length: int,
    micro_batch_size: int,
    hardware: Hardware,
    dense_mlp: bool = True,
) -> tuple[float, float]:
    """What one layer's tensor-parallel collectives cost a microbatch on one rank under
    ``--tp-comm-overlap`` beyond its matmuls alone, in its forward and its backward.
    ``dense_mlp=False``: a mixture-of-experts layer, whose attention's linears overlap and
    whose experts' gather and scatter of the tokens run as without it."""
    tp = gpt.tensor_model_parallel_size
    link = group_link(hardware, tp)
    tokens = seq_length // gpt.context_parallel_size * micro_batch_size
    w = gpt.params_dtype.itemsize
    act = tokens * gpt.hidden_size * w  # one gathered activation, or one output to scatter
    whole = priced_matmul(hardware, w)
    margin = priced_matmul(hardware, w, COMMUNICATION_SMS)
    hop = link.message(act / tp)
    collective = link.all_gather(act, tp)
    scatter_piece = link.all_gather(act / PIPELINE_PIECES, tp)
    experts = 0.0 if dense_mlp else 2 * collective  # the experts' gather and scatter
    seconds = [experts, experts]  # backward, forward
    for pair in overlap_pairs(gpt, tokens, dense_mlp):
        piece, _ = pair_piece(pair, tp, whole, margin)
        if pair.method == "ring":
            total = ring_exchange(piece, hop, tp)
        elif pair.method == "pipeline":
            total = pipeline(piece, scatter_piece)
        else:
            total = bulk(piece, collective)
        seconds[pair.forward] += total - whole(pair.m, pair.n, pair.k, pair.layout)
    return seconds[1], seconds[0]


def priced_matmul(hardware: Hardware, width: int, busy_sms: int = 0):
    """Seconds of ``[m, k] × [k, n]`` of ``width``-byte elements in layout 0, 1, 2
    (forward, input gradient, weight gradient) on the multiprocessors ``busy_sms`` leave."""
    ops = hardware.ops
    if ops is None:
        return lambda m, n, k, layout: 2.0 * m * n * k / hardware.gemm_flops
    if busy_sms:
        left = ops.multiprocessors - busy_sms
        ops = dataclasses.replace(
            ops.scaled_compute(left / ops.multiprocessors), multiprocessors=left
        )
    return lambda m, n, k, layout: ops.matmul(m, n, k, width, layout=layout)


__all__ = [
    "OverlapPair",
    "bulk",
    "overlap_pairs",
    "overlapped_seconds",
    "pair_cut",
    "pair_piece",
    "pipeline",
    "priced_matmul",
    "ring_exchange",
]
