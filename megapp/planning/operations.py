"""A layer's compute time priced operation by operation, from the device and the shapes.

:class:`OpRates` says how fast one device runs each kind of operation a transformer layer is
made of; :func:`layer_seconds` prices one layer's forward, input-gradient and weight-gradient
work for one microbatch on one tensor- and context-parallel rank, and :func:`logits_seconds`
the output layer's. The time model (:mod:`megapp.planning.timing`) uses them when the
hardware profile carries rates (``Hardware.ops``), and ``FLOPs / Hardware.gemm_flops``
otherwise.

Per operation, with ``w`` bytes per element:

- **matmul** ``[m, k] × [k, n]``: a roofline over tiles. The kernel covers the output with
  ``tile[0] × tile[1]`` tiles run in waves of ``multiprocessors`` tiles, each wave one
  tile's work on one multiprocessor; a partial last wave costs a whole one (wave
  quantization) and a partial tile a whole tile (tile quantization). An output of fewer
  tiles than multiprocessors splits its reduction (split-K). Seconds
  ``max(2·waves·multiprocessors·tm·tn·k' / matmul_flops + waves·wave_overhead,
  w·(mk + kn + mn) / memory_bandwidth) + matmul_overhead``, ``k'`` the reduction's piece. A
  forward ``x·Wᵀ`` of ``T`` tokens is ``[T, k] × [k, n]``; its input gradient
  ``[T, n] × [n, k]``, its weight gradient ``[n, T] × [T, k]``, each at its own rate where
  the calibration measured the three layouts apart (``gradient_matmul_flops``).
- **attention core**, by implementation (``attention_backend``): ``sdpa`` is a fused,
  flash-style kernel that skips the masked half of the causal square: ``2·b·a·s_q·s_k·d``
  FLOPs (half of q·kᵀ and p·v over the square), forward and backward each
  ``flops / rate + rows · row_seconds + overhead`` (``rows = b·a·s_q``) at the rates
  measured for the nearest head dimension (:class:`AttentionRates`; it recomputes q·kᵀ
  backward); ``fused_softmax`` materializes the
  ``s × s`` scores as older Megatron-LM runs did: two batched matmuls over the whole square,
  and the softmax, its mask and dropout as memory-bound passes over ``b·a·s²`` elements.
- **memory-bound kernels** (norms, bias + dropout + residual, the activation, RoPE, the
  attention output's relayout, grouped queries' repeated keys and values, the residual
  stream's gradient sums, the QKV bias's gradient, the fp32 accumulation of the weight
  gradients): bytes read and written over the kernel's own rate at the width of its input
  plus its fixed seconds per call (``OpRates.kernels`` and ``kernel_latency``, measured
  forward and backward on two sizes, interpolated in log-width), or ``memory_bandwidth``
  for a kernel not measured. megapp's layers (``OpRates.megapp_layers``) also rebuild
  saved inputs in the input gradient: each norm's forward twice more (its output, its
  statistics), the activation's and the relayout's once, unless the layer is recomputed
  whole. Their fused attention's output merges into ``[s, b, a·d]`` as a view (no
  relayout; materialized scores need one); they pay strided copies instead, at the
  relayout's rate: the fused projection's gradient gathered from those of q, k and v;
  with grouped queries the queries out of the projection, keys and values repeated per
  head, the values made contiguous and the gradients back; with RoPE and full heads the
  values made contiguous forward and backward (all as H200 profiles show them).
- **gaps**: after every kernel the device waits ``kernel_overhead`` before the next one
  starts (measured on a stream of tiny kernels; a step of a 1B GPT on one H200 spends 2-3%
  of its time there, in some 7,600 gaps).
- A pass (forward, input or weight gradient) lasts at least its kernels' launches on the
  host (``launch_overhead`` each): small layers are launch-bound.

``python -m megapp.planning.calibrate`` measures the rates on the device at hand and
:mod:`megapp.planning.op_fit` fits them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.planning.activations import moe_routed_rows

_DROPOUT_MASK_BYTES = 1  # torch keeps a dropout mask as one byte per element
OVERHEADS = ("wave_overhead", "matmul_overhead", "kernel_overhead", "launch_overhead")


@dataclass(frozen=True)
class AttentionRates:
    """Fused causal attention at one head dimension: forward and backward seconds are
    ``flops / rate + rows · row_seconds + overhead``, ``flops`` its unmasked half's forward
    FLOPs and ``rows`` its query rows (batch · heads · queries): the work that grows with
    the square of the sequence, the work each query row costs whatever the sequence (its
    loads and stores, the causal diagonal's partial tiles, the backward's preprocessing
    passes), and the kernel's fixed cost."""

    head_dim: int
    forward_flops: float
    backward_flops: float
    forward_overhead: float = 0.0
    backward_overhead: float = 0.0
    forward_row_seconds: float = 0.0
    backward_row_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dim < 1 or not (self.forward_flops > 0 and self.backward_flops > 0):
            raise ValueError("attention rates: head_dim >= 1 and rates > 0")
        costs = (self.forward_overhead, self.backward_overhead)
        costs += (self.forward_row_seconds, self.backward_row_seconds)
        if min(costs) < 0:
            raise ValueError("attention rates: overheads and row costs must be >= 0")


