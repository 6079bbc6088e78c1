"""Fused rotary position embedding: CPU (and CUDA) kernels against the PyTorch reference."""

from __future__ import annotations

import os

import pytest
import torch

from megapp.fusions import choose_tier, cuda_ops_available, select_tier
from megapp.fusions.rope import (
    RotaryPosEmbFunction,
    apply_rotary_pos_emb,
    rope_reference,
    rope_reference_backward,
    rotary_freqs,
)
from tests import support
from tests.support import requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

# (x shape [s, b, heads, d], rot_dim): full rotation, partial rotation with pass-through channels,
# odd head counts and an odd head dim, a single position.
CASES = [
    ((5, 2, 3, 8), 8),
    ((7, 1, 4, 64), 64),
    ((6, 3, 2, 10), 4),
    ((4, 2, 5, 7), 6),
    ((1, 1, 1, 2), 2),
    ((33, 2, 4, 128), 64),
]

# fp32: kernel and reference run the same float ops per element (x1·c1 − x2·s1, x2·c2 + x1·s2);
# the sin/cos implementations differ (≈1 ulp of angles up to s ≈ 40 rad) and the AVX2 kernels
# contract a product and a sum into one FMA, each of which moves y by ≈ eps·|x|, so 1e-6 relative
# plus 1e-6 absolute for outputs near zero after cancellation.
FP32_TOL = {"rtol": 1e-6, "atol": 1e-6}
FP64_TOL = {"rtol": 1e-12, "atol": 1e-12}
# bf16/fp16 kernels compute in float and round once to the output type, so against the fp32
# reference on the same (already rounded) inputs the error is one rounding: at most the unit
# roundoff, 2^-8 (bf16) or 2^-11 (fp16), relative. rtol is twice that.
LOW_PRECISION_TOL = {
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
}


