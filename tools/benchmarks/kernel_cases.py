"""The fused ops that ``bench_kernels.py`` times: for each, how to build its inputs, megapp's
call, the plain PyTorch expression a user would write instead, and the op's minimal
memory traffic (every input read once, every output written once).

:func:`cases` lists them for a dict of shapes (:data:`SHAPES` per device kind);
:func:`check_against_reference` compares megapp's compiled tier with its pure-PyTorch
reference (and the eager expression) before anything is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megapp import fusions
from megapp.fusions import extension
from megapp.tensor_parallel import vocab_parallel_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DROPOUT_P = 0.1
EPS = 1e-5
SOFTMAX_SCALE = 0.125  # 1/√64

# Transformer-sized shapes: [s, b, h] activations, [sb, heads, sq, sq] attention scores, RoPE on
# [s, b, heads, d], cross entropy on [s·b, vocab] logits. CPU: quick on 2 cores (16 MiB per fp32
# [s, b, h] tensor; 500 MiB of fp32 logits). CUDA: large enough (0.5-4 GiB per fp32 tensor) that
# the 50 MiB L2 and launch latency do not set the time.
SHAPES = {
    "cpu": dict(s=1024, b=4, h=1024, heads=16, sb=4, sq=512, d=64, vocab=32000),
    "cuda": dict(s=4096, b=8, h=4096, heads=32, sb=4, sq=2048, d=128, vocab=32000),
}
Inputs = dict[str, torch.Tensor]


@dataclass
class Case:
    """One op: how to build its inputs, the three ways to compute it, and its minimal traffic."""

    op: str  # the name megapp.fusions.extension uses (its tier choice and log line)
    shape: str  # for the table header
    traffic: str  # what the byte count counts
    make: Callable[[dict, torch.device, torch.dtype], Inputs]
    megapp: Callable[[Inputs], torch.Tensor]
    eager: Callable[[Inputs], torch.Tensor]
    grad_inputs: tuple[str, ...]  # inputs that require grad (the others are constants)
    nbytes: Callable[[Inputs], tuple[int, int]]  # (forward, backward) minimal bytes
    tier_input: str = "x"  # the tensor whose device and dtype pick the tier


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes the tensors' elements occupy."""
    return sum(t.numel() * t.element_size() for t in tensors)


