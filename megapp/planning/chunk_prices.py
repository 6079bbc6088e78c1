"""What one microbatch costs through a chunk of a model's layers on a device, whatever the
placement, the data-parallel size and the ZeRO stage (:class:`ChunkPrices`): the per-layer
half of :func:`~megapp.planning.timing.action_costs`, computed once per model and
micro-batch size and shared by every layout a search prices with them; the layout's own
half (ZeRO's transfers, the ranks' tails) stays in ``action_costs``."""

from __future__ import annotations

from megapp.models.gpt import GPTConfig, placement_layer_ranges
from megapp.planning.hardware import Hardware
from megapp.planning.layer_costs import (
    compute_seconds,
    context_parallel_seconds,
    layer_flops,
    moe_compute_seconds,
    moe_layer_seconds,
    moe_memory_seconds,
    tensor_parallel_seconds,
)
from megapp.planning.model_state import end_chunk_parameters, moe_layer_count
from megapp.planning.operations import LayerSeconds


class ChunkPrices:
    """What one microbatch costs through a chunk of ``gpt``'s layers on ``hardware``,
    whatever the placement, the data-parallel size and the ZeRO stage: every layer's
    prices are computed once, and each kind of chunk (its layers, and whether it holds
    the embedding or the output layer and the loss) when first asked for."""

    def __init__(
        self, gpt: GPTConfig, seq_length: int, micro_batch_size: int, hardware: Hardware
    ) -> None:
        self.gpt, self.seq_length, self.hardware = gpt, seq_length, hardware
        self.micro_batch_size = micro_batch_size
        s, b = seq_length, micro_batch_size
        tokens = s // gpt.context_parallel_size * b
        vocab, tp = gpt.padded_vocab_size, gpt.tensor_model_parallel_size
        self.logits = 2.0 * tokens * gpt.hidden_size * vocab / tp
        self.loss_seconds = 5 * 4 * tokens * vocab / tp / hardware.memory_bandwidth  # fp32
        self.lin, self.core = lin, core = layer_flops(gpt, s, b)
        self.rerun = {"full": lin + core, "selective": core}.get(gpt.recompute_granularity, 0.0)
        self.one, self.output = compute_seconds(gpt, s, b, vocab, hardware)
        self.rerun_s = rerun_seconds(gpt, self.one)
        cp_f, cp_b, cp_calls_f, cp_calls_b = context_parallel_seconds(
            gpt, s, b, hardware, self.one.core_forward
        )
        if gpt.recompute_granularity in ("full", "selective"):  # the rerun moves them again
            cp_b, cp_calls_b = cp_b + cp_f, cp_calls_b + cp_calls_f
        self.cp = (cp_f, cp_b, cp_calls_f, cp_calls_b)
        self.moe_lin, self.a2a, self.moe_mem_f, self.moe_mem_b = 0.0, 0.0, 0.0, 0.0
        self.moe_one, self.moe_rerun_s = self.one, self.rerun_s  # an expert layer's compute
        if gpt.num_moe_experts is not None:
            self.moe_lin, self.a2a = moe_layer_seconds(gpt, s, b, hardware)
            self.moe_mem_f, self.moe_mem_b = moe_memory_seconds(gpt, s, b, hardware)
            self.moe_one = moe_compute_seconds(gpt, s, b, hardware, self.one)
            self.moe_rerun_s = rerun_seconds(gpt, self.moe_one)
        self.moe_rerun = self.moe_lin if gpt.recompute_granularity == "full" else 0.0
        if gpt.recompute_granularity == "full":  # the rerun forward's passes, in the backward
            self.moe_mem_b += self.moe_mem_f
        self._chunks: dict[tuple[int, bool, bool], tuple[int, tuple[float, ...]]] = {}
        self._layers: dict[tuple[tuple[int, ...], ...], tuple[int, ...]] = {}

    def stage_layers(self, placement: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
        """Every virtual stage's layer count under ``placement``, as megapp builds it."""
        if placement not in self._layers:
            ranges = placement_layer_ranges(self.gpt, placement)
            self._layers[placement] = tuple(len(r) for r in ranges)
        return self._layers[placement]

    def chunk(self, layers: int, first: bool, last: bool) -> tuple[int, tuple[float, ...]]:
        """Parameters and (F, I, W seconds, the fixed cost of an action, F, I, W FLOPs, tp
        seconds in F, in I, tp calls in F, in I, cp seconds in F, in I, cp transfers in F,
        in I) of one chunk, before ZeRO's transfers."""
        key = (layers, first, last)
        if key not in self._chunks:
            self._chunks[key] = self._price(layers, first, last)
        return self._chunks[key]

    def seconds(self, layers: int, first: bool, last: bool) -> tuple[float, float, float]:
        """Seconds of one microbatch's forward, input gradient and weight gradients through
        a chunk, before ZeRO's transfers (which only lengthen them); a whole backward is
        the two less one action's fixed cost."""
        _, (f_s, i_s, w_s, fixed, *_) = self.chunk(layers, first, last)
        return f_s, i_s, w_s - fixed

    def _price(self, layers: int, first: bool, last: bool) -> tuple[int, tuple[float, ...]]:
        gpt, hardware = self.gpt, self.hardware
        lin, core, rerun, logits = self.lin, self.core, self.rerun, self.logits
        one, output, rerun_s = self.one, self.output, self.rerun_s
        moe_one, moe_lin, moe_rerun_s, a2a = self.moe_one, self.moe_lin, self.moe_rerun_s, self.a2a
        cp_f, cp_b, cp_calls_f, cp_calls_b = self.cp
        chunk_params = end_chunk_parameters(gpt, layers, first, last)
        moe = moe_layer_count(gpt, layers)
        f = layers * (lin + core) + moe * moe_lin + logits * last
        i = layers * (lin + 2 * core + rerun) + moe * (moe_lin + self.moe_rerun) + logits * last
        w = layers * lin + moe * moe_lin + logits * last
        tp_f, tp_b, calls_f, calls_b = tensor_parallel_seconds(
            gpt, self.seq_length, self.micro_batch_size, layers, first, last, hardware
        )
        fixed = hardware.action_overhead + layers * hardware.layer_overhead
        loss = self.loss_seconds * last
        f_s = layers * one.forward + output.forward * last
        f_s += moe * (moe_one.forward - one.forward + self.moe_mem_f)
        f_s += fixed + tp_f + layers * cp_f + 3 / 5 * loss + moe * a2a
        rerun_passes = (
            layers * hardware.layer_overhead if gpt.recompute_granularity == "full" else 0
        )
        i_s = layers * (one.input_grad + rerun_s) + output.input_grad * last
        i_s += moe * (moe_one.input_grad - one.input_grad + moe_rerun_s - rerun_s + self.moe_mem_b)
        i_s += fixed + rerun_passes + tp_b + layers * cp_b
        i_s += 2 / 5 * loss + moe * a2a * (2 if gpt.recompute_granularity == "full" else 1)
        w_s = layers * one.weight_grad + output.weight_grad * last + fixed
        w_s += moe * (moe_one.weight_grad - one.weight_grad)
        cp_seconds = (layers * cp_f, layers * cp_b, layers * cp_calls_f, layers * cp_calls_b)
        values = (f_s, i_s, w_s, fixed, f, i, w, tp_f, tp_b, calls_f, calls_b, *cp_seconds)
        return chunk_params, values


_PRICES: dict[tuple, ChunkPrices] = {}


def chunk_prices(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, hardware: Hardware
) -> ChunkPrices:
    """The :class:`ChunkPrices` of ``gpt`` on ``hardware``, kept for the configs a search
    asks for again (known by identity: a search keeps its configs and profile)."""
    key = (id(gpt), seq_length, micro_batch_size, id(hardware))
    prices = _PRICES.get(key)
    if prices is None or prices.gpt is not gpt or prices.hardware is not hardware:
        if len(_PRICES) >= 1024:
            _PRICES.clear()
        prices = _PRICES[key] = ChunkPrices(gpt, seq_length, micro_batch_size, hardware)
    return prices


def rerun_seconds(gpt: GPTConfig, layer: LayerSeconds) -> float:
    """What recompute reruns of ``layer`` in its backward: the whole forward (full), the
    attention core's (selective), or nothing."""
    return {"full": layer.forward, "selective": layer.core_forward}.get(
        gpt.recompute_granularity, 0.0
    )
