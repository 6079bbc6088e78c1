"""The live-tensor counter counts exactly what is allocated and freed, and a transformer
layer holds after its forward exactly the activation bytes the planner predicts."""

from __future__ import annotations

import pytest
import torch

from megapp.planning.activations import layer_activation_bytes
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.training.live_memory import LiveTensorMemory
from megapp.transformer import TransformerConfig, TransformerLayer


def test_counts_allocations_once_and_forgets_freed_ones():
    kept = torch.zeros(1000)  # alive before: part of the start, not of the growth
    with LiveTensorMemory() as memory:
        a = torch.ones(256)  # 1 KiB
        view = a[:10].view(2, 5)  # a view: no new storage
        b = torch.ones(512)  # 2 KiB
        del b
        c = torch.ones(128)  # 512 B, after b was freed
    assert memory.start >= kept.numel() * 4
    assert memory.peak - memory.start == 1024 + 2048
    memory.sweep()
    assert memory.current() - memory.start == 1024 + 512
    del view, c


def test_a_storage_resized_in_place_counts_at_its_size():
    bucket = torch.zeros(0)
    storage = bucket.untyped_storage()
    with LiveTensorMemory([storage]) as memory:
        storage.resize_(4096)
        torch.ones(1)  # the next operator reads the resized storage
        storage.resize_(0)
        torch.ones(1)
    assert memory.peak - memory.start == 4096 + 4


# slow: the planner's activation bytes stay fast in test_planning_memory and
# test_planning_activations
@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"activation": "swiglu", "normalization": "RMSNorm", "position_embedding_type": "rope"},
        {"recompute_granularity": "selective"},
        {"attention_backend": "fused_softmax"},
    ],
    ids=["gpt", "llama", "selective", "fused softmax"],
)
def test_a_layer_holds_what_the_planner_predicts(settings):
    """Measured by the counter (every live storage, whoever holds it), not by the
    saved-tensor hooks the activation audit reads: a tensor kept alive by anything else
    (a hook's closure, a cache) shows up here."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **settings,
    )
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    layer = TransformerLayer(config, 0)
    s, b = 32, 2
    kwargs = {}
    if config.position_embedding_type == "rope":
        from megapp.fusions.rope import rotary_freqs

        kwargs["rotary_freqs"] = rotary_freqs(s, config.kv_channels)
    x = torch.randn(s, b, config.hidden_size, requires_grad=True)
    with LiveTensorMemory() as memory:
        y = layer(x, **kwargs)
        memory.sweep()
        held = memory.current() - memory.start
    # the layer's input x was allocated before; its output y is the next layer's input
    assert held == layer_activation_bytes(config, s, b) - x.nbytes + y.nbytes


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "s, b, hidden, ffn, activation, groups, settings, dtype, moment",
    [
        (256, 1, 96, 200, "gelu", 4, {"add_bias_linear": True}, F32, "the second matmul's"),
        (256, 1, 96, 200, "gelu", 4, {}, BF16, "the second matmul's"),
        (256, 1, 96, 200, "swiglu", 4, {"add_bias_linear": True}, F32, "SwiGLU's"),
        (64, 1, 128, 512, "swiglu", 4, {}, F32, "the first matmul's"),
        (32, 2, 256, 512, "gelu", 4, {}, F32, "the second matmul's, two sequences"),
        (64, 1, 256, 64, "gelu", 4, {}, F32, "the QKV matmul's"),
        (64, 1, 256, 64, "swiglu", 2, {"position_embedding_type": "rope"}, F32,
         "the QKV matmul's, grouped queries, RoPE"),
        (64, 1, 256, 64, "gelu", 4, {"recompute_granularity": "selective"}, F32,
         "the QKV matmul's, selective recompute"),
        (64, 1, 256, 64, "gelu", 1, {}, F32, "the projection's, one key/value group"),
    ],
)  # fmt: skip
def test_a_layer_backward_works_in_the_predicted_bytes(
    s, b, hidden, ffn, activation, groups, settings, dtype, moment
):
    """A dense layer's backward peaks above what it held by the planner's working bytes,
    whichever of its moments is the peak (``moment``): within 0.7%, the norms' statistics
    and the attention's log-sum-exp it frees on the way. Counted on a second step, the
    weights' gradients added into buffers that exist, as into a data-parallel buffer."""
    from megapp.planning.layer_working import dense_backward_bytes

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, num_query_groups=groups,
        ffn_hidden_size=ffn, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        activation=activation, **settings,
    )  # fmt: skip
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    layer = TransformerLayer(config, 0)
    kwargs = {}
    if config.position_embedding_type == "rope":
        from megapp.fusions.rope import rotary_freqs

        kwargs["rotary_freqs"] = rotary_freqs(s, config.kv_channels)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(2):
        y = layer(torch.randn(s, b, hidden, dtype=dtype, requires_grad=True), **kwargs)
        grad = torch.randn_like(y)
        with LiveTensorMemory() as memory:
            y.backward(grad)
    working = dense_backward_bytes(config, s, b)
    assert memory.peak - memory.start == pytest.approx(working, rel=0.007)


