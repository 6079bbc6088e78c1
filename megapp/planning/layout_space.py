"""The layouts a planner searches: every split of N devices into tensor, context, pipeline
and data parallel sizes (and expert parallel sizes for mixture-of-experts models) with
virtual stages, micro-batch sizes, recompute, ZeRO stages,
sequence parallelism and schedules that the arithmetic allows."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from megapp.context_parallel.a2a import check_heads
from megapp.context_parallel.layout import check_sequence_length
from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS, SCHEDULES
from megapp.planning.layout import CP_COMM_TYPES, RECOMPUTE, Layout

LONG_SEQUENCE = 8192
"""Sequences longer than this get context parallelism searched by default; at or below it
one rank's attention is a small share of its layer's work (a GPT-3 175B layer at 2048
tokens: 6%), and every cp size multiplies the space."""

MAX_AUTO_CP = 16
"""The largest context-parallel size searched by default (Llama 3.1 405B's 128K-token
stage ran cp 16)."""


@dataclass(frozen=True)
class Space:
    """Limits of the search: micro-batch sizes (powers of two) up to
    ``max_micro_batch_size``, up to ``max_chunks`` virtual stages per rank, ``schedules``,
    context-parallel sizes ``cp`` (None: :func:`auto_cp_sizes`) with the communication
    ``cp_comm_types`` each, expert-parallel sizes ``ep`` (None: :func:`expert_sizes`; a
    dense model runs ep 1 alone whatever this says); ``tp_comm_overlap``: every
    sequence-parallel layout also with ``--tp-comm-overlap``."""

    max_micro_batch_size: int = 8
    max_chunks: int = 8
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    cp: tuple[int, ...] | None = None
    cp_comm_types: tuple[str, ...] = CP_COMM_TYPES
    ep: tuple[int, ...] | None = None
    tp_comm_overlap: bool = True

    def __post_init__(self) -> None:
        if self.ep is not None and (not self.ep or min(self.ep) < 1):
            raise ValueError(f"expert-parallel sizes must be >= 1, got {self.ep}")
        if self.cp is not None and (not self.cp or min(self.cp) < 1):
            raise ValueError(f"context-parallel sizes must be >= 1, got {self.cp}")
        unknown = [kind for kind in self.cp_comm_types if kind not in CP_COMM_TYPES]
        if unknown or not self.cp_comm_types:
            raise ValueError(f"cp_comm_types must name some of {CP_COMM_TYPES}, got {unknown}")

    def cp_sizes(self, seq_length: int | None, gpus: int) -> tuple[int, ...]:
        """The context-parallel sizes to search: ``cp`` as given, or :func:`auto_cp_sizes`."""
        return self.cp if self.cp is not None else auto_cp_sizes(seq_length, gpus)


def auto_cp_sizes(seq_length: int | None, gpus: int) -> tuple[int, ...]:
    """The default context-parallel sizes: 1 alone for sequences up to
    :data:`LONG_SEQUENCE` tokens (or an unknown length), else every divisor of ``gpus`` up
    to :data:`MAX_AUTO_CP`."""
    if seq_length is None or seq_length <= LONG_SEQUENCE:
        return (1,)
    return tuple(d for d in _divisors(gpus) if d <= MAX_AUTO_CP)


def expert_sizes(base: GPTConfig, tp: int, rest: int, space: Space) -> list[int]:
    """The expert-parallel sizes to search with tensor parallelism ``tp`` and ``rest`` =
    GPUs / (tp·pp) ranks left (cp·dp): 1 for a dense model; else those of ``space.ep`` (by
    default every divisor of the experts) for which the expert grid (etp = tp) tiles the
    ranks, as :class:`~megapp.process_grid.ProcessGrid` requires."""
    if base.num_moe_experts is None:
        return [1]
    sizes = space.ep if space.ep is not None else _divisors(base.num_moe_experts)
    return [ep for ep in sizes if not base.num_moe_experts % ep and not (tp * rest) % (tp * ep)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(base: GPTConfig, gpus: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """Every (tp, pp): tp divides the devices, a node (a tp group within one node) and the
    heads; pp divides what tp leaves and is at most the layers."""
    heads, groups, layers = base.num_attention_heads, base.num_query_groups, base.num_layers
    return [
        (tp, pp)
        for tp in _divisors(gpus)
        if not (gpus_per_node % tp or heads % tp or groups % tp)
        for pp in _divisors(gpus // tp)
        if pp <= layers
    ]


def cp_refusal(
    base: GPTConfig, seq_length: int, tp: int, cp: int, comm_type: str, sp: bool
) -> str | None:
    """Why context parallelism of ``cp`` ranks by ``comm_type`` cannot run the model ``base``
    on sequences of ``seq_length`` under tensor parallelism ``tp`` (``sp``: with sequence
    parallelism), in the words of the rule's owner; None when it can."""
    if cp == 1:
        return None
    try:
        check_sequence_length(seq_length, cp)
        if comm_type == "a2a":
            check_heads(base.num_attention_heads // tp, cp)
    except ValueError as error:
        return str(error)
    if sp and (seq_length // cp) % tp:
        return (
            f"sequence parallelism splits each cp rank's {seq_length // cp} tokens over tp = "
            f"{tp}, which does not divide them"
        )
    if base.attention_dropout:
        return f"attention dropout ({base.attention_dropout}) is not supported with cp > 1"
    return None


def _cp_choices(
    base: GPTConfig, seq_length: int | None, tp: int, sp: bool, rest: int, space: Space
) -> list[tuple[int, str]]:
    """Every (cp, comm type) of ``space`` whose cp divides the ``rest`` of the devices that
    tp leaves and whose rules pass (cp 1 once, with the default communication)."""
    choices = []
    for cp in space.cp_sizes(seq_length, rest * tp):
        if rest % cp:
            continue
        if cp == 1:
            choices.append((1, CP_COMM_TYPES[0]))
            continue
        for kind in space.cp_comm_types:
            if seq_length is not None and not cp_refusal(base, seq_length, tp, cp, kind, sp):
                choices.append((cp, kind))
    return choices


COUNTED_SPLITS = {0: (False, False), 1: (False, True), 2: (True, True)}
"""What a split that counts ``c`` more layers counts: (the embedding, the loss); one alone
is the loss, whose output layer outweighs the embedding's lookup."""


def _chunk_splits(layers: int, pp: int, space: Space) -> list[tuple[int, int]]:
    """Each number of chunks per pipeline rank with the layers its split counts besides
    the transformer layers: 0 where the layers divide into whole chunks, else 2 (the
    embedding and the loss counted) or 1 (the loss) where that count divides."""
    if pp == 1:
        return [(1, 0)]
    out = []
    for v in range(1, min(space.max_chunks, (layers + 2) // pp) + 1):
        counted = next((c for c in (0, 2, 1) if (layers + c) % (pp * v) == 0), None)
        if counted is not None:
            out.append((v, counted))
        elif v == 1:
            out.append((1, 0))  # laid out as ever: pretrain_gpt.py's refusal is counted
    return out


def _schedule_names(layers: int, pp: int, space: Space) -> list[tuple[int, int, list]]:
    """Each number of chunks per pipeline rank, the layers its split counts
    (:func:`_chunk_splits`), and the schedules that run that many chunks (the V-shaped
    ones exactly two, GPipe and 1F1B one, interleaving two or more)."""
    if pp == 1:
        return [(1, 0, [None])]
    return [
        (v, c, [n for n in space.schedules if SCHEDULE_KINDS[n].runs_chunks(v)])
        for v, c in _chunk_splits(layers, pp, space)
    ]


def layouts(
    base: GPTConfig,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    space: Space = Space(),
    *,
    seq_length: int | None = None,
) -> Iterator[Layout]:
    """Every layout of ``gpus`` devices the arithmetic allows (sizes that divide, a whole
    number of microbatches, whole chunks of layers, context parallelism's rules for
    sequences of ``seq_length``: :func:`cp_refusal`); the schedules' own rules are left to
    :func:`~megapp.planning.layout.pretrain_config`. :func:`why_empty` says which rule
    left none."""
    for tp, pp in _splits(base, gpus, gpus_per_node):
        rest, sps = gpus // (tp * pp), (False, True) if tp > 1 else (False,)
        by_sp = {sp: _cp_choices(base, seq_length, tp, sp, rest, space) for sp in sps}
        for cp, kind in dict.fromkeys(c for sp in sps for c in by_sp[sp]):  # in order, once
            dp = rest // cp
            if global_batch_size % dp:
                continue
            eps = expert_sizes(base, tp, rest, space)
            for vpp, counted, names in _schedule_names(base.num_layers, pp, space):
                embedding, loss = COUNTED_SPLITS[counted]
                for mbs in (1 << i for i in range(space.max_micro_batch_size.bit_length())):
                    if mbs > space.max_micro_batch_size or global_batch_size % (mbs * dp):
                        continue
                    sizes = dict(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=mbs)
                    sizes |= dict(embedding_in_split=embedding, loss_in_split=loss)
                    for recompute in RECOMPUTE:
                        for zero in range(4) if dp * cp > 1 else [0]:
                            for sp in (sp for sp in sps if (cp, kind) in by_sp[sp]):
                                overlaps = (
                                    (False, True) if sp and space.tp_comm_overlap else (False,)
                                )
                                for name, ep, tpo in itertools.product(names, eps, overlaps):
                                    yield Layout(
                                        **sizes,
                                        schedule=name,
                                        sequence_parallel=sp,
                                        tp_comm_overlap=tpo,
                                        recompute=recompute,
                                        zero_stage=zero,
                                        cp=cp,
                                        cp_comm_type=kind,
                                        ep=ep,
                                    )


def why_empty(
    base: GPTConfig,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    space: Space = Space(),
    *,
    seq_length: int | None = None,
) -> str:
    """Which rule of :func:`layouts` left no layout (tp = pp = 1 and one sample per
    microbatch always pass theirs): context parallelism's (when no size of ``space.cp``
    can run), the data-parallel sizes the global batch must divide, or the V-shaped
    schedules' two chunks per pipeline rank."""
    splits = _splits(base, gpus, gpus_per_node)
    shapes = [
        (tp, pp, cp)
        for tp, pp in splits
        for sp in ((False, True) if tp > 1 else (False,))
        for cp, _ in _cp_choices(base, seq_length, tp, sp, gpus // (tp * pp), space)
    ]
    if not shapes:
        sizes = space.cp_sizes(seq_length, gpus)
        reasons = sorted(
            {
                cp_refusal(base, seq_length, 1, cp, kind, False) or ""
                for cp in sizes
                for kind in space.cp_comm_types
                if seq_length is not None and cp > 1 and not gpus % cp
            }
            - {""}
        )
        dividing = [cp for cp in sizes if not gpus % cp]
        if not dividing:
            why = f"none divides the {gpus} GPUs"
        elif seq_length is None:
            why = "the sequence length is unknown"
        else:
            why = "; ".join(reasons) or "no tensor- and pipeline-parallel size leaves room"
        return (
            f"no context-parallel size of {', '.join(map(str, sizes))} can run "
            f"({', '.join(space.cp_comm_types)}): {why}"
        )
    sizes = sorted({gpus // (tp * pp * cp) for tp, pp, cp in shapes})
    if all(global_batch_size % dp for dp in sizes):
        return (
            f"global batch {global_batch_size} is not divisible by any data-parallel size "
            f"that {gpus} GPUs leave ({', '.join(map(str, sizes))}: GPUs / (tp × cp × pp), tp "
            f"dividing a node's {gpus_per_node} GPUs and the model's "
            f"{base.num_attention_heads} heads, pp up to its {base.num_layers} layers); use "
            f"a multiple of {sizes[0]}"
        )
    return (
        f"the schedules {', '.join(space.schedules)} run two chunks per pipeline rank, and "
        f"no pipeline size that global batch {global_batch_size} allows gives two (the "
        f"model's {base.num_layers} layers, at most {space.max_chunks} chunks per rank); add "
        "a schedule of one chunk per rank"
    )
