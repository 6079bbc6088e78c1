"""Fused bias + GeLU: CPU (and CUDA) kernels against the PyTorch reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megapp.fusions import (
    BiasGeLUFunction,
    bias_gelu,
    bias_gelu_reference,
    bias_gelu_reference_backward,
    choose_tier,
    cuda_ops_available,
    select_tier,
)
from tests import support
from tests.support import grad_bias_tol, requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

SHAPES = [(1, 8), (4, 7), (3, 5, 13), (2, 3, 4, 1), (257, 300), (16, 2, 1000)]

# fp32: kernel and reference run the same float ops in the same order; only the exp
# implementations (libm, Sleef in the AVX2 kernels: ≤ 1 ulp) and FMA contraction differ, so ~1e-6
# relative plus a tiny absolute term for outputs near zero.
FP32_TOL = {"rtol": 1e-6, "atol": 1e-6}
FP64_TOL = {"rtol": 1e-12, "atol": 1e-12}
# bf16/fp16 kernels compute in float and round once to the output type, so against the fp32
# reference on the same (already rounded) inputs the error is one rounding: at most the unit
# roundoff, 2^-8 (bf16) or 2^-11 (fp16), relative. rtol is twice that.
LOW_PRECISION_TOL = {
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
}


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Scale 3 reaches the saturated tails of tanh as well as the curved middle.
    x = 3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    bias = torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, bias, grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_matches_torch_gelu(dtype):
    x, bias, _ = _inputs((64, 100), dtype)
    expected = F.gelu(x + bias, approximate="tanh")
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    # torch's kernel orders and vectorizes the ops differently: a few ulp, not bitwise.
    torch.testing.assert_close(
        bias_gelu_reference(x, bias), expected, rtol=4 * tol["rtol"], atol=4 * tol["atol"]
    )


def test_reference_backward_matches_autograd():
    x, bias, grad = _inputs((33, 17), torch.float64)
    x.requires_grad_(True)
    bias.requires_grad_(True)
    F.gelu(x + bias, approximate="tanh").backward(grad)
    grad_input, grad_bias = bias_gelu_reference_backward(grad, x.detach(), bias.detach())
    torch.testing.assert_close(grad_input, x.grad, **FP64_TOL)
    torch.testing.assert_close(grad_bias, bias.grad, **FP64_TOL)


@requires_cpu_ext
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_matches_reference(ops, shape, dtype):
    x, bias, grad = _inputs(shape, dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    torch.testing.assert_close(ops.bias_gelu_fwd(x, bias), bias_gelu_reference(x, bias), **tol)
    grad_input, grad_bias = ops.bias_gelu_bwd(grad, x, bias)
    ref_input, ref_bias = bias_gelu_reference_backward(grad, x, bias)
    torch.testing.assert_close(grad_input, ref_input, **tol)
    torch.testing.assert_close(grad_bias, ref_bias, **grad_bias_tol(tol, x.numel() // shape[-1]))


@requires_cpu_ext
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision(ops, shape, dtype):
    x, bias, grad = _inputs(shape, dtype)
    tol = LOW_PRECISION_TOL[dtype]
    # fp32 reference on the same rounded inputs, so only the output rounding differs.
    x32, bias32, grad32 = (t.float() for t in (x, bias, grad))
    y = ops.bias_gelu_fwd(x, bias)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), bias_gelu_reference(x32, bias32), **tol)
    grad_input, grad_bias = ops.bias_gelu_bwd(grad, x, bias)
    ref_input, ref_bias = bias_gelu_reference_backward(grad32, x32, bias32)
    torch.testing.assert_close(grad_input.float(), ref_input, **tol)
    # Float accumulation and one final rounding: the same half-ulp bound holds for the sum.
    torch.testing.assert_close(grad_bias.float(), ref_bias, rtol=tol["rtol"], atol=1e-4)


@requires_cpu_ext
def test_cpu_kernel_non_contiguous_and_empty(ops):
    x, bias, grad = _inputs((8, 12), torch.float32)
    xt, gradt, bias8 = x.t(), grad.t(), bias[:8]  # [12, 8], non-contiguous
    torch.testing.assert_close(ops.bias_gelu_fwd(xt, bias8), bias_gelu_reference(xt, bias8))
    for got, want in zip(
        ops.bias_gelu_bwd(gradt, xt, bias8),
        bias_gelu_reference_backward(gradt, xt, bias8),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **grad_bias_tol(FP32_TOL, 12))
    empty = torch.empty(0, 12)
    assert ops.bias_gelu_fwd(empty, bias).shape == (0, 12)
    grad_input, grad_bias = ops.bias_gelu_bwd(empty, empty, bias)
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
            results.append(ops.bias_gelu_bwd(grad, x, bias)[1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"last dim of x \(8\) must equal the bias size \(7\)"):
        ops.bias_gelu_fwd(x, torch.randn(7))
    with pytest.raises(RuntimeError, match="bias must be 1-D"):
        ops.bias_gelu_bwd(x, x, torch.randn(1, 8))
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.bias_gelu_fwd(x, torch.randn(8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="grad shape"):
        ops.bias_gelu_bwd(torch.randn(4, 9), x, torch.randn(8))


def test_public_function_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"bias must be \[h\] and x \[\.\.\., h\]"):
        bias_gelu(torch.randn(4, 8), torch.randn(7))


def test_gradcheck_reference():
    x, bias, _ = _inputs((3, 5, 7), torch.float64)
    inputs = (x.requires_grad_(True), bias.requires_grad_(True))
    assert torch.autograd.gradcheck(bias_gelu_reference, inputs)


@pytest.mark.parametrize("fused", ["0", "1"])
def test_gradcheck_function(monkeypatch, fused, request):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, bias, _ = _inputs((3, 5, 7), torch.float64)
    expected_tier = "reference"
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")  # the fused path must actually run the kernel
        expected_tier = "cpu"
    assert select_tier("bias_gelu", x) == expected_tier
    inputs = (x.requires_grad_(True), bias.requires_grad_(True))
    assert torch.autograd.gradcheck(BiasGeLUFunction.apply, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_autograd_matches_reference(dtype):
    x, bias, grad = _inputs((2, 3, 40), dtype)
    x.requires_grad_(True)
    bias.requires_grad_(True)
    y = bias_gelu(x, bias)
    y.backward(grad)
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    torch.testing.assert_close(y, bias_gelu_reference(x.detach(), bias.detach()), **tol)
    ref_input, ref_bias = bias_gelu_reference_backward(grad, x.detach(), bias.detach())
    torch.testing.assert_close(x.grad, ref_input, **tol)
    torch.testing.assert_close(bias.grad, ref_bias, rtol=tol["rtol"], atol=1e-4)


class TestChooseTier:
    def test_cpu_built(self):
        assert choose_tier("bias_gelu", "cpu", torch.float32, frozenset({"cpu"})) == "cpu"
        assert choose_tier("bias_gelu", "cpu", torch.bfloat16, frozenset({"cpu", "cuda"})) == "cpu"

    def test_nothing_built(self):
        assert choose_tier("bias_gelu", "cpu", torch.float32, frozenset()) == "reference"
        assert choose_tier("bias_gelu", "cuda", torch.float32, frozenset()) == "reference"

    def test_cuda(self):
        both = frozenset({"cpu", "cuda"})
        assert choose_tier("bias_gelu", "cuda", torch.bfloat16, both) == "cuda"
        assert choose_tier("bias_gelu", "cuda", torch.float32, frozenset({"cpu"})) == "reference"
        # No float64 CUDA kernel: the reference handles it.
        assert choose_tier("bias_gelu", "cuda", torch.float64, both) == "reference"

    def test_fused_disabled(self, monkeypatch):
        both = frozenset({"cpu", "cuda"})
        monkeypatch.setenv("MEGAPP_FUSED", "0")
        assert choose_tier("bias_gelu", "cpu", torch.float32, both) == "reference"
        assert choose_tier("bias_gelu", "cuda", torch.float32, both) == "reference"
        assert choose_tier("bias_gelu", "cpu", torch.float32, both, enabled=True) == "cpu"

    def test_unknown_op(self):
        with pytest.raises(ValueError, match="unknown fused op"):
            choose_tier("no_such_op", "cpu", torch.float32, frozenset({"cpu"}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 13), (2048, 1024)])
def test_cuda_kernel_matches_cpu(dtype, shape):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    x, bias, grad = _inputs(shape, dtype)
    ops = torch.ops.megapp
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    x32, bias32, grad32 = (t.float() for t in (x, bias, grad))
    # CUDA tanhf and FMA contraction differ from the CPU by a few ulp: 4× the CPU tolerance.
    tol = {"rtol": 4 * tol["rtol"], "atol": 4 * tol["atol"]}
    y = ops.bias_gelu_fwd(x.cuda(), bias.cuda())
    torch.testing.assert_close(y.float().cpu(), bias_gelu_reference(x32, bias32), **tol)
    grad_input, grad_bias = ops.bias_gelu_bwd(grad.cuda(), x.cuda(), bias.cuda())
    ref_input, ref_bias = bias_gelu_reference_backward(grad32, x32, bias32)
    torch.testing.assert_close(grad_input.float().cpu(), ref_input, **tol)
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(
        grad_bias.float().cpu(), ref_bias, rtol=tol["rtol"], atol=1e-5 * rows
    )
    # Deterministic grad_bias: a second run gives the same bits.
    assert torch.equal(grad_bias, ops.bias_gelu_bwd(grad.cuda(), x.cuda(), bias.cuda())[1])