@pytest.mark.parametrize(
    "tokens, hidden, width, experts, topk, activation, dtype, moment",
    [
        (384, 160, 32, 8, 2, "swiglu", torch.float32, "the weighted sum's"),
        (1024, 64, 64, 8, 8, "gelu", torch.bfloat16, "the weighted sum's, widened"),
        (256, 128, 256, 8, 2, "gelu", torch.float32, "the second matmul's"),
        (256, 128, 256, 8, 2, "swiglu", torch.bfloat16, "the two matmuls', alike"),
        (128, 96, 320, 16, 4, "swiglu", torch.float32, "the first matmul's"),
        (256, 64, 512, 2, 2, "swiglu", torch.float32, "the activation's"),
    ],
)
def test_a_moe_layer_backward_works_in_the_predicted_bytes(
    tokens, hidden, width, experts, topk, activation, dtype, moment
):
    """A mixture-of-experts layer's backward peaks above what it held by the planner's
    working bytes, whichever of its moments is the peak (``moment``): within 0.5%, the
    routing's [T, k] and [E] tensors it frees on the way. Counted on a second step, the
    weights' gradients added into buffers that exist, as into a data-parallel buffer."""
    from megapp.models import GPTConfig
    from megapp.moe.layer import MoELayer
    from megapp.planning.layer_working import moe_backward_bytes

    config = GPTConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, vocab_size=257,
        max_position_embeddings=32, ffn_hidden_size=2 * hidden, activation=activation,
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width,
        params_dtype=dtype, add_bias_linear=False,
    )  # fmt: skip
    torch.manual_seed(5)
    layer = MoELayer(config.moe_config())
    x = torch.randn(tokens, 1, hidden, dtype=dtype)
    assert layer.experts.uses_grouped_mm(x.view(tokens, hidden)), "the priced kernels"
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(2):
        y, _ = layer(x.clone().requires_grad_())
        grad = torch.randn_like(y)
        with LiveTensorMemory() as memory:
            y.backward(grad)
    working = moe_backward_bytes(config, tokens, 1)
    assert memory.peak - memory.start == pytest.approx(working, rel=0.005)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("ends", [None, (32, 128), (96, 128)], ids=["square", "ag0", "ag1"])
def test_fused_attention_blocks_work_in_the_predicted_bytes(dtype, heads, kv_heads, ends):
    """Context-parallel attention in fused blocks, as a CPU runs it: a2a's one causal
    square, or the all-gather's two query chunks each seeing the keys up to its end. Its
    forward peaks above the start by the planner's working bytes, the output and the
    log-sum-exp, and its backward by the working bytes, to the byte."""
    from megapp.context_parallel.blocks import attend_in_tiles
    from megapp.planning.attention_working import fused_attention_working_bytes

    b, d = 2, 16
    sq, sk = (128, 128) if ends is None else (64, 128)
    q = torch.randn(b, heads, sq, d, dtype=dtype, requires_grad=True)
    kv = torch.randn(2, b, kv_heads, sk, d, dtype=dtype, requires_grad=True)
    grad = torch.randn(b, heads, sq, d, dtype=dtype)
    with LiveTensorMemory() as forward:
        out = attend_in_tiles(q, kv, 0.25, True, 8, ends, fused=True)
    with LiveTensorMemory() as backward:
        out.backward(grad)
    if ends is None:
        calls = [(sq, sk, False)]
    else:  # each chunk's keys before its diagonal, then the diagonal merged into them
        chunk = sq // 2
        calls = []
        for end in ends:
            before = [(chunk, end - chunk, False)] if end > chunk else []
            calls += [*before, (chunk, chunk, bool(before))]
    w, c = dtype.itemsize, 4
    shape = (b, heads, kv_heads, d, w, c)
    lse = b * heads * sq * c
    working = fused_attention_working_bytes(*shape, False, sq, sk, calls)
    assert forward.peak - forward.start == working + out.nbytes + lse
    working = fused_attention_working_bytes(*shape, True, sq, sk, calls)
    assert backward.peak - backward.start == working
