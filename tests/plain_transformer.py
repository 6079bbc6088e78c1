"""A transformer layer written with plain torch ops only: the oracle for the fused one.

It reads the full (unsharded) weights of a tensor-parallel-size-1 megapp layer,
so both compute the same function with the same parameters.
"""

import math

import torch
import torch.nn.functional as F


def _norm(x, norm, kind, eps):
    if kind == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], norm.weight, getattr(norm, "bias", None), eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight


def _rope(x, freqs):
    rot = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    out = x_rot * freqs.cos().to(x.dtype) + rotated * freqs.sin().to(x.dtype)
    return torch.cat([out, x_pass], dim=-1)


def plain_layer(layer, x, config, rotary_freqs=None):
    """``layer`` is a megapp TransformerLayer built with tensor_model_parallel_size 1."""
    eps, kind = config.layernorm_epsilon, config.normalization
    attn, mlp = layer.self_attention, layer.mlp
    s, b, _ = x.shape
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels

    normed = _norm(x, layer.input_layernorm, kind, eps)
    mixed = F.linear(normed, attn.linear_qkv.weight, attn.linear_qkv.bias)
    mixed = mixed.view(s, b, groups, heads // groups + 2, d)
    q, k, v = mixed.split([heads // groups, 1, 1], dim=3)
    q = q.reshape(s, b, heads, d)
    k = k.squeeze(3).repeat_interleave(heads // groups, dim=2)
    v = v.squeeze(3).repeat_interleave(heads // groups, dim=2)
    if rotary_freqs is not None:
        q, k = _rope(q, rotary_freqs), _rope(k, rotary_freqs)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    context = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    attn_out = F.linear(context, attn.linear_proj.weight, attn.linear_proj.bias)
    x = x + attn_out

    normed = _norm(x, layer.pre_mlp_layernorm, kind, eps)
    inner = F.linear(normed, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    if config.activation == "swiglu":
        gate, up = inner.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(inner, approximate="tanh")
    return x + F.linear(hidden, mlp.linear_fc2.weight, mlp.linear_fc2.bias)
