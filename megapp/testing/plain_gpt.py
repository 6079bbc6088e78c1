"""megapp's GPT in plain PyTorch ops: the oracle the fused layers are tested against and the
baseline the GPT benchmark (``tools/benchmarks/bench_gpt.py``) times megapp against.

Both uses share the ops below (:func:`norm`, :func:`rope`, :func:`activation`), written with
``torch.nn.functional`` only: no hooks, no autograd Functions of their own, nothing saved or
recomputed beyond what autograd does.

* :func:`plain_layer` recomputes one megapp ``TransformerLayer`` (tensor-parallel size 1)
  from its own weights, ``[s, b, h]`` in and out, for every option the layer has
  (LayerNorm or RMSNorm, GeLU or SwiGLU, grouped query heads, RoPE, with or without
  biases). Its attention is written out (scores, causal mask, softmax), so it checks
  megapp's attention backends instead of sharing one with them.
* :class:`PlainGPT` is nanoGPT-shaped: batch-first activations ``[b, s, h]``,
  ``nn.Parameter`` tensors, ``scaled_dot_product_attention`` with ``is_causal``, the model a
  plain PyTorch user would write. :meth:`PlainGPT.from_megapp` copies the weights of a
  single-process megapp ``GPTModel`` (LayerNorm, GeLU, learned positions, tied embeddings,
  one key/value head per query head). The only change is the fused QKV weight's row order:
  megapp lays it out head by head (``[q_0; k_0; v_0; q_1; ...]``, so a column split keeps a
  head's q, k and v together); here it is ``[Q; K; V]``. :func:`megapp_qkv_to_plain` and
  :func:`plain_qkv_to_megapp` convert either way; :meth:`PlainGPT.megapp_grads` returns the
  gradients under megapp's names and layout, and :func:`compare` holds the two models to
  the same loss and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, eps: float
) -> torch.Tensor:
    """LayerNorm (``kind == "LayerNorm"``) or RMSNorm over the last dimension of ``x``."""
    if kind == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def plain_norm(x: torch.Tensor, module: nn.Module, kind: str, eps: float) -> torch.Tensor:
    """:func:`norm` with the weights of megapp's norm ``module``."""
    return norm(x, module.weight, getattr(module, "bias", None), kind, eps)


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[s, b, heads, d]`` by angles ``freqs`` ``[s, 1, 1, rot]``;
    the channels past ``rot`` pass unchanged."""
    rot = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    first, second = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    out = x_rot * freqs.cos().to(x.dtype) + rotated * freqs.sin().to(x.dtype)
    return torch.cat([out, x_pass], dim=-1)


def activation(inner: torch.Tensor, kind: str) -> torch.Tensor:
    """The MLP's activation of its first linear's output: SwiGLU (``inner`` holds gate and
    up halves) or GeLU (tanh approximation)."""
    if kind == "swiglu":
        gate, up = inner.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(inner, approximate="tanh")


def plain_layer(
    layer: nn.Module, x: torch.Tensor, config, rotary_freqs: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer`` (a megapp TransformerLayer built with tensor_model_parallel_size 1) on
    ``x`` ``[s, b, h]`` computed with plain torch ops from the layer's own parameters, so
    gradients reach them; ``rotary_freqs`` as the layer takes them."""
    eps, kind = config.layernorm_epsilon, config.normalization
    attn, mlp = layer.self_attention, layer.mlp
    s, b, _ = x.shape
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels

    normed = plain_norm(x, layer.input_layernorm, kind, eps)
    mixed = F.linear(normed, attn.linear_qkv.weight, attn.linear_qkv.bias)
    mixed = mixed.view(s, b, groups, heads // groups + 2, d)
    q, k, v = mixed.split([heads // groups, 1, 1], dim=3)
    q = q.reshape(s, b, heads, d)
    k = k.squeeze(3).repeat_interleave(heads // groups, dim=2)
    v = v.squeeze(3).repeat_interleave(heads // groups, dim=2)
    if rotary_freqs is not None:
        q, k = rope(q, rotary_freqs), rope(k, rotary_freqs)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    context = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    x = x + F.linear(context, attn.linear_proj.weight, attn.linear_proj.bias)

    normed = plain_norm(x, layer.pre_mlp_layernorm, kind, eps)
    inner = F.linear(normed, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    hidden = activation(inner, config.activation)
    return x + F.linear(hidden, mlp.linear_fc2.weight, mlp.linear_fc2.bias)


def megapp_qkv_to_plain(t: torch.Tensor, heads: int) -> torch.Tensor:
    """megapp's head-major QKV rows ``[heads·3·d, ...]`` -> ``[Q; K; V]`` (same shape)."""
    per_head = t.view(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:])
    return per_head.transpose(0, 1).reshape(t.shape)


def plain_qkv_to_megapp(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`megapp_qkv_to_plain`."""
    qkv = t.view(3, heads, t.shape[0] // (3 * heads), *t.shape[1:])
    return qkv.transpose(0, 1).reshape(t.shape)


class PlainBlock(nn.Module):
    """Pre-norm layer: ``x + proj(attn(ln1(x)))``, then ``+ fc2(gelu(fc1(ln2(x))))``."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.eps = heads, eps

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape))

        self.ln1_w, self.ln1_b = param(hidden), param(hidden)
        self.qkv_w, self.qkv_b = param(3 * hidden, hidden), param(3 * hidden)
        self.proj_w, self.proj_b = param(hidden, hidden), param(hidden)
        self.ln2_w, self.ln2_b = param(hidden), param(hidden)
        self.fc1_w, self.fc1_b = param(ffn, hidden), param(ffn)
        self.fc2_w, self.fc2_b = param(hidden, ffn), param(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, s, h]`` in and out."""
        b, s, h = x.shape
        normed = norm(x, self.ln1_w, self.ln1_b, "LayerNorm", self.eps)
        q, k, v = F.linear(normed, self.qkv_w, self.qkv_b).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        context = context.transpose(1, 2).reshape(b, s, h)
        x = x + F.linear(context, self.proj_w, self.proj_b)
        normed = norm(x, self.ln2_w, self.ln2_b, "LayerNorm", self.eps)
        inner = activation(F.linear(normed, self.fc1_w, self.fc1_b), "gelu")
        return x + F.linear(inner, self.fc2_w, self.fc2_b)


# (plain name, megapp name) of every parameter of layer l, in megapp's registration order.
_LAYER_NAMES = (
    ("ln1_w", "input_layernorm.weight"),
    ("ln1_b", "input_layernorm.bias"),
    ("qkv_w", "self_attention.linear_qkv.weight"),
    ("qkv_b", "self_attention.linear_qkv.bias"),
    ("proj_w", "self_attention.linear_proj.weight"),
    ("proj_b", "self_attention.linear_proj.bias"),
    ("ln2_w", "pre_mlp_layernorm.weight"),
    ("ln2_b", "pre_mlp_layernorm.bias"),
    ("fc1_w", "mlp.linear_fc1.weight"),
    ("fc1_b", "mlp.linear_fc1.bias"),
    ("fc2_w", "mlp.linear_fc2.weight"),
    ("fc2_b", "mlp.linear_fc2.bias"),
)


class PlainGPT(nn.Module):
    """Token and position embeddings, pre-norm layers, final norm, logits tied to the token
    embedding, mean cross entropy.

    forward(tokens ``[b, s]``, labels ``[b, s]``) -> the mean loss over the ``b·s`` tokens
    (a scalar; megapp's GPTModel returns the per-token losses ``[b, s]`` instead).
    """

    def __init__(
        self, vocab: int, max_positions: int, hidden: int, heads: int, layers: int, ffn: int,
        eps: float = 1e-5,
    ):  # fmt: skip
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) is not divisible by heads ({heads})")
        self.eps = eps
        self.wte = nn.Parameter(torch.empty(vocab, hidden))
        self.wpe = nn.Parameter(torch.empty(max_positions, hidden))
        self.blocks = nn.ModuleList(PlainBlock(hidden, heads, ffn, eps) for _ in range(layers))
        self.lnf_w = nn.Parameter(torch.empty(hidden))
        self.lnf_b = nn.Parameter(torch.empty(hidden))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = F.embedding(tokens, self.wte) + self.wpe[:s]
        for block in self.blocks:
            x = block(x)
        x = norm(x, self.lnf_w, self.lnf_b, "LayerNorm", self.eps)
        logits = F.linear(x, self.wte)  # [b, s, V]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    # ----- megapp's weights and names -----------------------------------------------------------
    @staticmethod
    def check_supported(config) -> None:
        """Raise ValueError if the megapp ``GPTConfig`` is not one this model computes."""
        wanted = {
            "tensor_model_parallel_size": 1,
            "normalization": "LayerNorm",
            "activation": "gelu",
            "position_embedding_type": "learned_absolute",
            "share_embeddings_and_output_weights": True,
            "add_bias_linear": True,
            "num_query_groups": config.num_attention_heads,
            "kv_channels": config.hidden_size // config.num_attention_heads,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        }
        wrong = {k: getattr(config, k) for k, v in wanted.items() if getattr(config, k) != v}
        if wrong:
            raise ValueError(f"PlainGPT cannot mirror this GPTConfig: {wrong}; wanted {wanted}")

    @classmethod
    def from_megapp(cls, model: nn.Module) -> PlainGPT:
        """A PlainGPT holding copies of ``model``'s weights (a whole, single-process GPTModel)."""
        config = model.config
        cls.check_supported(config)
        plain = cls(
            config.vocab_size,
            config.max_position_embeddings,
            config.hidden_size,
            config.num_attention_heads,
            config.num_layers,
            config.ffn_hidden_size,
            config.layernorm_epsilon,
        ).to(config.params_dtype)
        source = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in plain.megapp_names().items():
                weight = source[name].detach()
                if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
                    weight = megapp_qkv_to_plain(weight, config.num_attention_heads)
                value.copy_(weight)
        return plain.to(next(model.parameters()).device)

    def megapp_names(self) -> dict[str, nn.Parameter]:
        """Every parameter under the name of its counterpart in megapp's GPTModel."""
        names = {
            "embedding.word_embeddings.weight": self.wte,
            "embedding.position_embeddings.weight": self.wpe,
            "decoder.final_layernorm.weight": self.lnf_w,
            "decoder.final_layernorm.bias": self.lnf_b,
        }
        for l, block in enumerate(self.blocks):
            for ours, theirs in _LAYER_NAMES:
                names[f"decoder.layers.{l}.{theirs}"] = getattr(block, ours)
        return names

    def megapp_grads(self) -> dict[str, torch.Tensor]:
        """The gradients under megapp's names, the QKV ones in megapp's row order."""
        heads = self.blocks[0].heads
        grads = {}
        for name, p in self.megapp_names().items():
            if p.grad is None:
                raise ValueError(f"{name} has no gradient; run backward first")
            grad = p.grad
            if "linear_qkv" in name:
                grad = plain_qkv_to_megapp(grad, heads)
            grads[name] = grad
        return grads


# Largest relative difference accepted by compare(), per dtype: the two models sum the same
# terms in other orders (fused QKV rows, [s, b, h] against [b, s, h], megapp's kernels), which
# moves fp32 results by a few ulps per op and gradients by ~1e-6 of their largest entry; a wrong
# weight, layout or missing term moves them by far more than 1e-4.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


@dataclass
class Agreement:
    """How closely megapp's GPTModel and PlainGPT agree on one batch."""

    loss: float  # megapp: the mean of its per-token losses
    plain_loss: float
    max_grad_rel: float  # max over parameters of max|Δgrad| / max|grad| (megapp's grad)
    worst: str  # the parameter where that maximum is
    tolerance: float

    @property
    def ok(self) -> bool:
        loss_rel = abs(self.loss - self.plain_loss) / max(abs(self.loss), 1e-30)
        return loss_rel <= self.tolerance and self.max_grad_rel <= self.tolerance

    def __str__(self) -> str:
        return (
            f"loss {self.loss!r} vs plain {self.plain_loss!r}; max|Δgrad|/max|grad| "
            f"{self.max_grad_rel:.3e} at {self.worst}; tolerance {self.tolerance:.0e}"
        )


def compare(
    model: nn.Module,
    plain: PlainGPT,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    tolerance: float | None = None,
) -> Agreement:
    """Forward and backward both models on ``tokens``/``labels`` ``[b, s]``, compare the mean
    loss and every gradient; the gradients are cleared again afterwards.

    ``tolerance`` (default :data:`TOLERANCE` of the parameters' dtype) bounds the relative
    loss difference and, per parameter, ``max|Δgrad| / max|grad|``.
    """
    dtype = next(model.parameters()).dtype
    tolerance = TOLERANCE.get(dtype, 1e-2) if tolerance is None else tolerance
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    plain_loss = plain(tokens, labels)
    plain_loss.backward()
    theirs = plain.megapp_grads()
    worst, max_rel = "", 0.0
    for name, p in model.named_parameters():
        if p.grad is None or name not in theirs:
            worst, max_rel = f"{name} (no counterpart or no gradient)", float("inf")
            break
        scale = p.grad.abs().max().clamp_min(torch.finfo(p.grad.dtype).tiny)
        rel = float((p.grad - theirs[name]).abs().max() / scale)
        if not rel <= max_rel:  # also catches nan
            worst, max_rel = name, rel if rel == rel else float("inf")
    if len(theirs) != len(dict(model.named_parameters())):
        worst, max_rel = "parameter sets differ", float("inf")
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
    return Agreement(float(loss.detach()), float(plain_loss.detach()), max_rel, worst, tolerance)