@dataclass(frozen=True)
class OpRates:
    """How fast one device runs the operations of a layer. Rates per second, times in
    seconds, ``tile`` the output tile of its matmul kernels."""

    matmul_flops: float  # 16-bit dense matmul rate inside full waves of full tiles
    multiprocessors: int  # tiles that run at once (one per SM)
    tile: tuple[int, int]  # output rows × columns one SM computes at a time
    memory_bandwidth: float  # bytes/s (read + written) of memory-bound kernels not listed
    # (op, width, forward bytes/s, backward bytes/s) of the memory-bound kernels measured one
    # by one at the widths (last dimensions) of their inputs: layer_norm, rms_norm, bias_gelu,
    # bias_swiglu, bias_dropout_add, rope, copy, add (width 0: any)
    kernels: tuple[tuple[str, int, float, float], ...] = ()
    attention: tuple[AttentionRates, ...] = ()  # by head dimension; the nearest one is used
    # (op, width, forward s, backward s): a measured kernel's fixed seconds per call beside
    # its bytes (``kernels`` then holds the bandwidth its bytes move at)
    kernel_latency: tuple[tuple[str, int, float, float], ...] = ()
    # the input- and weight-gradient matmuls' rates (``dy·W`` and ``dyᵀ·x`` layouts) where
    # measured apart; () for matmul_flops
    gradient_matmul_flops: tuple[float, ...] = ()
    wave_overhead: float = 0.0  # per wave of a matmul (a tile's prologue and epilogue)
    matmul_overhead: float = 0.0  # per matmul kernel (launch, ramp and tail)
    kernel_overhead: float = 0.0  # device seconds from one kernel to the next (any kernel)
    launch_overhead: float = 0.0  # host seconds per kernel: a pass lasts at least its count
    # The layers are megapp's: they rebuild saved inputs in backward (each norm's output and
    # statistics, the activation's output, the attention's relayout) unless recomputed whole,
    # and repeat grouped keys and values for attention. False: layers that keep those outputs
    # and attend grouped queries natively (Transformer Engine's, in Megatron's runs).
    megapp_layers: bool = True

    def __post_init__(self) -> None:
        if not (self.matmul_flops > 0 and self.memory_bandwidth > 0):
            raise ValueError("op rates: matmul_flops and memory_bandwidth must be > 0")
        if self.multiprocessors < 1 or len(self.tile) != 2 or min(self.tile) < 1:
            raise ValueError("op rates: multiprocessors and both tile sides must be >= 1")
        for name in OVERHEADS:
            if getattr(self, name) < 0:
                raise ValueError(f"op rates: {name} must be >= 0")
        if any(not (f > 0 and b > 0) for _, _, f, b in self.kernels):
            raise ValueError("op rates: every kernel's rates must be > 0")
        if any(min(f, b) < 0 for _, _, f, b in self.kernel_latency):
            raise ValueError("op rates: kernel latencies must be >= 0")
        if (
            len(self.gradient_matmul_flops) not in (0, 2)
            or min(self.gradient_matmul_flops, default=1.0) <= 0
        ):
            raise ValueError("op rates: gradient_matmul_flops is () or two rates > 0")

    @classmethod
    def from_dict(cls, data: dict) -> OpRates:
        """From :func:`dataclasses.asdict`'s form (the tile as a list)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown op-rate keys: {', '.join(unknown)}")
        attention = tuple(AttentionRates(**a) for a in data.get("attention", ()))
        rows = {key: tuple((name, width, f, b) for name, width, f, b in data.get(key, ()))
                for key in ("kernels", "kernel_latency")}  # fmt: skip
        gradient = tuple(data.get("gradient_matmul_flops", ()))
        return cls(**{**data, "tile": tuple(data["tile"]), "attention": attention, **rows,
                      "gradient_matmul_flops": gradient})  # fmt: skip

    def scaled_compute(self, factor: float) -> OpRates:
        """These rates with the matmuls' and the attention's times ``factor`` (memory-bound
        work and the overheads as they are)."""
        attention = tuple(
            dataclasses.replace(
                a, forward_flops=a.forward_flops * factor, backward_flops=a.backward_flops * factor
            )
            for a in self.attention
        )
        return dataclasses.replace(
            self,
            matmul_flops=self.matmul_flops * factor,
            gradient_matmul_flops=tuple(f * factor for f in self.gradient_matmul_flops),
            attention=attention,
        )

    def split(self, m: int, n: int, k: int, batch: int = 1) -> int:
        """Pieces the reduction of ``k`` is split into when the output has fewer tiles than
        there are multiprocessors (split-K: each piece of at least 256 on a tile of its own)."""
        tm, tn = self.tile
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        return max(1, min(self.multiprocessors // tiles, k // 256))

    def waves(self, m: int, n: int, batch: int = 1, k: int = 0) -> int:
        """Waves of tiles (split-K pieces counted as tiles) that cover ``batch`` outputs
        ``[m, n]`` of a reduction over ``k``."""
        tm, tn = self.tile
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn) * self.split(m, n, k, batch)
        return math.ceil(tiles / self.multiprocessors)

    def matmul(
        self, m: int, n: int, k: int, width: int = 2, batch: int = 1, layout: int = 0
    ) -> float:
        """Seconds of ``batch`` products ``[m, k] × [k, n]`` in one kernel: whole waves of
        whole tiles, each wave one tile's work on one multiprocessor, or the bytes moved,
        whichever is longer; ``layout`` 1 and 2 lay it out as a linear layer's input- and
        weight-gradient products (their rates where measured apart)."""
        tm, tn = self.tile
        waves = self.waves(m, n, batch, k)
        piece = math.ceil(k / self.split(m, n, k, batch))
        rate = self.gradient_matmul_flops[layout - 1] if layout and self.gradient_matmul_flops \
            else self.matmul_flops  # fmt: skip
        compute = 2.0 * waves * self.multiprocessors * tm * tn * piece / rate
        compute += waves * self.wave_overhead
        traffic = batch * width * (m * k + k * n + m * n) / self.memory_bandwidth
        return max(compute, traffic) + self.matmul_overhead

    def linear(self, tokens: int, inputs: int, outputs: int, width: int = 2) -> tuple[float, ...]:
        """Seconds of ``y = x·Wᵀ`` over ``tokens`` rows: forward, input gradient, weight
        gradient."""
        return (
            self.matmul(tokens, outputs, inputs, width),
            self.matmul(tokens, inputs, outputs, width, layout=1),
            self.matmul(outputs, inputs, tokens, width, layout=2),
        )

    def memory(self, nbytes: float, kernels: int) -> float:
        """Seconds of ``kernels`` memory-bound kernels moving ``nbytes`` in all, at the
        default rate."""
        return nbytes / self.memory_bandwidth + kernels * self.kernel_overhead

    def kernel(
        self, op: str, width: int, forward_bytes: float, backward_bytes: float, calls: int = 1
    ) -> tuple[float, float]:
        """Forward and backward device seconds of ``calls`` calls of the memory-bound kernel
        ``op`` on inputs of last dimension ``width`` moving those bytes in all: at its rates
        (and fixed seconds per call) measured at that width, interpolated in log-width
        between the nearest measured ones (the end ones beyond them); at the default rate
        where it was not measured. A direction that moves no bytes runs no kernel and costs
        nothing. The time between kernels is not in it (``kernel_overhead``)."""
        f, b = _at_width([r for r in self.kernels if r[0] == op], width) or (
            self.memory_bandwidth,
            self.memory_bandwidth,
        )
        fixed_f, fixed_b = _at_width([r for r in self.kernel_latency if r[0] == op], width) or (
            0.0, 0.0
        )  # fmt: skip
        return (
            forward_bytes / f + calls * fixed_f if forward_bytes else 0.0,
            backward_bytes / b + calls * fixed_b if backward_bytes else 0.0,
        )

    def attention_at(self, head_dim: int) -> AttentionRates:
        """The attention rates measured at the head dimension nearest ``head_dim``."""
        if not self.attention:
            raise ValueError("these op rates have no attention rates: calibrate measures them")
        return min(self.attention, key=lambda a: abs(math.log(a.head_dim / head_dim)))

    def attention_seconds(
        self, flops: float, head_dim: int, rows: float = 0.0
    ) -> tuple[float, float]:
        """Forward and backward seconds of fused causal attention of ``flops`` (its unmasked
        half's forward FLOPs) over ``rows`` query rows with heads of ``head_dim``."""
        a = self.attention_at(head_dim)
        forward = flops / a.forward_flops + rows * a.forward_row_seconds + a.forward_overhead
        backward = flops / a.backward_flops + rows * a.backward_row_seconds
        return forward, backward + a.backward_overhead


def _at_width(rows: list, width: int) -> tuple[float, float] | None:
    """The (forward, backward) values of ``(op, width, forward, backward)`` rows at
    ``width``: interpolated in log-width between the nearest rows (geometrically where both
    are positive, linearly where one is zero), the end rows' beyond them; None without rows."""
    rows = sorted(r[1:] for r in rows)
    if not rows:
        return None
    if len(rows) == 1 or width <= rows[0][0] or rows[0][0] <= 0:
        return rows[0][1], rows[0][2]
    if width >= rows[-1][0]:
        return rows[-1][1], rows[-1][2]
    (w0, *lo), (w1, *hi) = next((a, b) for a, b in itertools.pairwise(rows) if b[0] >= width)
    t = math.log(width / w0) / math.log(w1 / w0)
    return tuple(
        a * (b / a) ** t if a > 0 and b > 0 else a + (b - a) * t
        for a, b in zip(lo, hi, strict=True)
    )


@dataclass(frozen=True)
class LayerSeconds:
    """Seconds of one layer (or the output layer) for one microbatch on one rank."""

    forward: float
    input_grad: float
    weight_grad: float
    core_forward: float = 0.0  # the attention core's share of forward (selective recompute)


def _width(gpt: GPTConfig) -> int:
    return gpt.params_dtype.itemsize


def attention_seconds(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, rates: OpRates
) -> tuple[float, float]:
    """Forward and backward seconds of one layer's attention core on one rank: its
    ``a/tp`` heads, ``s/cp`` queries against the whole sequence of ``seq_length``."""
    tp, cp = gpt.tensor_model_parallel_size, gpt.context_parallel_size
    heads, d, b = gpt.num_attention_heads // tp, gpt.kv_channels, micro_batch_size
    queries, keys, w = seq_length // cp, seq_length, _width(gpt)
    if gpt.attention_backend == "sdpa":
        flops = 2.0 * b * heads * queries * keys * d  # ½·4·s_q·s_k·d
        return rates.attention_seconds(flops, d, b * heads * queries)
    batch = b * heads  # materialized scores: q·kᵀ, softmax (+ mask, dropout), p·v
    scores = batch * queries * keys
    dropout = gpt.attention_dropout > 0
    forward = rates.matmul(queries, keys, d, w, batch) + rates.matmul(queries, d, keys, w, batch)
    forward += rates.memory(scores * (2 * w + dropout * (w + _DROPOUT_MASK_BYTES)), 1 + dropout)
    backward = 2 * rates.matmul(queries, keys, d, w, batch)  # d(p) = d(ctx)·vᵀ, d(q) = d(s)·k
    backward += 2 * rates.matmul(keys, d, queries, w, batch)  # d(v) = pᵀ·d(ctx), d(k) = d(s)ᵀ·q
    backward += rates.memory(scores * (3 * w + dropout * (2 * w + 1)), 1 + dropout)
    return forward, backward


def layer_parts(
    gpt: GPTConfig,
    seq_length: int,
    micro_batch_size: int,
    rates: OpRates,
    *,
    dense_mlp: bool = True,
) -> dict[str, tuple[float, float, float]]:
    """One dense layer's seconds on one rank by kind of work, each as (forward, input
    gradient, weight gradient): ``matmul``, ``attention`` (the core), ``memory`` (memory-bound
    passes), ``grad_accumulation`` (16-bit weight gradients added into fp32 ``main_grad``)
    and ``gaps`` (the device's time between one kernel and the next, ``kernel_overhead``
    after each of :func:`layer_kernels`). ``dense_mlp=False``: without the MLP's matmuls,
    activation and weights (a mixture-of-experts layer's attention half,
    :func:`expert_parts` the rest)."""
    return _priced_layer(gpt, seq_length, micro_batch_size, rates, dense_mlp)[0]


def layer_kernels(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, rates: OpRates, *,
    dense_mlp: bool = True,
) -> tuple[int, int, int]:  # fmt: skip
    """Kernels one layer (as :func:`layer_parts` prices it) launches in its forward, input
    gradient and weight gradient: its matmuls, the attention core, each memory-bound pass
    and rebuilt input, and one fp32 gradient accumulation per parameter tensor."""
    return _priced_layer(gpt, seq_length, micro_batch_size, rates, dense_mlp)[1]


def _priced_layer(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, rates: OpRates, dense_mlp: bool
) -> tuple[dict[str, tuple[float, float, float]], tuple[int, int, int]]:
    tp, cp = gpt.tensor_model_parallel_size, gpt.context_parallel_size
    tokens = seq_length // cp * micro_batch_size
    h, d, w = gpt.hidden_size, gpt.kv_channels, _width(gpt)
    heads, groups = gpt.num_attention_heads // tp, gpt.num_query_groups // tp
    ffn = gpt.ffn_hidden_size // tp if dense_mlp else 0
    gated = gpt.activation == "swiglu"
    linears = [(h, (heads + 2 * groups) * d), (heads * d, h)]  # QKV, projection
    if dense_mlp:  # fc1 (with SwiGLU's gate), fc2
        linears += [(h, ffn * (2 if gated else 1)), (ffn, h)]
    timed = [rates.linear(tokens, inputs, outputs, w) for inputs, outputs in linears]
    matmul = tuple(sum(column) for column in zip(*timed, strict=True))
    core_f, core_b = attention_seconds(gpt, seq_length, micro_batch_size, rates)
    rows = tokens // tp if gpt.sequence_parallel else tokens  # norms and residual rows
    mask = _DROPOUT_MASK_BYTES if gpt.hidden_dropout > 0 else 0
    norm = "layer_norm" if gpt.normalization == "LayerNorm" else "rms_norm"
    rope = gpt.position_embedding_type == "rope"
    grouped = groups < heads and rates.megapp_layers
    fused = gpt.attention_backend == "sdpa"
    # megapp's fused attention returns its output laid out as [s, b, a, d], which merges
    # into [s, b, a·d] as a view (seen in H200 profiles with and without RoPE and grouped
    # queries); materialized scores give [b, a, s, d], which needs the relayout copy (and
    # its gradient the copy back)
    relayout = 0 if rates.megapp_layers and fused else 2 * tokens * heads * d * w
    queries, kv = tokens * heads * d * w, tokens * groups * d * w
    passes = [  # (kernel, width, forward bytes, backward bytes[, calls]): read + written
        (norm, h, 2 * rows * h * w, 3 * rows * h * w),  # x → y; x, dy → dx
        (norm, h, 2 * rows * h * w, 3 * rows * h * w),
        ("bias_dropout_add", h, rows * h * (3 * w + mask), rows * h * (2 * w + mask)),
        ("bias_dropout_add", h, rows * h * (3 * w + mask), rows * h * (2 * w + mask)),
        ("relayout", d, relayout, relayout),  # [b, a, s, d] → [s, b, a·d]; its gradient back
        # backward: the residual stream's gradient is the sum of two paths, twice a layer
        ("copy", 0, 0.0, 3 * rows * h * w),
        ("copy", 0, 0.0, 3 * rows * h * w),
    ]
    if rates.megapp_layers:  # strided copies, as megapp's layer makes them (H200 profiles)
        # the fused projection's gradient, gathered from those of q, k and v
        passes.append(("relayout", d, 0.0, 2 * (queries + 2 * kv), 3))
    if grouped:
        passes += [
            ("relayout", d, 2 * queries, 0.0),  # the queries out of the fused projection
            ("relayout", d, 2 * 2 * queries, 0.0, 2),  # keys, values repeated per head
            ("relayout", d, 2 * kv, 2 * kv),  # values made contiguous; a gradient back
            ("relayout", d, 0.0, 2 * (queries + kv), 2),  # the repeats' gradients summed
        ]
    elif rates.megapp_layers and rope and fused:
        # RoPE leaves q and k contiguous and v a strided view: the fused attention copies
        # it to contiguous in its forward and again in its backward
        passes.append(("relayout", d, 2 * kv, 2 * kv))
    # the activation ([gate | up] → out; dy, x → dx); the experts' is among their passes
    activation = None
    if dense_mlp and gated:
        activation = ("bias_swiglu", ffn, 3 * tokens * ffn * w, 5 * tokens * ffn * w)
    elif dense_mlp:
        activation = ("bias_gelu", ffn, 2 * tokens * ffn * w, 3 * tokens * ffn * w)
    passes += [activation] if activation else []
    if rope:  # queries, keys
        passes.append(("rope", d, 2 * tokens * heads * d * w, 2 * tokens * heads * d * w))
        passes.append(("rope", d, 2 * tokens * groups * d * w, 2 * tokens * groups * d * w))
    if gpt.add_bias_linear or gpt.add_qkv_bias:  # the QKV bias's gradient: a sum over rows
        passes.append(("copy", 0, 0.0, tokens * (heads + 2 * groups) * d * w))
    rebuilt = []
    if rebuilds_inputs(gpt, rates):
        # each norm's output for the linear after it, and its statistics again; the
        # relayout for the output projection; the activation's output for fc2
        rebuilt = [(norm, h, 2 * rows * h * w)] * REBUILT_NORM_PASSES
        rebuilt += [("relayout", d, relayout)] if relayout else []
        rebuilt += [activation[:3]] if activation else []
    passes = [p if len(p) > 4 else (*p, 1) for p in passes]  # (..., calls)
    timed_passes = [rates.kernel(*p) for p in passes]
    timed_passes += [(0.0, rates.kernel(op, width, f, 0.0)[0]) for op, width, f in rebuilt]
    memory = tuple(sum(column) for column in zip(*timed_passes, strict=True))
    params = h * (heads + 2 * groups) * d + heads * d * h + (3 if gated else 2) * h * ffn
    tensors = parameter_tensors(gpt) - (0 if dense_mlp else 2 + 2 * gpt.add_bias_linear)
    accumulate = _accumulate_seconds(params, tensors, w, rates)
    # the core: one fused kernel each way, or the materialized scores' batched matmuls
    # (their softmax passes' gaps are in its memory())
    core = (1, 1) if gpt.attention_backend == "sdpa" else (2, 4)
    gap = rates.kernel_overhead
    kernels = (
        len(linears) + core[0] + sum(p[4] for p in passes if p[2]),
        len(linears) + core[1] + sum(p[4] for p in passes if p[3]) + len(rebuilt),
        len(linears) + tensors * (w < 4),
    )
    parts = {
        "matmul": (matmul[0], matmul[1], matmul[2]),
        "attention": (core_f, core_b, 0.0),
        "memory": (memory[0], memory[1], 0.0),
        "grad_accumulation": (0.0, 0.0, accumulate),
        "gaps": (kernels[0] * gap, kernels[1] * gap, kernels[2] * gap),
    }
    return parts, kernels


REBUILT_NORM_PASSES = 4  # two norms, each rebuilding its output and its statistics


def rebuilds_inputs(gpt: GPTConfig, rates: OpRates) -> bool:
    """Whether a layer priced with ``rates`` rebuilds saved inputs in backward: megapp's
    layers do, unless recomputed whole (then the rerun forward is priced instead)."""
    return rates.megapp_layers and gpt.recompute_granularity != "full"


def _accumulate_seconds(params: int, tensors: int, width: int, rates: OpRates) -> float:
    """16-bit weight gradients of ``params`` parameters in ``tensors`` tensors added into
    their fp32 ``main_grad`` (read both, write fp32; nothing in fp32 training)."""
    if width >= 4 or params == 0:
        return 0.0
    return rates.kernel("add", 0, 0.0, params * (width + 8), calls=tensors)[1]


def expert_parts(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, rates: OpRates, imbalance: float = 1.0
) -> dict[str, tuple[float, float, float]]:
    """A mixture-of-experts MLP's matmuls on one rank, as (forward, input gradient, weight
    gradient): the router's ``[T, h] × [h, E]`` in fp32 and the ``L = E/ep`` local experts'
    two linear layers, each a grouped matmul of ``L`` products over ``R·etp/L`` rows (the
    ``R = T·k`` routed rows balanced over the experts, times ``imbalance``, gathered over
    the etp ranks) with tiles and waves counted over all of them; and the experts' and the
    router's weight gradients added into ``main_grad``. The memory-bound passes are
    :func:`~megapp.planning.layer_costs.moe_memory_bytes`'."""
    h, w, experts = gpt.hidden_size, _width(gpt), gpt.num_moe_experts
    rows = moe_routed_rows(gpt, seq_length // gpt.context_parallel_size, micro_batch_size)
    tokens = rows // gpt.moe_router_topk
    etp, local = gpt.expert_tensor_parallel_size, experts // gpt.expert_model_parallel_size
    f = gpt.moe_ffn_hidden_size // etp
    f1 = f * (2 if gpt.activation == "swiglu" else 1)
    m = math.ceil(rows * etp * imbalance / local)
    timed = [rates.linear(tokens, h, experts, 4)]  # the router, on its fp32 input copy
    for inputs, outputs in ((h, f1), (f, h)):
        timed.append(
            (
                rates.matmul(m, outputs, inputs, w, local),
                rates.matmul(m, inputs, outputs, w, local),
                rates.matmul(inputs, outputs, m, w, local),
            )
        )
    matmul = tuple(sum(column) for column in zip(*timed, strict=True))
    accumulate = _accumulate_seconds(local * h * (f1 + f), 2, w, rates)
    gaps = tuple(n * rates.kernel_overhead for n in EXPERT_KERNELS)
    return {"matmul": matmul, "grad_accumulation": (0.0, 0.0, accumulate), "gaps": gaps}


# a mixture-of-experts MLP's matmul and accumulation kernels in forward, input gradient and
# weight gradient (:func:`expert_parts`): the router's and the two grouped expert matmuls;
# the experts' two weights' and the router's accumulations
EXPERT_KERNELS = (3, 3, 5)


def layer_parts_with_experts(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, rates: OpRates, imbalance: float = 1.0
) -> dict[str, tuple[float, float, float]]:
    """A mixture-of-experts layer's seconds on one rank by kind of work, as
    :func:`layer_parts` gives a dense one's: its attention half's (``dense_mlp=False``) with
    its experts' :func:`expert_parts` added kind by kind (their memory-bound passes apart)."""
    return _priced_moe_layer(gpt, seq_length, micro_batch_size, rates, imbalance)[0]


def _priced_moe_layer(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, rates: OpRates, imbalance: float
) -> tuple[dict[str, tuple[float, float, float]], tuple[int, int, int]]:
    parts, kernels = _priced_layer(gpt, seq_length, micro_batch_size, rates, False)
    experts = expert_parts(gpt, seq_length, micro_batch_size, rates, imbalance)
    for kind, seconds in experts.items():
        parts[kind] = tuple(a + b for a, b in zip(parts[kind], seconds, strict=True))
    kernels = tuple(a + b for a, b in zip(kernels, EXPERT_KERNELS, strict=True))
    return parts, kernels


def parameter_tensors(gpt: GPTConfig) -> int:
    """Parameter tensors of one dense layer: four weights, their biases, the norms'."""
    norms = 2 * (2 if gpt.normalization == "LayerNorm" else 1)
    return 4 + 4 * gpt.add_bias_linear + norms


def layer_seconds(
    gpt: GPTConfig,
    seq_length: int,
    micro_batch_size: int,
    rates: OpRates,
    *,
    experts: bool = False,
    imbalance: float = 1.0,
) -> LayerSeconds:
    """One dense layer's forward, input gradient and weight gradient on one rank, without
    recompute (the time model adds a rerun's forward to the input gradient); with
    ``experts`` a mixture-of-experts layer's, its MLP :func:`expert_parts` (their
    memory-bound passes apart). A pass lasts the longer of its device time and its kernels'
    host launches."""
    if experts:
        parts, kernels = _priced_moe_layer(gpt, seq_length, micro_batch_size, rates, imbalance)
    else:
        parts, kernels = _priced_layer(gpt, seq_length, micro_batch_size, rates, True)
    device = (sum(column) for column in zip(*parts.values(), strict=True))
    host = (n * rates.launch_overhead for n in kernels)
    f, i, w = (max(d, h) for d, h in zip(device, host, strict=True))
    return LayerSeconds(f, i, w, core_forward=parts["attention"][0])


def logits_seconds(gpt: GPTConfig, tokens: int, vocab: int, rates: OpRates) -> LayerSeconds:
    """The output layer's ``[T, h] × [h, V/tp]`` (its fp32 loss passes are priced apart)."""
    tp, w = gpt.tensor_model_parallel_size, _width(gpt)
    f, i, wg = rates.linear(tokens, gpt.hidden_size, vocab // tp, w)
    gap = rates.kernel_overhead  # after each of its three matmuls
    return LayerSeconds(forward=f + gap, input_grad=i + gap, weight_grad=wg + gap)
