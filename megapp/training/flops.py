"""Model FLOPs of a GPT training iteration, and the peak throughput of the GPUs it runs on.

Plain arithmetic on the model's own config, with no argparse namespace or process group, so
the training log (:mod:`megapp.training.metrics`), the benchmarks and the planner's cost
model count the same way:

* :func:`gpt_training_flops`: model FLOPs of one iteration (what the model needs; the second
  forward of activation recompute is not counted, so figures compare across recompute
  settings), read from a :class:`~megapp.models.GPTConfig`; :func:`layer_flops` is one
  layer's share per token, which the planner splits over its actions;
* :data:`GPU_PEAKS`: each GPU part's dense 16-bit tensor-core peak and HBM bandwidth from the
  vendor's data sheet, matched against ``torch.cuda.get_device_name()`` by
  :func:`gpu_peak`, :func:`peak_16bit_tflops` and :func:`hbm_peak_tbps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megapp.models.gpt import GPTConfig
    from megapp.transformer.config import TransformerConfig


def layer_flops(config: TransformerConfig, seq_length: int) -> tuple[int, int]:
    """Forward FLOPs per token of one whole layer (2 per multiply-add), in sequences of
    ``seq_length``: ``(linear, attention_core)``, its matmuls with weights and attention's
    q·kᵀ and p·v.

    With ``h`` = hidden_size, ``a`` heads of ``d`` = kv_channels, ``g`` query groups, MLP
    width ``f`` and sequence ``s``::

        linear: QKV 2·h·(a + 2g)·d + projection 2·a·d·h + MLP 4·h·f (6·h·f with SwiGLU's gate)
        core:   q·kᵀ 2·s·a·d + p·v 2·s·a·d

    Attention is counted over the full s × s square, causal or not, as Megatron-LM and PaLM
    count it.
    """
    h, d, s = config.hidden_size, config.kv_channels, seq_length
    a, g = config.num_attention_heads, config.num_query_groups
    mlp = (6 if config.activation == "swiglu" else 4) * h * config.ffn_hidden_size
    return 2 * h * (a + 2 * g) * d + 2 * a * d * h + mlp, 4 * s * a * d


def gpt_training_flops(config: GPTConfig, seq_length: int, tokens: int) -> float:
    """Model FLOPs of one training iteration (forward and backward) of the GPT ``config``
    over ``tokens`` tokens in sequences of ``seq_length``: every layer's
    :func:`layer_flops` and the logits' ``2·h·V`` per token (``V`` the vocabulary padded as
    the model pads it), three times (backward costs twice the forward). For the standard
    GPT (a = g, d = h / a, f = 4h, no SwiGLU) with B sequences this equals
    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. Mixture-of-experts layers count
    :func:`moe_mlp_flops` for their MLP.
    """
    linear, core = layer_flops(config, seq_length)
    per_token = config.num_layers * (linear + core) + 2 * config.hidden_size * (
        config.padded_vocab_size
    )
    if getattr(config, "num_moe_experts", None) is not None:
        moe_layers = sum(config.is_moe_layer(n) for n in range(config.num_layers))
        per_token += moe_layers * (moe_mlp_flops(config) - _mlp(config, config.ffn_hidden_size))
    return 3.0 * per_token * tokens


def _mlp(config: TransformerConfig, width: int) -> int:
    return (6 if config.activation == "swiglu" else 4) * config.hidden_size * width


def moe_mlp_flops(config: TransformerConfig) -> int:
    """Forward FLOPs per token of a mixture-of-experts MLP: the router ``2·h·E``, the ``k``
    experts it picks (each an MLP of width ``moe_ffn_hidden_size``) and the shared expert;
    a dropless count (capacity drops only lower it)."""
    shared = config.moe_shared_expert_intermediate_size
    experts = config.moe_router_topk * _mlp(config, config.moe_ffn_hidden_size)
    router = 2 * config.hidden_size * config.num_moe_experts
    return router + experts + (_mlp(config, shared) if shared else 0)


gpt_config_training_flops = gpt_training_flops  # the name pretrain_gpt.py and the benchmarks use


@dataclass(frozen=True)
class GpuPeak:
    """The vendor's peak figures of one GPU part."""

    part: str  # the part as its data sheet names it
    names: tuple[str, ...]  # all of these appear in its upper-cased torch.cuda.get_device_name()
    dense_16bit_tflops: float  # BF16/FP16 tensor cores, dense (without 2:4 sparsity), TFLOP/s
    hbm_tbps: float | None  # HBM bandwidth, TB/s (10¹² bytes/s); None where parts differ


# First match wins, so a name that contains another part's (GH200 holds H200, an H100 PCIe
# holds H100) comes before it. Sources: NVIDIA's data sheets (H100 SXM/PCIe/NVL, H200 SXM/NVL,
# A100 40/80 GB, HGX B200, GB200 NVL72), whose 16-bit figures are given with sparsity: halved.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("H100 PCIe", ("H100", "PCIE"), 756.0, 2.0),
    GpuPeak("H100 NVL", ("H100", "NVL"), 835.0, 3.9),
    GpuPeak("H100 SXM", ("H100",), 989.0, 3.35),
    GpuPeak("GH200", ("GH200",), 989.0, None),  # 4.0 TB/s with HBM3, 4.9 with HBM3e
    GpuPeak("H200 NVL", ("H200", "NVL"), 835.0, 4.8),
    GpuPeak("H200 SXM", ("H200",), 989.0, 4.8),
    GpuPeak("A100 80GB PCIe", ("A100", "80GB", "PCIE"), 312.0, 1.935),
    GpuPeak("A100 80GB SXM", ("A100", "80GB"), 312.0, 2.039),
    GpuPeak("A100 40GB", ("A100",), 312.0, 1.555),
    GpuPeak("GB200", ("GB200",), 2500.0, 8.0),
    GpuPeak("B200", ("B200",), 2250.0, 8.0),
)


def gpu_peak(device_name: str) -> GpuPeak | None:
    """The :data:`GPU_PEAKS` row of a ``torch.cuda.get_device_name()``, or None if unknown."""
    name = device_name.upper()
    return next((row for row in GPU_PEAKS if all(n in name for n in row.names)), None)


def peak_16bit_tflops(device_name: str) -> float | None:
    """Dense BF16/FP16 peak in TFLOP/s of the named device, or None if unknown."""
    row = gpu_peak(device_name)
    return None if row is None else row.dense_16bit_tflops


def hbm_peak_tbps(device_name: str) -> float | None:
    """HBM bandwidth in TB/s of the named device, or None if unknown."""
    row = gpu_peak(device_name)
    return None if row is None else row.hbm_tbps