def _inputs(shape, rot_dim, dtype, device="cpu", seed=0, distinct_halves=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    freqs = rotary_freqs(shape[0], rot_dim, base=100.0)
    if distinct_halves:  # the general layout: every channel its own angle
        freqs = freqs + torch.rand(freqs.shape, generator=gen)
    return (
        x.to(device=device, dtype=dtype),
        freqs.to(device),
        grad.to(device=device, dtype=dtype),
    )


def _complex_rope(x, freqs):
    """Independent formulation: pair (j, j + r/2) is the complex number x_j + i·x_{j+r/2},
    multiplied by e^{iθ_j}."""
    rot_dim = freqs.shape[-1]
    half = rot_dim // 2
    z = torch.complex(x[..., :half], x[..., half:rot_dim])
    angle = freqs[..., :half].double()
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((rotated.real, rotated.imag, x[..., rot_dim:]), dim=-1)


def test_rotary_freqs_layout():
    freqs = rotary_freqs(6, 8, base=10000.0)
    assert freqs.shape == (6, 1, 1, 8) and freqs.dtype == torch.float32
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    expected = torch.outer(torch.arange(6, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(freqs[:, 0, 0, :4], expected, rtol=0, atol=0)
    torch.testing.assert_close(freqs[:, 0, 0, 4:], expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rot_dim must be even and positive"):
        rotary_freqs(4, 7)


@pytest.mark.parametrize(("shape", "rot_dim"), CASES)
def test_reference_matches_complex_formulation(shape, rot_dim):
    x, freqs, _ = _inputs(shape, rot_dim, torch.float64)
    torch.testing.assert_close(rope_reference(x, freqs), _complex_rope(x, freqs), **FP64_TOL)


def test_relative_position_property():
    # q·k after rotation depends on the positions only through their difference.
    gen = torch.Generator().manual_seed(1)
    d, seq = 16, 12
    q = torch.randn(d, generator=gen, dtype=torch.float64)
    k = torch.randn(d, generator=gen, dtype=torch.float64)
    # float64 angles: float32 ones (rotary_freqs) round m·θ, breaking the identity by ~1e-7.
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    # The same q and k placed at every position: [s, 1, 1, d].
    q_rot = rope_reference(q.expand(seq, 1, 1, d), freqs)[:, 0, 0]
    k_rot = rope_reference(k.expand(seq, 1, 1, d), freqs)[:, 0, 0]
    scores = q_rot @ k_rot.T  # scores[m, n] = <R_m q, R_n k>
    for delta in (-5, 0, 3, 7):
        diagonal = torch.diagonal(scores, offset=-delta)  # all (m, n) with m − n = delta
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), **FP64_TOL)
    # and it is not position-blind: different offsets give different scores.
    assert not torch.allclose(scores[3, 3], scores[4, 3])
    # Rotations preserve norms.
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm().expand(seq), **FP64_TOL)


@pytest.mark.parametrize("distinct_halves", [False, True])
def test_reference_backward_matches_autograd(distinct_halves):
    x, freqs, grad = _inputs((5, 2, 3, 10), 6, torch.float64, distinct_halves=distinct_halves)
    x.requires_grad_(True)
    rope_reference(x, freqs).backward(grad)
    torch.testing.assert_close(rope_reference_backward(grad, freqs), x.grad, **FP64_TOL)


def test_backward_is_the_inverse_rotation():
    # With equal halves the transpose of a rotation is its inverse: backward undoes forward.
    x, freqs, _ = _inputs((9, 2, 3, 16), 16, torch.float64)
    torch.testing.assert_close(rope_reference_backward(rope_reference(x, freqs), freqs), x)


@requires_cpu_ext
@pytest.mark.parametrize(("shape", "rot_dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("distinct_halves", [False, True])
def test_cpu_kernel_matches_reference(ops, shape, rot_dim, dtype, distinct_halves):
    x, freqs, grad = _inputs(shape, rot_dim, dtype, distinct_halves=distinct_halves)
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    torch.testing.assert_close(ops.rope_fwd(x, freqs), rope_reference(x, freqs), **tol)
    torch.testing.assert_close(
        ops.rope_bwd(grad, freqs), rope_reference_backward(grad, freqs), **tol
    )


@requires_cpu_ext
@pytest.mark.parametrize(("shape", "rot_dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision(ops, shape, rot_dim, dtype):
    x, freqs, grad = _inputs(shape, rot_dim, dtype)
    tol = LOW_PRECISION_TOL[dtype]
    # fp32 reference on the same rounded inputs, so only the output rounding differs.
    y = ops.rope_fwd(x, freqs)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), rope_reference(x.float(), freqs), **tol)
    # Pass-through channels are copied bit for bit.
    assert torch.equal(y[..., rot_dim:], x[..., rot_dim:])
    grad_x = ops.rope_bwd(grad, freqs)
    torch.testing.assert_close(grad_x.float(), rope_reference_backward(grad.float(), freqs), **tol)


@requires_cpu_ext
def test_cpu_kernel_non_contiguous_and_empty(ops):
    # As in attention: q is a strided view of the fused QKV projection.
    mixed = torch.randn(6, 2, 3, 3 * 8)
    q = mixed[..., :8]
    freqs = rotary_freqs(6, 8).transpose(0, 3).contiguous().transpose(0, 3)  # strided freqs
    assert not q.is_contiguous()
    torch.testing.assert_close(ops.rope_fwd(q, freqs), rope_reference(q, freqs), **FP32_TOL)
    torch.testing.assert_close(
        ops.rope_bwd(q, freqs), rope_reference_backward(q, freqs), **FP32_TOL
    )
    for shape in [(0, 2, 3, 8), (4, 0, 3, 8), (4, 2, 0, 8)]:
        empty = torch.empty(shape)
        freqs = rotary_freqs(shape[0], 8)
        assert ops.rope_fwd(empty, freqs).shape == shape
        assert ops.rope_bwd(empty, freqs).shape == shape


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    x = torch.randn(4, 2, 3, 8)
    with pytest.raises(RuntimeError, match=r"x must be 4-D \[s, b, heads, d\]"):
        ops.rope_fwd(torch.randn(4, 2, 8), rotary_freqs(4, 8))
    with pytest.raises(RuntimeError, match="freqs must be float32"):
        ops.rope_fwd(x, rotary_freqs(4, 8).double())
    with pytest.raises(RuntimeError, match=r"freqs must be \[s, 1, 1, rot_dim\] with s = x.size"):
        ops.rope_fwd(x, rotary_freqs(5, 8))
    with pytest.raises(RuntimeError, match="must be even, positive and at most the head dim"):
        ops.rope_bwd(x, rotary_freqs(4, 10))
    with pytest.raises(RuntimeError, match="must be even, positive and at most the head dim"):
        ops.rope_fwd(x, torch.zeros(4, 1, 1, 3))


def test_public_function_rejects_bad_inputs():
    x = torch.randn(4, 2, 3, 8)
    with pytest.raises(ValueError, match=r"freqs must be \[s, 1, 1, rot_dim\] with s = 4"):
        apply_rotary_pos_emb(x, rotary_freqs(4, 8)[:, 0])
    with pytest.raises(ValueError, match="freqs must be float32"):
        apply_rotary_pos_emb(x, rotary_freqs(4, 8).half())
    with pytest.raises(ValueError, match="at most the head dim d = 8"):
        apply_rotary_pos_emb(x, rotary_freqs(4, 12))
    with pytest.raises(ValueError, match=r"\[s, b, heads, d\]"):
        apply_rotary_pos_emb(torch.randn(4, 8), rotary_freqs(4, 8))


def test_gradcheck_reference():
    x, freqs, _ = _inputs((3, 2, 2, 6), 4, torch.float64, distinct_halves=True)
    # Differentiable in both x and (float64) angles.
    inputs = (x.requires_grad_(True), freqs.double().requires_grad_(True))
    assert torch.autograd.gradcheck(rope_reference, inputs)


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("distinct_halves", [False, True])
def test_gradcheck_function(monkeypatch, fused, distinct_halves, request):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, freqs, _ = _inputs((3, 2, 2, 6), 4, torch.float64, distinct_halves=distinct_halves)
    expected_tier = "reference"
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")  # the fused path must actually run the kernel
        expected_tier = "cpu"
    assert select_tier("rope", x) == expected_tier
    assert torch.autograd.gradcheck(
        lambda t: RotaryPosEmbFunction.apply(t, freqs), (x.requires_grad_(True),)
    )


@pytest.mark.parametrize("fused", ["0", "1"])
def test_function_saves_only_the_frequencies(monkeypatch, fused):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, freqs, _ = _inputs((4, 2, 3, 8), 8, torch.float32)
    x.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        apply_rotary_pos_emb(x, freqs)
    assert len(saved) == 1 and saved[0] is freqs


def test_learned_frequencies_get_gradients():
    x, freqs, grad = _inputs((4, 2, 3, 8), 8, torch.float32)
    x.requires_grad_(True)
    freqs.requires_grad_(True)
    apply_rotary_pos_emb(x, freqs).backward(grad)
    assert freqs.grad is not None and freqs.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad, rope_reference_backward(grad, freqs.detach()), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_pos_emb_autograd_matches_reference(dtype):
    x, freqs, grad = _inputs((5, 2, 3, 12), 8, dtype)
    x.requires_grad_(True)
    y = apply_rotary_pos_emb(x, freqs)
    y.backward(grad)
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    torch.testing.assert_close(y, rope_reference(x.detach(), freqs), **tol)
    torch.testing.assert_close(x.grad, rope_reference_backward(grad, freqs), **tol)


def test_choose_tier():
    both = frozenset({"cpu", "cuda"})
    assert choose_tier("rope", "cpu", torch.float64, both) == "cpu"
    assert choose_tier("rope", "cuda", torch.float16, both) == "cuda"
    assert choose_tier("rope", "cuda", torch.float64, both) == "reference"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "rot_dim"),
    [
        ((5, 2, 3, 8), 8),
        ((4, 2, 5, 7), 6),
        ((6, 3, 2, 10), 4),
        ((64, 4, 8, 128), 128),
        ((16, 2, 4, 256), 64),
        ((3, 1, 2, 24), 24),
    ],
)
def test_cuda_kernel_matches_reference(dtype, shape, rot_dim):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    x, freqs, grad = _inputs(shape, rot_dim, dtype, distinct_halves=True)
    ops = torch.ops.megapp
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    # CUDA sincosf and FMA contraction differ from the CPU by a few ulp: 4× the CPU tolerance.
    tol = {"rtol": 4 * tol["rtol"], "atol": 4 * tol["atol"]}
    y = ops.rope_fwd(x.cuda(), freqs.cuda())
    torch.testing.assert_close(y.float().cpu(), rope_reference(x.float(), freqs), **tol)
    assert torch.equal(y[..., rot_dim:].cpu(), x[..., rot_dim:])
    grad_x = ops.rope_bwd(grad.cuda(), freqs.cuda())
    torch.testing.assert_close(
        grad_x.float().cpu(), rope_reference_backward(grad.float(), freqs), **tol
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autograd_many_rows():
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    # More batch·heads rows per position than one block covers.
    x, freqs, grad = _inputs((3, 64, 40, 64), 64, torch.bfloat16, device="cuda")
    x.requires_grad_(True)
    y = apply_rotary_pos_emb(x, freqs)
    y.backward(grad)
    tol = {k: 4 * v for k, v in LOW_PRECISION_TOL[torch.bfloat16].items()}
    torch.testing.assert_close(y.float(), rope_reference(x.detach().float(), freqs), **tol)
    torch.testing.assert_close(x.grad.float(), rope_reference_backward(grad.float(), freqs), **tol)
