"""Fused LayerNorm / RMSNorm: CPU (and CUDA) kernels against the PyTorch references."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megapp.fusions.extension import (
    choose_tier,
    cuda_ops_available,
    select_tier,
)
from megapp.fusions.norm import (
    LayerNorm,
    LayerNormFunction,
    layer_norm,
    layer_norm_reference,
    layer_norm_reference_backward,
    layer_norm_reference_forward,
    layer_norm_reference_stats,
)
from megapp.fusions.rms_norm import (
    RMSNorm,
    RMSNormFunction,
    rms_norm,
    rms_norm_reference,
    rms_norm_reference_backward,
    rms_norm_reference_forward,
    rms_norm_reference_stats,
)
from tests import support
from tests.support import requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

EPS = 1e-5
SHAPES = [(1, 8), (4, 7), (3, 5, 13), (2, 3, 1), (257, 300), (16, 2, 1000)]
OPS = ["layer_norm", "rms_norm"]

# fp32: kernel and reference run the same float ops in the same order except the row sums (8-lane
# vector accumulators in the kernel, pairwise in torch) and FMA contraction in the AVX2 kernels:
# relative error of the statistics ~√h·2^-24, which reaches y and grad_input through
# x̂ = (x − mean)·rstd (|x̂| ≲ 5) — 1e-5 leaves a wide margin.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
FP64_TOL = {"rtol": 1e-11, "atol": 1e-11}
# bf16/fp16 kernels compute in float and round once to the output type, so against the fp32
# reference on the same (already rounded) inputs the error is one rounding: at most the unit
# roundoff, 2^-8 (bf16) or 2^-11 (fp16), relative, plus the fp32 differences above. rtol is twice
# the unit roundoff.
LOW_PRECISION_TOL = {
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-4},
    torch.float16: {"rtol": 2**-10, "atol": 1e-4},
}


def _inputs(shape, dtype, param_dtype=None, device="cpu", seed=0):
    """x (non-zero mean), weight (|w| in [0.5, 1.5], random sign), bias, grad."""
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = 2 * torch.randn(shape, generator=gen, dtype=torch.float64) + 0.5
    sign = torch.randint(0, 2, (h,), generator=gen).to(torch.float64) * 2 - 1
    weight = sign * (0.5 + torch.rand(h, generator=gen, dtype=torch.float64))
    bias = 0.5 * torch.randn(h, generator=gen, dtype=torch.float64)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    param_dtype = param_dtype or dtype
    return (
        x.to(device=device, dtype=dtype),
        weight.to(device=device, dtype=param_dtype),
        bias.to(device=device, dtype=param_dtype),
        grad.to(device=device, dtype=dtype),
    )


def _param_tol(tol, rows):
    # Parameter gradients sum `rows` terms in a different order than torch.sum.
    return {"rtol": tol["rtol"], "atol": tol["atol"] * max(1, rows) * 10}


def _rows(shape):
    return int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1


def _kernel_fwd(ops, op, x, weight, bias):
    """(y, saved statistics as for the reference backward) from the compiled kernel."""
    if op == "layer_norm":
        y, mean, rstd = ops.layer_norm_fwd(x, weight, bias, EPS)
        return y, (mean, rstd)
    y, rstd = ops.rms_norm_fwd(x, weight, EPS)
    return y, (rstd,)


def _kernel_bwd(ops, op, grad, saved, weight, bias, stats, memory_efficient):
    if op == "layer_norm":
        mean, rstd = stats
        return ops.layer_norm_bwd(grad, saved, mean, rstd, weight, bias, memory_efficient)
    return ops.rms_norm_bwd(grad, saved, stats[0], weight, memory_efficient)


def _ref_fwd(op, x, weight, bias):
    if op == "layer_norm":
        y, mean, rstd = layer_norm_reference_forward(x, weight, bias, EPS)
        return y, (mean, rstd)
    y, rstd = rms_norm_reference_forward(x, weight, EPS)
    return y, (rstd,)


def _ref_bwd(op, grad, saved, weight, bias, stats, memory_efficient):
    if op == "layer_norm":
        mean, rstd = stats
        return layer_norm_reference_backward(
            grad, saved, weight, bias, mean, rstd, memory_efficient=memory_efficient
        )
    return rms_norm_reference_backward(
        grad, saved, weight, stats[0], memory_efficient=memory_efficient
    )


def _torch_norm(op, x, weight, bias):
    if op == "layer_norm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


def _public(op, x, weight, bias, memory_efficient):
    if op == "layer_norm":
        return layer_norm(x, weight, bias, EPS, memory_efficient=memory_efficient)
    return rms_norm(x, weight, EPS, memory_efficient=memory_efficient)


def _check_kernel_vs_reference(ops, op, x, weight, bias, grad, x_ref, w_ref, b_ref, g_ref, tol):
    """Kernel on (x, weight, bias, grad) vs the reference on the *_ref tensors, both variants."""
    y, stats = _kernel_fwd(ops, op, x, weight, bias)
    y_ref, stats_ref = _ref_fwd(op, x_ref, w_ref, b_ref)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.to(y_ref.dtype), y_ref, **tol)
    for got, want in zip(stats, stats_ref, strict=True):
        assert got.shape == x.shape[:-1]
        assert got.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ptol = _param_tol(tol, x.numel() // x.shape[-1])
    for memory_efficient in (False, True):
        # The reference gets the kernel's (rounded) y, so only the gradient rounding differs.
        saved, saved_ref = (y, y.to(x_ref.dtype)) if memory_efficient else (x, x_ref)
        got = _kernel_bwd(ops, op, grad, saved, weight, bias, stats, memory_efficient)
        want = _ref_bwd(op, g_ref, saved_ref, w_ref, b_ref, stats_ref, memory_efficient)
        assert got[0].dtype == x.dtype and got[1].dtype == weight.dtype
        torch.testing.assert_close(got[0].to(want[0].dtype), want[0], **tol)
        for g_param, w_param in zip(got[1:], want[1:], strict=True):
            torch.testing.assert_close(g_param.to(w_param.dtype), w_param, **ptol)


# References ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_matches_torch(op, dtype):
    x, weight, bias, _ = _inputs((64, 100), dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    torch.testing.assert_close(
        _ref_fwd(op, x, weight, bias)[0], _torch_norm(op, x, weight, bias), **tol
    )
    if op == "layer_norm":
        torch.testing.assert_close(
            layer_norm_reference(x, weight, None, EPS), _torch_norm(op, x, weight, None), **tol
        )


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_reference_backward_matches_autograd(op, memory_efficient):
    x, weight, bias, grad = _inputs((3, 11, 17), torch.float64)
    if op == "rms_norm":
        bias = None
    leaves = [t.requires_grad_(True) for t in (x, weight, bias) if t is not None]
    _torch_norm(op, x, weight, bias).backward(grad)
    with torch.no_grad():
        y, stats = _ref_fwd(op, x, weight, bias)
        saved = y if memory_efficient else x
        got = _ref_bwd(op, grad, saved, weight, bias, stats, memory_efficient)
    for g, leaf in zip(got, leaves, strict=False):
        torch.testing.assert_close(g, leaf.grad, **FP64_TOL)


def test_gradcheck_reference():
    x, weight, bias, _ = _inputs((3, 5, 7), torch.float64)
    inputs = tuple(t.requires_grad_(True) for t in (x, weight, bias))
    assert torch.autograd.gradcheck(lambda *a: layer_norm_reference(*a, EPS), inputs)
    assert torch.autograd.gradcheck(lambda x, w, b: rms_norm_reference(x, w, EPS), inputs)


# CPU kernels --------------------------------------------------------------------------------------


@requires_cpu_ext
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_matches_reference(ops, op, shape, dtype):
    x, weight, bias, grad = _inputs(shape, dtype)
    bias = bias if op == "layer_norm" else None
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    _check_kernel_vs_reference(ops, op, x, weight, bias, grad, x, weight, bias, grad, tol)


@requires_cpu_ext
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 13), (257, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_params", [False, True], ids=["params_same", "params_fp32"])
def test_cpu_kernel_low_precision(ops, op, shape, dtype, fp32_params):
    x, weight, bias, grad = _inputs(shape, dtype, torch.float32 if fp32_params else dtype)
    bias = bias if op == "layer_norm" else None
    # fp32 reference on the same rounded inputs, so only the output rounding differs.
    ref = [None if t is None else t.float() for t in (x, weight, bias, grad)]
    tol = LOW_PRECISION_TOL[dtype]
    _check_kernel_vs_reference(ops, op, x, weight, bias, grad, *ref, tol)


@requires_cpu_ext
def test_cpu_layer_norm_without_bias(ops):
    x, weight, _, grad = _inputs((6, 33), torch.float32)
    _check_kernel_vs_reference(
        ops, "layer_norm", x, weight, None, grad, x, weight, None, grad, FP32_TOL
    )
    # grad_bias is Σ grad even without a bias.
    mean, rstd = _kernel_fwd(ops, "layer_norm", x, weight, None)[1]
    got = ops.layer_norm_bwd(grad, x, mean, rstd, weight, None, False)
    torch.testing.assert_close(got[2], grad.sum(0), **FP32_TOL)


@requires_cpu_ext
@pytest.mark.parametrize("op", OPS)
def test_cpu_kernel_non_contiguous_and_empty(ops, op):
    x, weight, bias, grad = _inputs((12, 8), torch.float32)
    bias = bias if op == "layer_norm" else None
    xt, gt = x.t(), grad.t()  # [8, 12], non-contiguous
    w12 = torch.linspace(0.5, 1.5, 12)
    b12 = None if bias is None else torch.linspace(-1, 1, 12)
    _check_kernel_vs_reference(ops, op, xt, w12, b12, gt, xt, w12, b12, gt, FP32_TOL)
    empty = torch.empty(0, 8)
    y, stats = _kernel_fwd(ops, op, empty, weight, bias)
    assert y.shape == (0, 8) and all(s.shape == (0,) for s in stats)
    grads = _kernel_bwd(ops, op, empty, empty, weight, bias, stats, False)
    assert grads[0].shape == (0, 8)
    assert all(torch.equal(g, torch.zeros(8)) for g in grads[1:])


@requires_cpu_ext
@pytest.mark.parametrize("op", OPS)
def test_cpu_param_grads_are_deterministic(ops, op):
    # Row blocks depend on the shape only, so the thread count cannot change the bits.
    x, weight, bias, grad = _inputs((1024, 96), torch.float32)
    bias = bias if op == "layer_norm" else None
    _, stats = _kernel_fwd(ops, op, x, weight, bias)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_kernel_bwd(ops, op, grad, x, weight, bias, stats, False)[1:])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@requires_cpu_ext
def test_cpu_memory_efficient_zero_weight_gives_nan(ops):
    # x̂ cannot be recovered where weight == 0: the gradients must not come out silently wrong.
    x, weight, bias, grad = _inputs((4, 8), torch.float32)
    weight[3] = 0
    for op in OPS:
        b = bias if op == "layer_norm" else None
        y, stats = _kernel_fwd(ops, op, x, weight, b)
        grads = _kernel_bwd(ops, op, grad, y, weight, b, stats, True)
        assert grads[0].isnan().all()
        assert grads[1][3].isnan()
        ref = _ref_bwd(op, grad, y, weight, b, stats, True)
        assert ref[0].isnan().all() and ref[1][3].isnan()


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    x = torch.randn(4, 8)
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match=r"last dim of x \(8\) must equal the weight size \(7\)"):
        ops.layer_norm_fwd(x, torch.ones(7), None, EPS)
    with pytest.raises(RuntimeError, match="weight must be 1-D"):
        ops.rms_norm_fwd(x, torch.ones(1, 8), EPS)
    with pytest.raises(RuntimeError, match="float32 for bfloat16/float16 x"):
        ops.layer_norm_fwd(x, w.bfloat16(), None, EPS)
    with pytest.raises(RuntimeError, match="bias and weight must have the same dtype"):
        ops.layer_norm_fwd(x.bfloat16(), w, w.bfloat16(), EPS)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.rms_norm_fwd(x.int(), w.int(), EPS)
    with pytest.raises(RuntimeError, match="h must be positive"):
        ops.rms_norm_fwd(torch.empty(4, 0), torch.empty(0), EPS)
    with pytest.raises(RuntimeError, match="eps must be finite"):
        ops.layer_norm_fwd(x, w, None, -1.0)
    _, mean, rstd = ops.layer_norm_fwd(x, w, None, EPS)
    with pytest.raises(RuntimeError, match="grad shape"):
        ops.layer_norm_bwd(torch.randn(4, 9), x, mean, rstd, w, None, False)
    with pytest.raises(RuntimeError, match="mean is required"):
        ops.layer_norm_bwd(x, x, None, rstd, w, None, False)
    with pytest.raises(RuntimeError, match=r"rstd must hold one value per row \(4\)"):
        ops.layer_norm_bwd(x, x, mean, rstd[:3], w, None, False)
    with pytest.raises(RuntimeError, match="rstd must be Float"):
        ops.rms_norm_bwd(x, x, rstd.double(), w, False)


# Public functions and autograd --------------------------------------------------------------------


def test_public_functions_reject_bad_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight must be \[h\] and x \[\.\.\., h\]"):
        layer_norm(x, torch.ones(7), None)
    with pytest.raises(ValueError, match="bias shape"):
        layer_norm(x, torch.ones(8), torch.zeros(7))
    with pytest.raises(ValueError, match="float32 for bfloat16/float16 x"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="eps must be finite"):
        rms_norm(x, torch.ones(8), eps=-1e-5)


@pytest.mark.parametrize("op", OPS)
def test_memory_efficient_rejects_zero_weight_on_cpu(op):
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.ones(8)
    weight[2] = 0
    bias = torch.zeros(8)
    with pytest.raises(ValueError, match="needs every weight entry nonzero; 1 of 8 are zero"):
        _public(op, x, weight, bias, memory_efficient=True)
    # Without autograd nothing is saved, so nothing needs recovering.
    with torch.no_grad():
        _public(op, x, weight, bias, memory_efficient=True)
    _public(op, x, weight, bias, memory_efficient=False).sum().backward()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("fused", ["0", "1"])
def test_gradcheck_function(monkeypatch, request, op, memory_efficient, fused):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, weight, bias, _ = _inputs((3, 5, 7), torch.float64)
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")  # the fused path must actually run the kernel
        expected_tier = "cpu"
    else:
        expected_tier = "reference"
    assert select_tier(op, x) == expected_tier
    x, weight, bias = (t.requires_grad_(True) for t in (x, weight, bias))
    if op == "layer_norm":
        assert torch.autograd.gradcheck(
            lambda x, w, b: LayerNormFunction.apply(x, w, b, EPS, memory_efficient),
            (x, weight, bias),
        )
        assert torch.autograd.gradcheck(
            lambda x, w: LayerNormFunction.apply(x, w, None, EPS, memory_efficient), (x, weight)
        )
    else:
        assert torch.autograd.gradcheck(
            lambda x, w: RMSNormFunction.apply(x, w, EPS, memory_efficient), (x, weight)
        )


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_function_matches_torch(op, memory_efficient, dtype):
    # bf16 activations with float32 parameters, as in mixed-precision training.
    x, weight, bias, grad = _inputs((4, 6, 96), dtype, torch.float32)
    bias = bias if op == "layer_norm" else None
    params = [t for t in (weight, bias) if t is not None]
    leaves = [x.requires_grad_(True), *(p.requires_grad_(True) for p in params)]
    y = _public(op, x, weight, bias, memory_efficient)
    assert y.dtype == dtype
    y.backward(grad)
    got = [y.detach()] + [t.grad for t in leaves]

    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref_bias = ref_leaves[2] if bias is not None else None
    y_ref = _torch_norm(op, ref_leaves[0], ref_leaves[1], ref_bias)
    y_ref.backward(grad.float())
    want = [y_ref.detach()] + [t.grad for t in ref_leaves]
    assert [t.dtype for t in got] == [dtype, dtype] + [torch.float32] * len(params)
    if dtype == torch.float32:
        tols = [FP32_TOL, FP32_TOL] + [_param_tol(FP32_TOL, 24)] * len(params)
    else:
        # One bf16 rounding of y and grad_input; with memory_efficient, x̂ is recovered from the
        # rounded y: error ≈ 2^-9·|y|/|w| ≲ 0.02 (|y| ≲ 5, |w| ≥ 0.5), summed over 24 rows in the
        # parameter gradients.
        loose = memory_efficient
        tols = [
            LOW_PRECISION_TOL[dtype],
            {"rtol": 2**-6, "atol": 0.02 if loose else 1e-3},
            *[{"rtol": 2**-6, "atol": 0.2 if loose else 1e-3}] * len(params),
        ]
    for g, w, tol in zip(got, want, tols, strict=True):
        torch.testing.assert_close(g.float(), w, **tol)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("fused", ["0", "1"])
def test_saved_tensors(monkeypatch, request, op, memory_efficient, fused):
    """Default: x + statistics; memory-efficient: y + rstd; plus the parameters, nothing else."""
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")
    x, weight, bias, grad = _inputs((4, 3, 16), torch.bfloat16, torch.float32)
    bias = bias if op == "layer_norm" else None
    params = [t.requires_grad_(True) for t in (weight, bias) if t is not None]
    x.requires_grad_(True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _public(op, x, weight, bias, memory_efficient)

    activations = [t for t in packed if t.shape == x.shape]
    stats = [t for t in packed if t.shape == x.shape[:-1]]
    saved_params = [t for t in packed if t.shape == weight.shape]
    assert len(activations) + len(stats) + len(saved_params) == len(packed), packed
    # Exactly one activation of size [..., h], and it is the tensor itself (no copy).
    assert len(activations) == 1
    expected = y if memory_efficient else x
    assert activations[0].data_ptr() == expected.data_ptr()
    assert activations[0].dtype == torch.bfloat16
    # Per-row float32 statistics: mean and rstd for LayerNorm, rstd otherwise.
    n_stats = 2 if op == "layer_norm" and not memory_efficient else 1
    assert len(stats) == n_stats and all(s.dtype == torch.float32 for s in stats)
    assert sorted(t.data_ptr() for t in saved_params) == sorted(p.data_ptr() for p in params)
    y.backward(grad)
    assert x.grad is not None and all(p.grad is not None for p in params)


# Recomputed statistics ----------------------------------------------------------------------------


@requires_cpu_ext
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_stats_kernel_matches_forward_bitwise(ops, op, shape, dtype):
    x, weight, bias, _ = _inputs(shape, dtype)
    if op == "layer_norm":
        stats = ops.layer_norm_stats(x, EPS)
        fwd_stats = ops.layer_norm_fwd(x, weight, bias, EPS)[1:]
    else:
        stats = (ops.rms_norm_stats(x, EPS),)
        fwd_stats = ops.rms_norm_fwd(x, weight, EPS)[1:]
    for got, want in zip(stats, fwd_stats, strict=True):
        assert got.shape == want.shape == x.shape[:-1] and got.dtype == want.dtype
        assert torch.equal(got, want)


@requires_cpu_ext
def test_cpu_stats_kernel_rejects_bad_inputs(ops):
    with pytest.raises(RuntimeError, match="h > 0"):
        ops.layer_norm_stats(torch.randn(3, 0), EPS)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.rms_norm_stats(torch.ones(3, 4, dtype=torch.int32), EPS)
    with pytest.raises(RuntimeError, match="eps must be finite"):
        ops.rms_norm_stats(torch.randn(3, 4), -1.0)


def test_reference_stats_match_reference_forward_bitwise():
    x, weight, bias, _ = _inputs((6, 5, 33), torch.bfloat16, torch.float32)
    _, mean, rstd = layer_norm_reference_forward(x, weight, bias, EPS)
    got_mean, got_rstd = layer_norm_reference_stats(x, EPS)
    assert torch.equal(got_mean, mean) and torch.equal(got_rstd, rstd)
    _, rms_rstd = rms_norm_reference_forward(x, weight, EPS)
    assert torch.equal(rms_norm_reference_stats(x, EPS), rms_rstd)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_stats_keeps_x_only_and_gives_the_same_gradients(
    monkeypatch, request, op, fused, dtype
):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")
    x, weight, bias, grad = _inputs((7, 3, 300), dtype, torch.float32)
    bias = bias if op == "layer_norm" else None
    grads = {}
    for recompute in (False, True):
        leaves = [
            t.detach().clone().requires_grad_(True) for t in (x, weight, bias) if t is not None
        ]
        packed = []

        def pack(t, packed=packed):
            packed.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if op == "layer_norm":
                y = layer_norm(*leaves, EPS, recompute_stats=recompute)
            else:
                y = rms_norm(*leaves, EPS, recompute_stats=recompute)
        stats = [t for t in packed if t.shape == x.shape[:-1]]
        assert len(stats) == (0 if recompute else (2 if op == "layer_norm" else 1))
        assert sum(t.shape == x.shape for t in packed) == 1  # x itself
        y.backward(grad)
        grads[recompute] = [leaf.grad for leaf in leaves]
    # The statistics are recomputed by the forward's own code: the gradients are the same bits.
    for kept, recomputed in zip(grads[False], grads[True], strict=True):
        assert torch.equal(kept, recomputed)


def test_recompute_stats_excludes_memory_efficient():
    x, weight, bias, _ = _inputs((4, 8), torch.float32)
    with pytest.raises(ValueError, match="recompute_stats=True recomputes the statistics"):
        layer_norm(x, weight, bias, EPS, memory_efficient=True, recompute_stats=True)
    with pytest.raises(ValueError, match="choose one of them"):
        RMSNorm(8, memory_efficient=True, recompute_stats=True)(x)


# Modules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_modules(cls, sequence_parallel):
    norm = cls(24, eps=1e-6, memory_efficient=True, sequence_parallel=sequence_parallel)
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, torch.ones(24))
    if cls is LayerNorm:
        assert torch.equal(norm.bias, torch.zeros(24))
    else:
        assert norm.bias is None
    params = list(norm.parameters())
    assert len(params) == (2 if cls is LayerNorm else 1)
    assert all(p.sequence_parallel is sequence_parallel for p in params)
    assert "memory_efficient=True" in repr(norm) and "recompute_stats=False" in repr(norm)

    x, weight, bias, _ = _inputs((5, 2, 24), torch.bfloat16, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(weight)
        if norm.bias is not None:
            norm.bias.copy_(bias)
    y = norm(x)
    want = (
        layer_norm_reference(x, weight, bias, 1e-6)
        if cls is LayerNorm
        else rms_norm_reference(x, weight, 1e-6)
    )
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), **LOW_PRECISION_TOL[torch.bfloat16])


def test_module_params_dtype_and_validation():
    norm = RMSNorm(8, params_dtype=torch.bfloat16, device="cpu")
    assert norm.weight.dtype == torch.bfloat16 and norm.weight.device.type == "cpu"
    assert norm(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        LayerNorm(0)


def test_choose_tier():
    both = frozenset({"cpu", "cuda"})
    for op in OPS:
        assert choose_tier(op, "cpu", torch.float64, both) == "cpu"
        assert choose_tier(op, "cuda", torch.bfloat16, both) == "cuda"
        # No float64 CUDA kernel: the reference handles it.
        assert choose_tier(op, "cuda", torch.float64, both) == "reference"


# CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    ("dtype", "param_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
# (4, 7): scalar path; (3, 5, 64): vectorized; (64, 30000) fp32: rows too long for the
# shared-memory cache; (2048, 1024): many rows.
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 64), (64, 30000), (2048, 1024)])
def test_cuda_kernel_matches_reference(op, dtype, param_dtype, shape):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    ops = torch.ops.megapp
    x, weight, bias, grad = _inputs(shape, dtype, param_dtype)
    bias = bias if op == "layer_norm" else None
    ref = [None if t is None else t.float() for t in (x, weight, bias, grad)]
    cuda = [None if t is None else t.cuda() for t in (x, weight, bias, grad)]
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    # Tree reductions and FMA contraction differ from the CPU order: 4× the CPU tolerance.
    tol = {"rtol": 4 * tol["rtol"], "atol": 4 * tol["atol"]}

    y, stats = _kernel_fwd(ops, op, *cuda[:3])
    y_ref, stats_ref = _ref_fwd(op, *ref[:3])
    torch.testing.assert_close(y.float().cpu(), y_ref, **tol)
    for got, want in zip(stats, stats_ref, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    rows = x.numel() // shape[-1]
    for memory_efficient in (False, True):
        saved, saved_ref = (y, y.float().cpu()) if memory_efficient else (cuda[0], ref[0])
        args = (cuda[3], saved, cuda[1], cuda[2], stats, memory_efficient)
        got = _kernel_bwd(ops, op, *args)
        want = _ref_bwd(op, ref[3], saved_ref, ref[1], ref[2], stats_ref, memory_efficient)
        torch.testing.assert_close(got[0].float().cpu(), want[0], **tol)
        for g, w in zip(got[1:], want[1:], strict=True):
            assert g.dtype == param_dtype
            torch.testing.assert_close(g.float().cpu(), w, rtol=tol["rtol"], atol=1e-4 * rows)
        # Deterministic parameter gradients: a second run gives the same bits.
        again = _kernel_bwd(ops, op, *args)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", OPS)
def test_cuda_public_function_matches_torch(op):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    x, weight, bias, grad = _inputs((8, 4, 512), torch.float32, device="cuda")
    bias = bias if op == "layer_norm" else None
    for memory_efficient in (False, True):
        leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias) if t is not None]
        y = _public(
            op, leaves[0], leaves[1], leaves[2] if bias is not None else None, memory_efficient
        )
        y.backward(grad)
        ref_leaves = [t.detach().requires_grad_(True) for t in leaves]
        y_ref = _torch_norm(
            op, ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias is not None else None
        )
        y_ref.backward(grad)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(leaves, ref_leaves, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-3)
