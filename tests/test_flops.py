"""megapp.training.flops: the model FLOPs of a GPT iteration against counts done by hand, and
the GPU peak table against the data-sheet figures of the names torch reports."""

from __future__ import annotations

import pytest
import torch

from megapp.models.gpt import GPTConfig
from megapp.training import metrics
from megapp.training.flops import gpt_training_flops, gpu_peak, hbm_peak_tbps, peak_16bit_tflops


def test_standard_gpt_by_hand_and_by_the_closed_form():
    # l 2, h 8, 2 heads of 4, MLP 32, s 4, V 10, 2 sequences (8 tokens). Per token and layer:
    # QKV 2·8·(2 + 4)·4 = 384, q·kᵀ and p·v 4·4·2·4 = 128, projection 2·2·4·8 = 128,
    # MLP 4·8·32 = 1024: 1664; two layers 3328, logits 2·8·10 = 160: 3488 per token;
    # × 8 tokens × 3 = 83712.
    gpt = GPTConfig(
        num_layers=2, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2,
        num_query_groups=2, kv_channels=4, vocab_size=10,
    )  # fmt: skip
    flops = gpt_training_flops(gpt, seq_length=4, tokens=8)
    assert flops == 83712
    b, s, l, h, v = 2, 4, 2, 8, 10
    assert flops == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))


def test_grouped_query_attention_and_swiglu_by_hand():
    # l 1, h 8, 4 heads of 2 sharing 1 key/value group, MLP 12 with SwiGLU, s 3, V 5, 6 tokens:
    # QKV 2·8·(4 + 2)·2 = 192, attention 4·3·4·2 = 96, projection 2·4·2·8 = 128,
    # MLP 6·8·12 = 576, logits 2·8·5 = 80: 1072 per token; × 6 × 3 = 19296.
    gpt = GPTConfig(
        num_layers=1, hidden_size=8, ffn_hidden_size=12, num_attention_heads=4,
        num_query_groups=1, kv_channels=2, activation="swiglu", vocab_size=5,
    )  # fmt: skip
    assert gpt_training_flops(gpt, seq_length=3, tokens=6) == 19296


def test_gpt2_small_iteration():
    # 12 layers, h 768, V 50304, s 1024, 32 sequences: 6·N·T + 12·l·s·h·T ≈ 28.0 TFLOP.
    gpt = GPTConfig(
        num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
        num_query_groups=12, kv_channels=64, vocab_size=50304,
    )  # fmt: skip
    assert gpt_training_flops(gpt, seq_length=1024, tokens=32 * 1024) == 28_005_334_253_568


def test_the_vocabulary_is_padded_as_the_model_pads_it():
    """V 10 padded to a multiple of 4 × tp 2: 16 rows, 2·8·(16 − 10) more FLOPs per token
    (× 8 tokens × 3) than the unpadded vocabulary of the first case."""
    gpt = GPTConfig(
        num_layers=2, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2,
        vocab_size=10, make_vocab_size_divisible_by=4, tensor_model_parallel_size=2,
    )  # fmt: skip
    assert gpt_training_flops(gpt, seq_length=4, tokens=8) == 83712 + 2 * 8 * 6 * 8 * 3


@pytest.mark.parametrize(
    "name, tflops, tbps",
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 3.35),
        ("NVIDIA H100 PCIe", 756.0, 2.0),
        ("NVIDIA H100 NVL", 835.0, 3.9),
        ("NVIDIA H200", 989.0, 4.8),
        ("NVIDIA GH200 480GB", 989.0, None),
        ("NVIDIA A100-SXM4-40GB", 312.0, 1.555),
        ("NVIDIA A100-PCIE-40GB", 312.0, 1.555),
        ("NVIDIA A100-SXM4-80GB", 312.0, 2.039),
        ("NVIDIA A100 80GB PCIe", 312.0, 1.935),
        ("NVIDIA B200", 2250.0, 8.0),
    ],
)
def test_peaks_by_device_name(name, tflops, tbps):
    assert peak_16bit_tflops(name) == tflops
    assert hbm_peak_tbps(name) == tbps


def test_unknown_devices_have_no_peak():
    assert gpu_peak("NVIDIA GeForce RTX 4090") is None
    assert peak_16bit_tflops("NVIDIA GeForce RTX 4090") is None
    assert hbm_peak_tbps("cpu") is None


def test_the_training_log_uses_the_same_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cuda = torch.device("cuda", 0)
    assert metrics.peak_tflops(cuda, torch.bfloat16) == 756.0  # not the SXM part's 989
    assert metrics.peak_tflops(cuda, torch.float32) is None
    assert metrics.peak_tflops(torch.device("cpu"), torch.bfloat16) is None