def randn(shape, device, dtype, scale=1.0) -> torch.Tensor:
    """Normal values times ``scale``, drawn in fp32 (the same values for every dtype)."""
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _make_bias_act(width_mult: int):
    def make(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
        width = width_mult * sh["h"]
        return {
            "x": randn((sh["s"], sh["b"], width), device, dtype),
            "bias": randn((width,), device, dtype, 0.1),
        }

    return make


def _gelu_bytes(t: Inputs) -> tuple[int, int]:
    x, bias = t["x"], t["bias"]
    # fwd: read x, bias; write y (= x's size). bwd: read dy, x, bias; write dx, dbias.
    return tensor_bytes(x, bias) + tensor_bytes(x), 3 * tensor_bytes(x) + 2 * tensor_bytes(bias)


def _swiglu_eager(t: Inputs) -> torch.Tensor:
    gate, up = (t["x"] + t["bias"]).chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bytes(t: Inputs) -> tuple[int, int]:
    x, bias = t["x"], t["bias"]
    y = tensor_bytes(x) // 2  # [..., f] from x [..., 2f]
    # fwd: read x, bias; write y. bwd: read dy, x, bias; write dx, dbias.
    return tensor_bytes(x, bias) + y, y + 2 * tensor_bytes(x) + 2 * tensor_bytes(bias)


def _make_bda(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    shape = (sh["s"], sh["b"], sh["h"])
    return {
        "x": randn(shape, device, dtype),
        "bias": randn((sh["h"],), device, dtype, 0.1),
        "residual": randn(shape, device, dtype),
    }


def _bda_bytes(t: Inputs) -> tuple[int, int]:
    x, bias = t["x"], t["bias"]
    # fwd: read x, residual, bias; write out. bwd: read dout; write dx, dbias (the residual's
    # gradient is dout itself: no traffic). No mask is stored or read (megapp regenerates it).
    return 3 * tensor_bytes(x) + tensor_bytes(bias), 2 * tensor_bytes(x) + tensor_bytes(bias)


def _make_softmax(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    sq = sh["sq"]
    return {
        "x": randn((sh["sb"], sh["heads"], sq, sq), device, dtype, 4.0),
        # A user caches the causal mask; building it is not timed.
        "causal_mask": torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1),
    }


def _softmax_eager(t: Inputs) -> torch.Tensor:
    z = (t["x"] * SOFTMAX_SCALE).masked_fill(t["causal_mask"], float("-inf"))
    return torch.softmax(z, dim=-1)


def _softmax_bytes(t: Inputs) -> tuple[int, int]:
    x = t["x"]
    # Dense count: fwd reads the scores and writes the probabilities (the upper triangle too:
    # it is written as zeros). bwd: read dy, y; write dx.
    return 2 * tensor_bytes(x), 3 * tensor_bytes(x)


def _make_norm(with_bias: bool):
    def make(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
        h = sh["h"]
        t = {
            "x": randn((sh["s"], sh["b"], h), device, dtype),
            "weight": (1.0 + randn((h,), device, torch.float32, 0.1)).to(dtype),
        }
        if with_bias:
            t["bias"] = randn((h,), device, dtype, 0.1)
        return t

    return make


def _norm_bytes(n_stats: int):
    def nbytes(t: Inputs) -> tuple[int, int]:
        x = t["x"]
        params = [t["weight"]] + ([t["bias"]] if "bias" in t else [])
        stats = n_stats * 4 * (x.numel() // x.shape[-1])  # float32 mean/rstd per row
        # fwd: read x, params; write y, stats. bwd: read dy, x, stats, weight; write dx, and one
        # gradient per parameter.
        fwd = 2 * tensor_bytes(x) + tensor_bytes(*params) + stats
        bwd = 3 * tensor_bytes(x) + stats + tensor_bytes(t["weight"]) + tensor_bytes(*params)
        return fwd, bwd

    return nbytes


def _make_rope(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    s, d = sh["s"], sh["d"]
    return {
        "x": randn((s, sh["b"], sh["heads"], d), device, dtype),
        "freqs": fusions.rotary_freqs(s, d, device=device),
    }


def _rope_eager(t: Inputs) -> torch.Tensor:
    # Megatron-LM's _apply_rotary_pos_emb_bshd (non-interleaved), as written there.
    x, freqs = t["x"], t["freqs"]
    rot_dim = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos_, sin_ = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos_ + torch.cat((-x2, x1), dim=-1) * sin_
    return torch.cat((x_rot, x_pass), dim=-1)


def _rope_bytes(t: Inputs) -> tuple[int, int]:
    x, freqs = t["x"], t["freqs"]
    # fwd: read x, freqs; write y. bwd: read dy, freqs; write dx.
    return 2 * tensor_bytes(x) + tensor_bytes(freqs), 2 * tensor_bytes(x) + tensor_bytes(freqs)


def _make_cross_entropy(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    rows, vocab = sh["s"] * sh["b"], sh["vocab"]
    return {
        "x": randn((rows, vocab), device, dtype, 2.0),
        "target": torch.randint(0, vocab, (rows,), device=device),
    }


def _cross_entropy_bytes(t: Inputs) -> tuple[int, int]:
    x, target = t["x"], t["target"]
    rows = target.numel()
    # fwd: read logits, target; write the float32 loss, m and log Z. bwd: read dloss, logits,
    # target, m, log Z; write dlogits. (megapp's forward reads the logits twice: the max, then
    # the sums after the all-reduce; the count is the minimum.)
    return tensor_bytes(x, target) + 12 * rows, 2 * tensor_bytes(x) + tensor_bytes(
        target
    ) + 12 * rows


def _rms_eager(t: Inputs) -> torch.Tensor:
    x, w = t["x"], t["weight"]
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def cases(sh: dict) -> list[Case]:
    s, b, h, heads, sb, sq, d = (sh[k] for k in ("s", "b", "h", "heads", "sb", "sq", "d"))
    nh = f"[s={s}, b={b}, h={h}]"
    return [
        Case(
            "bias_gelu",
            f"x {nh}, bias [h]",
            "fwd: x + bias + y; bwd: dy + x + bias + dx + dbias",
            _make_bias_act(1),
            lambda t: fusions.bias_gelu(t["x"], t["bias"]),
            lambda t: F.gelu(t["x"] + t["bias"], approximate="tanh"),
            ("x", "bias"),
            _gelu_bytes,
        ),
        Case(
            "bias_swiglu",
            f"x [s={s}, b={b}, 2f={2 * h}] -> y [s, b, f={h}], bias [2f]",
            "fwd: x + bias + y (y = x/2); bwd: dy + x + bias + dx + dbias",
            _make_bias_act(2),
            lambda t: fusions.bias_swiglu(t["x"], t["bias"]),
            _swiglu_eager,
            ("x", "bias"),
            _swiglu_bytes,
        ),
        Case(
            "bias_dropout_add",
            f"x, residual {nh}, bias [h], p={DROPOUT_P}, training",
            "fwd: x + residual + bias + out; bwd: dout + dx + dbias (no mask)",
            _make_bda,
            lambda t: fusions.bias_dropout_add(t["x"], t["bias"], t["residual"], DROPOUT_P, True),
            lambda t: t["residual"] + F.dropout(t["x"] + t["bias"], DROPOUT_P, training=True),
            ("x", "bias", "residual"),
            _bda_bytes,
        ),
        Case(
            "scaled_masked_softmax",
            f"scores [b={sb}, heads={heads}, sq={sq}, sk={sq}], causal, scale 1/8",
            "fwd: x + y (dense, both triangles); bwd: dy + y + dx",
            _make_softmax,
            lambda t: fusions.scaled_masked_softmax(t["x"], None, SOFTMAX_SCALE, True),
            _softmax_eager,
            ("x",),
            _softmax_bytes,
        ),
        Case(
            "layer_norm",
            f"x {nh}, weight/bias [h] in x's dtype",
            "fwd: x + w + b + y + mean/rstd; bwd: dy + x + mean/rstd + w + dx + dw + db",
            _make_norm(True),
            lambda t: fusions.layer_norm(t["x"], t["weight"], t["bias"], EPS),
            lambda t: F.layer_norm(t["x"], (t["x"].shape[-1],), t["weight"], t["bias"], EPS),
            ("x", "weight", "bias"),
            _norm_bytes(2),
        ),
        Case(
            "rms_norm",
            f"x {nh}, weight [h] in x's dtype",
            "fwd: x + w + y + rstd; bwd: dy + x + rstd + w + dx + dw",
            _make_norm(False),
            lambda t: fusions.rms_norm(t["x"], t["weight"], EPS),
            _rms_eager,
            ("x", "weight"),
            _norm_bytes(1),
        ),
        Case(
            "rope",
            f"x [s={s}, b={b}, heads={heads}, d={d}], freqs [s, 1, 1, {d}] fp32",
            "fwd: x + freqs + y; bwd: dy + freqs + dx",
            _make_rope,
            lambda t: fusions.apply_rotary_pos_emb(t["x"], t["freqs"]),
            _rope_eager,
            ("x",),
            _rope_bytes,
        ),
        Case(
            "cross_entropy",
            f"logits [s·b={s * b}, V={sh['vocab']}], int64 targets, loss per token",
            "fwd: logits + target + loss + m/log Z; bwd: dloss + logits + target + m/log Z + dx",
            _make_cross_entropy,
            lambda t: vocab_parallel_cross_entropy(t["x"], t["target"]),
            lambda t: F.cross_entropy(t["x"], t["target"], reduction="none"),
            ("x",),
            _cross_entropy_bytes,
        ),
    ]


def max_abs_diff(a, b) -> float:
    """max |a − b| over a tensor or over matching tuples of tensors."""
    if isinstance(a, torch.Tensor):
        a, b = (a,), (b,)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def check_against_reference(case: Case, inputs: Inputs, grad_out: torch.Tensor) -> str:
    """max |megapp − reference| of the output and input gradients (same dropout seed), and of
    the output against the eager expression, so no column times something else."""
    fn = case.megapp
    if case.op == "bias_dropout_add":  # one fixed seed for both tiers: the masks must agree

        def fn(t: Inputs) -> torch.Tensor:
            return fusions.bias_dropout_add(
                t["x"], t["bias"], t["residual"], DROPOUT_P, True, seed=1234
            )

    diff = [inputs[name] for name in case.grad_inputs]
    results = []
    for fused in (True, False):
        with extension.fused(fused):
            out = fn(inputs)
            grads = torch.autograd.grad(out, diff, grad_out)
        results.append((out.detach(), grads))
    (out_k, grads_k), (out_r, grads_r) = results
    line = f"y {max_abs_diff(out_k, out_r):.2g}, grads {max_abs_diff(grads_k, grads_r):.2g}"
    if case.op != "bias_dropout_add":  # eager dropout draws another mask: nothing to compare
        with torch.no_grad():
            line += f" (eager y {max_abs_diff(out_k, case.eager(inputs)):.2g})"
    return line
