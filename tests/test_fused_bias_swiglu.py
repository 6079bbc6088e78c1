"""Fused bias + SwiGLU: CPU (and CUDA) kernels against the PyTorch reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megapp.fusions.bias_ops import (
    BiasSwiGLUFunction,
    bias_swiglu,
    bias_swiglu_reference,
    bias_swiglu_reference_backward,
)
from megapp.fusions.extension import (
    choose_tier,
    cuda_ops_available,
    select_tier,
)
from tests import support
from tests.support import grad_bias_tol, requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

# Last dim is 2f: [gate | up].
SHAPES = [(1, 8), (4, 14), (3, 5, 26), (2, 3, 4, 2), (257, 300), (16, 2, 1000)]

# fp32: kernel and reference run the same float ops in the same order; only exp implementations
# differ (≈1 ulp). Through 1 − σ(g), that ulp of σ becomes an absolute error of about |g|·2^-24 in
# σ'-terms, hence the absolute term next to the relative one.
FP32_TOL = {"rtol": 2e-6, "atol": 2e-6}
FP64_TOL = {"rtol": 1e-12, "atol": 1e-12}
# bf16/fp16 kernels compute in float and round once to the output type, so against the fp32
# reference on the same (already rounded) inputs the error is one rounding: at most the unit
# roundoff, 2^-8 (bf16) or 2^-11 (fp16), relative. rtol is twice that.
LOW_PRECISION_TOL = {
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
}


def _inputs(shape, dtype, device="cpu", seed=0):
    """x ``shape`` ([..., 2f]), bias [2f], grad [..., f]."""
    gen = torch.Generator().manual_seed(seed)
    # Scale 3 reaches the saturated tails of σ as well as the curved middle.
    x = 3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    bias = torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    grad = torch.randn((*shape[:-1], shape[-1] // 2), generator=gen, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, bias, grad))


def _rows(shape):
    return torch.Size(shape[:-1]).numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_matches_torch_silu(dtype, with_bias):
    x, bias, _ = _inputs((64, 100), dtype)
    bias = bias if with_bias else None
    gate, up = (x + bias if with_bias else x).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    # torch's silu computes x / (1 + exp(-x)): a few ulp apart, not bitwise.
    torch.testing.assert_close(
        bias_swiglu_reference(x, bias), expected, rtol=4 * tol["rtol"], atol=4 * tol["atol"]
    )


@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_backward_matches_autograd(with_bias):
    x, bias, grad = _inputs((33, 18), torch.float64)
    x.requires_grad_(True)
    bias.requires_grad_(True)
    gate, up = (x + bias if with_bias else x).chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad)
    grad_input, grad_bias = bias_swiglu_reference_backward(
        grad, x.detach(), bias.detach() if with_bias else None
    )
    torch.testing.assert_close(grad_input, x.grad, **FP64_TOL)
    if with_bias:
        torch.testing.assert_close(grad_bias, bias.grad, **FP64_TOL)
    else:
        assert grad_bias is None


@requires_cpu_ext
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_matches_reference(ops, shape, dtype):
    x, bias, grad = _inputs(shape, dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    torch.testing.assert_close(ops.bias_swiglu_fwd(x, bias), bias_swiglu_reference(x, bias), **tol)
    grad_input, grad_bias = ops.bias_swiglu_bwd(grad, x, bias)
    ref_input, ref_bias = bias_swiglu_reference_backward(grad, x, bias)
    torch.testing.assert_close(grad_input, ref_input, **tol)
    torch.testing.assert_close(grad_bias, ref_bias, **grad_bias_tol(tol, _rows(shape)))


@requires_cpu_ext
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_without_bias(ops, shape, dtype):
    x, _, grad = _inputs(shape, dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    torch.testing.assert_close(ops.bias_swiglu_fwd(x, None), bias_swiglu_reference(x, None), **tol)
    grad_input, grad_bias = ops.bias_swiglu_bwd(grad, x, None)
    assert grad_bias is None
    torch.testing.assert_close(grad_input, bias_swiglu_reference_backward(grad, x, None)[0], **tol)


@requires_cpu_ext
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision(ops, shape, dtype):
    x, bias, grad = _inputs(shape, dtype)
    tol = LOW_PRECISION_TOL[dtype]
    # fp32 reference on the same rounded inputs, so only the output rounding differs.
    x32, bias32, grad32 = (t.float() for t in (x, bias, grad))
    y = ops.bias_swiglu_fwd(x, bias)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), bias_swiglu_reference(x32, bias32), **tol)
    grad_input, grad_bias = ops.bias_swiglu_bwd(grad, x, bias)
    ref_input, ref_bias = bias_swiglu_reference_backward(grad32, x32, bias32)
    torch.testing.assert_close(grad_input.float(), ref_input, **tol)
    # Float accumulation and one final rounding: the same half-ulp bound holds for the sum.
    torch.testing.assert_close(grad_bias.float(), ref_bias, rtol=tol["rtol"], atol=1e-4)


@requires_cpu_ext
def test_cpu_kernel_non_contiguous_and_empty(ops):
    x, bias, _ = _inputs((8, 12), torch.float32)
    xt, bias8 = x.t(), bias[:8]  # [12, 8], non-contiguous
    gradt = torch.randn(4, 12).t()  # [12, 4], non-contiguous
    torch.testing.assert_close(ops.bias_swiglu_fwd(xt, bias8), bias_swiglu_reference(xt, bias8))
    for got, want in zip(
        ops.bias_swiglu_bwd(gradt, xt, bias8),
        bias_swiglu_reference_backward(gradt, xt, bias8),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **grad_bias_tol(FP32_TOL, 12))
    # A non-contiguous bias (every other element of a longer one).
    bias_strided = torch.randn(24)[::2]
    torch.testing.assert_close(
        ops.bias_swiglu_fwd(x, bias_strided), bias_swiglu_reference(x, bias_strided)
    )
    empty = torch.empty(0, 12)
    assert ops.bias_swiglu_fwd(empty, bias).shape == (0, 6)
    grad_input, grad_bias = ops.bias_swiglu_bwd(torch.empty(0, 6), empty, bias)
    assert grad_input.shape == (0, 12)
    assert torch.equal(grad_bias, torch.zeros(12))


@requires_cpu_ext
def test_cpu_grad_bias_is_deterministic(ops):
    # Row blocks depend on the shape only, so the thread count cannot change the bits.
    x, bias, grad = _inputs((1024, 96), torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(ops.bias_swiglu_bwd(grad, x, bias)[1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"last dim of x \(7\) must be even"):
        ops.bias_swiglu_fwd(torch.randn(4, 7), None)
    with pytest.raises(RuntimeError, match=r"last dim of x \(8\) must equal the bias size \(6\)"):
        ops.bias_swiglu_fwd(x, torch.randn(6))
    with pytest.raises(RuntimeError, match="bias must be 1-D"):
        ops.bias_swiglu_bwd(torch.randn(4, 4), x, torch.randn(1, 8))
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.bias_swiglu_fwd(x, torch.randn(8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="grad shape"):
        ops.bias_swiglu_bwd(torch.randn(4, 8), x, torch.randn(8))
    with pytest.raises(RuntimeError, match="grad and x must have the same dtype"):
        ops.bias_swiglu_bwd(torch.randn(4, 4, dtype=torch.float64), x, None)


def test_public_function_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"even last dim"):
        bias_swiglu(torch.randn(4, 7), None)
    with pytest.raises(ValueError, match=r"bias must be \[2f\] and x \[\.\.\., 2f\]"):
        bias_swiglu(torch.randn(4, 8), torch.randn(4))
    with pytest.raises(ValueError, match="dtypes differ"):
        bias_swiglu(torch.randn(4, 8), torch.randn(8, dtype=torch.float64))


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradcheck_reference(with_bias):
    x, bias, _ = _inputs((3, 5, 8), torch.float64)
    inputs = (x.requires_grad_(True), bias.requires_grad_(True) if with_bias else None)
    assert torch.autograd.gradcheck(bias_swiglu_reference, inputs)


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gradcheck_function(monkeypatch, fused, with_bias, request):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, bias, _ = _inputs((3, 5, 8), torch.float64)
    expected_tier = "reference"
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")  # the fused path must actually run the kernel
        expected_tier = "cpu"
    assert select_tier("bias_swiglu", x) == expected_tier
    inputs = (x.requires_grad_(True), bias.requires_grad_(True) if with_bias else None)
    assert torch.autograd.gradcheck(BiasSwiGLUFunction.apply, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bias_swiglu_autograd_matches_reference(dtype):
    x, bias, grad = _inputs((2, 3, 40), dtype)
    x.requires_grad_(True)
    bias.requires_grad_(True)
    y = bias_swiglu(x, bias)
    assert y.shape == (2, 3, 20) and y.dtype == dtype
    y.backward(grad)
    tol = {torch.float32: FP32_TOL, torch.float64: FP64_TOL}.get(dtype) or LOW_PRECISION_TOL[dtype]
    torch.testing.assert_close(y, bias_swiglu_reference(x.detach(), bias.detach()), **tol)
    ref_input, ref_bias = bias_swiglu_reference_backward(grad, x.detach(), bias.detach())
    torch.testing.assert_close(x.grad, ref_input, **tol)
    torch.testing.assert_close(bias.grad, ref_bias, rtol=tol["rtol"], atol=1e-4)


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_function_saves_only_the_pre_activation(monkeypatch, fused, with_bias):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, bias, grad = _inputs((6, 10), torch.float32)
    x.requires_grad_(True)
    bias = bias.requires_grad_(True) if with_bias else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = bias_swiglu(x, bias)
    # Exactly x and bias, as they are: no output, no σ(gate), no copies.
    expected = [x] if bias is None else [x, bias]
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in expected]
    assert [t.shape for t in saved] == [t.shape for t in expected]
    y.backward(grad)
    assert x.grad is not None and (bias is None or bias.grad is not None)


def test_bias_grad_only():
    # Only bias wants a gradient: x's gradient is not returned, bias's is still right.
    x, bias, grad = _inputs((5, 12), torch.float64)
    bias.requires_grad_(True)
    bias_swiglu(x, bias).backward(grad)
    torch.testing.assert_close(bias.grad, bias_swiglu_reference_backward(grad, x, bias)[1])


def test_choose_tier():
    both = frozenset({"cpu", "cuda"})
    assert choose_tier("bias_swiglu", "cpu", torch.float64, both) == "cpu"
    assert choose_tier("bias_swiglu", "cuda", torch.bfloat16, both) == "cuda"
    assert choose_tier("bias_swiglu", "cuda", torch.float64, both) == "reference"
    assert choose_tier("bias_swiglu", "cpu", torch.float32, frozenset()) == "reference"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 14), (3, 5, 26), (7, 64), (2048, 2048), (1000, 4002)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cuda_kernel_matches_reference(dtype, shape, with_bias):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    x, bias, grad = _inputs(shape, dtype)
    bias = bias if with_bias else None
    ops = torch.ops.megapp
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    x32, grad32 = x.float(), grad.float()
    bias32 = None if bias is None else bias.float()
    # CUDA expf and FMA contraction differ from the CPU by a few ulp: 4× the CPU tolerance.
    tol = {"rtol": 4 * tol["rtol"], "atol": 4 * tol["atol"]}
    cuda_bias = None if bias is None else bias.cuda()
    y = ops.bias_swiglu_fwd(x.cuda(), cuda_bias)
    torch.testing.assert_close(y.float().cpu(), bias_swiglu_reference(x32, bias32), **tol)
    grad_input, grad_bias = ops.bias_swiglu_bwd(grad.cuda(), x.cuda(), cuda_bias)
    ref_input, ref_bias = bias_swiglu_reference_backward(grad32, x32, bias32)
    torch.testing.assert_close(grad_input.float().cpu(), ref_input, **tol)
    if bias is None:
        assert grad_bias is None
        return
    torch.testing.assert_close(
        grad_bias.float().cpu(), ref_bias, rtol=tol["rtol"], atol=1e-5 * _rows(shape)
    )
    # Deterministic grad_bias: a second run gives the same bits.
    assert torch.equal(grad_bias, ops.bias_swiglu_bwd(grad.cuda(), x.cuda(), cuda_bias)[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_unaligned_and_non_contiguous():
    # A storage offset of one element defeats the 16-byte vector path: the scalar path must agree.
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    x, bias, grad = _inputs((65, 64), torch.bfloat16, device="cuda")
    ops = torch.ops.megapp
    x_off = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x).copy_(x)
    g_off = torch.empty(grad.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(grad)
    g_off.copy_(grad)
    assert torch.equal(ops.bias_swiglu_fwd(x_off, bias), ops.bias_swiglu_fwd(x, bias))
    aligned = ops.bias_swiglu_bwd(grad, x, bias)
    unaligned = ops.bias_swiglu_bwd(g_off, x_off, bias)
    # Elementwise bits agree; grad_bias too, since the chunking depends on the shape only.
    assert torch.equal(aligned[0], unaligned[0]) and torch.equal(aligned[1], unaligned[1])
    xt = x.t().contiguous().t()  # same values, column-major
    assert torch.equal(ops.bias_swiglu_fwd(xt, bias), ops.bias_swiglu_fwd(x, bias))
