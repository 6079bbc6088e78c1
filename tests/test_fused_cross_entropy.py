"""Fused vocab-parallel cross entropy: CPU (and CUDA) kernels against the PyTorch reference,
the loss against torch's cross entropy, and what backward keeps."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from megapp.fusions import choose_tier, cuda_ops_available
from megapp.tensor_parallel import vocab_parallel_cross_entropy
from megapp.tensor_parallel.cross_entropy import (
    cross_entropy_bwd_reference,
    cross_entropy_fwd_max_reference,
    cross_entropy_fwd_sums_reference,
)
from tests import support
from tests.support import requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

LOW_PRECISION = [torch.bfloat16, torch.float16]

# Shard geometries (w, start, real): a whole shard of real ids; the last shard with padding
# inside; a shard of padding only; a middle shard; rows shorter than one vector and rows with a
# partial vector at the end (8 float lanes, 16 bf16); a whole 32000-id vocabulary (the sums
# run in 1024-id chunks).
GEOMETRIES = [
    (1000, 0, 1000),
    (32000, 0, 32000),
    (1000, 3000, 993),
    (300, 600, 0),
    (37, 74, 37),
    (5, 0, 3),
    (33, 33, 20),
]

# fp32: kernel and reference do the same float operations per id (z − m, exp, − log Z, ...) and
# differ in two ways: exp (Sleef's vector exp against torch's, both within 1 ulp) and the order
# of the row sums (1024-id chunks of 4 × 8 vector lanes against torch's own), measured ≤ 5e-7
# relative on sums over up to 32000 ids (either is that close to a float64 sum). rtol 1e-5
# leaves a margin of 20; atol covers gradients near 0 (a few ulp of 1; measured ≤ 6e-8).
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
FP64_TOL = {"rtol": 1e-12, "atol": 1e-14}
# bf16/fp16 logits are widened exactly and the math is fp32's, so sums and losses (float32)
# meet FP32_TOL; gradients are rounded once to the logits' dtype, so see _assert_one_step.


def _inputs(rows_shape, w, start, real, dtype, seed=0):
    """Logits ``[*rows_shape, w]`` (padding ids hold garbage), global int64 targets inside and
    outside the shard, and per-row m, log Z and loss gradient consistent with other shards."""
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(*rows_shape, w, generator=gen, dtype=torch.float64)
    logits[..., real:] = 1e4  # would dominate every sum if a padding id leaked in
    logits = logits.to(dtype)
    # Targets in [start − 3, start + real + 3) clipped at 0: ids just outside the shard on both
    # sides (other ranks' ids), the first and last real id, and the padding ids after it.
    target = torch.randint(max(start - 3, 0), start + real + 3, rows_shape, generator=gen)
    flat = target.view(-1)
    if flat.numel() >= 4:
        # Off the shard's real ids for sure: the id after them, and one before the shard.
        flat[2], flat[3] = start + real, start - 1 if start > 0 else start + real + 2
        if real > 0:  # and the first and last real id
            flat[0], flat[1] = start, start + real - 1
    acc = torch.promote_types(dtype, torch.float32)
    local_max = cross_entropy_fwd_max_reference(logits, real)
    # Another shard may hold the global max: add a random non-negative amount.
    other = 2 * torch.rand(rows_shape, generator=gen, dtype=torch.float64).to(acc)
    row_max = torch.where(torch.isinf(local_max), other, local_max + other)
    sums = cross_entropy_fwd_sums_reference(logits, target, row_max, start, real, False)
    log_z = torch.log(sums[..., 0] + torch.rand(rows_shape, generator=gen).to(acc) + 0.1)
    grad_loss = (torch.rand(rows_shape, generator=gen) + 0.5).to(acc)
    return logits, target, row_max, log_z, grad_loss


def _assert_one_step(got, want, dtype):
    """bf16/fp16 values rounded once from float results that differ by round-off: equal, or one
    step of ``dtype`` apart where the float values straddle a rounding boundary (rare)."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    step = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool((diff <= step).all()), f"off by more than one {dtype} step: {diff.max()}"
    assert int((diff != 0).sum()) <= max(1, 0.01 * diff.numel())


def _tol(dtype):
    return FP64_TOL if dtype == torch.float64 else FP32_TOL


@contextlib.contextmanager
def _fused(monkeypatch, enabled: bool):
    with monkeypatch.context() as m:
        m.setenv("MEGAPP_FUSED", "1" if enabled else "0")
        yield


# Kernels against the reference ----------------------------------------------------------------


@requires_cpu_ext
@pytest.mark.parametrize(("w", "start", "real"), GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW_PRECISION])
def test_cpu_kernel_forward_matches_reference(ops, w, start, real, dtype):
    logits, target, row_max, _, _ = _inputs((3, 4), w, start, real, dtype)
    # The max is exact in any order: bit for bit.
    local_max = ops.cross_entropy_fwd_max(logits, real)
    assert torch.equal(local_max, cross_entropy_fwd_max_reference(logits, real))
    for smoothing in (False, True):
        got = ops.cross_entropy_fwd_sums(logits, target, row_max, start, real, smoothing)
        want = cross_entropy_fwd_sums_reference(logits, target, row_max, start, real, smoothing)
        assert got.shape == (3, 4, 3 if smoothing else 2) and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **_tol(dtype))
        # z_t − m is one subtraction in both: identical, and 0 exactly off the shard.
        assert torch.equal(got[..., 1], want[..., 1])
    local = target - start
    off_shard = (local < 0) | (local >= real)
    assert bool(off_shard.any()) and (real == 0 or bool((~off_shard).any()))
    assert bool((got[..., 1][off_shard] == 0).all())


@requires_cpu_ext
@pytest.mark.parametrize(("w", "start", "real"), GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW_PRECISION])
@pytest.mark.parametrize("eps", [0.0, 0.1 * 50257 / 50256])
def test_cpu_kernel_backward_matches_reference(ops, w, start, real, dtype, eps):
    logits, target, row_max, log_z, grad_loss = _inputs((3, 4), w, start, real, dtype, seed=1)
    args = (grad_loss, logits, target, row_max, log_z, start, real, eps, 50257)
    got = ops.cross_entropy_bwd(*args)
    want = cross_entropy_bwd_reference(*args)
    if dtype in LOW_PRECISION:
        _assert_one_step(got, want, dtype)
    else:
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(got[..., real:], torch.zeros_like(got[..., real:])), "padding gradient"


@requires_cpu_ext
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW_PRECISION])
def test_cpu_kernel_loss_and_grad_match_reference_tier(monkeypatch, smoothing, dtype):
    # The whole Function on one rank with padding (vocab_size 1000 < w = 1003): loss and
    # gradient of the CPU tier against the reference tier on the same inputs.
    logits, *_ = _inputs((6, 5), 1003, 0, 1000, dtype, seed=2)
    target = torch.randint(0, 1000, (6, 5), generator=torch.Generator().manual_seed(2))
    target[0, 0], target[-1, -1] = 0, 999
    grad_out = torch.rand(6, 5, generator=torch.Generator().manual_seed(3)) + 0.5
    results = {}
    for fused in (True, False):
        with _fused(monkeypatch, fused):
            leaf = logits.clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(leaf, target, smoothing, vocab_size=1000)
            loss.backward(grad_out.to(loss.dtype))
        results[loss.grad_fn.tier] = (loss.detach(), leaf.grad)
    assert sorted(results) == ["cpu", "reference"]
    (loss_k, grad_k), (loss_r, grad_r) = results["cpu"], results["reference"]
    assert loss_k.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(loss_k, loss_r, **_tol(dtype))
    if dtype in LOW_PRECISION:
        _assert_one_step(grad_k, grad_r, dtype)
    else:
        torch.testing.assert_close(grad_k, grad_r, **_tol(dtype))


@requires_cpu_ext
def test_cpu_kernel_non_contiguous_and_empty(ops):
    logits, target, row_max, log_z, grad_loss = _inputs((4, 3), 37, 37, 30, torch.float32)
    # A transposed view of the logits rows and of every per-row tensor.
    lt, tt, mt = logits.transpose(0, 1), target.t(), row_max.t()
    assert not lt.is_contiguous() and not tt.is_contiguous()
    torch.testing.assert_close(
        ops.cross_entropy_fwd_sums(lt, tt, mt, 37, 30, True),
        cross_entropy_fwd_sums_reference(lt, tt, mt, 37, 30, True),
        **FP32_TOL,
    )
    args = (grad_loss.t(), lt, tt, mt, log_z.t(), 37, 30, 0.05, 67)
    torch.testing.assert_close(
        ops.cross_entropy_bwd(*args), cross_entropy_bwd_reference(*args), **FP32_TOL
    )
    empty, none = torch.empty(0, 7), torch.empty(0, dtype=torch.int64)
    assert ops.cross_entropy_fwd_max(empty, 7).shape == (0,)
    assert ops.cross_entropy_fwd_sums(empty, none, torch.empty(0), 0, 7, True).shape == (0, 3)
    rows = torch.empty(0)
    assert ops.cross_entropy_bwd(rows, empty, none, rows, rows, 0, 7, 0.0, 7).shape == (0, 7)


@requires_cpu_ext
def test_cpu_kernel_is_deterministic(ops):
    # Each row is reduced by one task in a fixed order: the thread count cannot change the bits.
    logits, target, row_max, log_z, grad_loss = _inputs((64,), 5000, 0, 4990, torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(
                (
                    ops.cross_entropy_fwd_max(logits, 4990),
                    ops.cross_entropy_fwd_sums(logits, target, row_max, 0, 4990, True),
                    ops.cross_entropy_bwd(
                        grad_loss, logits, target, row_max, log_z, 0, 4990, 0.1, 4990
                    ),
                )
            )
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    logits, target, row_max, log_z, grad_loss = _inputs((2, 3), 8, 0, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"real \(9\) must be in \[0, w\] with w = 8"):
        ops.cross_entropy_fwd_max(logits, 9)
    with pytest.raises(RuntimeError, match="logits must be"):
        ops.cross_entropy_fwd_max(torch.empty(3, 0), 0)
    with pytest.raises(RuntimeError, match="target must be Long"):
        ops.cross_entropy_fwd_sums(logits, target.int(), row_max, 0, 8, False)
    with pytest.raises(RuntimeError, match=r"row_max must be logits.shape\[:-1\]"):
        ops.cross_entropy_fwd_sums(logits, target, row_max[0], 0, 8, False)
    with pytest.raises(RuntimeError, match="log_z must be Float"):
        ops.cross_entropy_bwd(grad_loss, logits, target, row_max, log_z.double(), 0, 8, 0.0, 8)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.cross_entropy_fwd_max(logits.int(), 8)


# The loss and its gradient ---------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_gradcheck_float64(monkeypatch, fused, smoothing):
    # Padding (vocab_size 9 < 11), a target at either end of the real ids.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 2, 11, generator=gen, dtype=torch.float64)
    target = torch.tensor([[0, 8], [3, 3], [8, 1]])
    expected = "cpu" if fused and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0" else "reference"
    with _fused(monkeypatch, fused):
        loss = vocab_parallel_cross_entropy(logits.requires_grad_(), target, vocab_size=9)
        assert loss.grad_fn.tier == expected  # the tier gradcheck below runs
        assert torch.autograd.gradcheck(
            lambda z: vocab_parallel_cross_entropy(z, target, smoothing, vocab_size=9), (logits,)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_matches_torch_cross_entropy(dtype, smoothing):
    # One process (tp_group=None), 40 real ids of a padded width of 48. Megatron's smoothing s
    # keeps 1 − s on the target; torch's label_smoothing ε keeps 1 − ε + ε/K: ε = s·K/(K − 1).
    vocab, width = 40, 48
    gen = torch.Generator().manual_seed(5)
    full = 4 * torch.randn(4, 3, width, generator=gen, dtype=torch.float64)
    target = torch.randint(0, vocab, (4, 3), generator=gen)
    grad_out = torch.rand(4, 3, generator=gen, dtype=torch.float64) + 0.5
    logits = full.to(dtype).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, smoothing, vocab_size=vocab)
    loss.backward(grad_out.to(loss.dtype))

    ref_logits = logits.detach()[..., :vocab].double().requires_grad_()  # the same rounded values
    ref = F.cross_entropy(
        ref_logits.reshape(-1, vocab),
        target.reshape(-1),
        reduction="none",
        label_smoothing=smoothing * vocab / (vocab - 1),
    ).view(4, 3)
    ref.backward(grad_out)
    # float32 loss: log Z and the sums carry a few float32 roundings (see FP32_TOL).
    torch.testing.assert_close(loss.double(), ref, **_tol(dtype))
    grad = logits.grad
    if dtype == torch.bfloat16:  # the float32 gradient rounded once: half a bf16 step
        torch.testing.assert_close(
            grad[..., :vocab].double(), ref_logits.grad, rtol=2**-8, atol=1e-6
        )
    else:
        torch.testing.assert_close(grad[..., :vocab].double(), ref_logits.grad, **_tol(dtype))
    assert torch.equal(grad[..., vocab:], torch.zeros_like(grad[..., vocab:]))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_keeps_the_logits_and_per_row_values_only(monkeypatch, fused, dtype):
    # [s=16, b=2, w=512]: the tensors saved for backward are the logits shard itself (in its own
    # dtype) plus, per row, a copy of the int64 target and float32 m and log Z. The former one
    # kept a float32 softmax [s, b, w]: twice the bytes of bf16 logits.
    rows, width = 16 * 2, 512
    logits = torch.randn(16, 2, width).to(dtype).requires_grad_()
    target = torch.randint(0, width, (16, 2))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with _fused(monkeypatch, fused), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = vocab_parallel_cross_entropy(logits, target, 0.1)
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    assert nbytes == logits.numel() * logits.element_size() + rows * (8 + 4 + 4)
    big = [t for t in saved if t.numel() > rows]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr() and big[0].dtype == dtype
    if dtype == torch.bfloat16:
        assert nbytes < rows * width * 4  # less than the former float32 softmax alone
    loss.sum().backward()
    assert logits.grad.dtype == dtype


def test_backward_does_not_read_the_callers_target():
    # The Function keeps its own copy of the ids: refilling the label buffer after the forward
    # (as a data loader may) does not change the gradient.
    logits = torch.randn(3, 10, requires_grad=True)
    labels = torch.tensor([1, 4, 9])
    loss = vocab_parallel_cross_entropy(logits, labels)
    want = torch.autograd.grad(loss.sum(), logits, retain_graph=True)[0]
    labels.fill_(0)
    assert torch.equal(torch.autograd.grad(loss.sum(), logits)[0], want)


def test_choose_tier():
    both = frozenset({"cpu", "cuda"})
    assert choose_tier("cross_entropy", "cpu", torch.float64, both) == "cpu"
    assert choose_tier("cross_entropy", "cpu", torch.float16, both) == "cpu"
    assert choose_tier("cross_entropy", "cuda", torch.bfloat16, both) == "cuda"
    assert choose_tier("cross_entropy", "cuda", torch.float64, both) == "reference"
    assert choose_tier("cross_entropy", "cpu", torch.float32, frozenset()) == "reference"
    assert choose_tier("cross_entropy", "cpu", torch.float32, both, enabled=False) == "reference"


# CUDA -------------------------------------------------------------------------------------------

# Widths for each CUDA path: 16-byte packs (1000 and 2000 ids, whole packs in every dtype; padding
# inside the last pack of the first), elements one by one (37, 1003: rows not a whole number of
# packs), a long row (32000: many packs per thread) and a shard of padding only.
CUDA_GEOMETRIES = [
    (1000, 0, 997),
    (2000, 2000, 2000),
    (37, 37, 30),
    (1003, 0, 1003),
    (32000, 0, 32000),
    (64, 640, 0),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
@pytest.mark.parametrize(("w", "start", "real"), CUDA_GEOMETRIES)
def test_cuda_kernel_matches_cpu_kernel(dtype, w, start, real):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    ops = torch.ops.megapp
    logits, target, row_max, log_z, grad_loss = _inputs((5, 7), w, start, real, dtype)
    cuda = [t.cuda() for t in (logits, target, row_max, log_z, grad_loss)]
    logits_c, target_c, row_max_c, log_z_c, grad_loss_c = cuda
    local_max = ops.cross_entropy_fwd_max(logits_c, real)
    assert torch.equal(local_max.cpu(), ops.cross_entropy_fwd_max(logits, real))
    # CUDA's expf and its block-tree sums differ from the CPU's Sleef exp and lane sums by a few
    # ulp: FP32_TOL.
    got = ops.cross_entropy_fwd_sums(logits_c, target_c, row_max_c, start, real, True)
    want = ops.cross_entropy_fwd_sums(logits, target, row_max, start, real, True)
    torch.testing.assert_close(got.cpu(), want, **FP32_TOL)
    assert torch.equal(got[..., 1].cpu(), want[..., 1])
    again = ops.cross_entropy_fwd_sums(logits_c, target_c, row_max_c, start, real, True)
    assert torch.equal(got, again)  # deterministic: a fixed reduction tree
    args = (start, real, 0.1, 50257)
    grad = ops.cross_entropy_bwd(grad_loss_c, logits_c, target_c, row_max_c, log_z_c, *args).cpu()
    want_grad = ops.cross_entropy_bwd(grad_loss, logits, target, row_max, log_z, *args)
    if dtype in LOW_PRECISION:
        _assert_one_step(grad, want_grad, dtype)
    else:
        torch.testing.assert_close(grad, want_grad, **FP32_TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_unaligned_autograd():
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    shape, vocab = (4, 3, 256), 250
    logits64, *_ = _inputs(shape[:-1], shape[-1], 0, vocab, torch.float64)
    target = torch.randint(0, vocab, shape[:-1], generator=torch.Generator().manual_seed(6))
    # Logits 2 bytes past a 16-byte boundary: the element-by-element kernels must run.
    buf = torch.empty(logits64.numel() + 1, dtype=torch.bfloat16, device="cuda")
    logits = buf[1:].view(shape)
    logits.copy_(logits64)
    assert logits.data_ptr() % 16 != 0
    logits.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(logits, target.cuda(), 0.1, vocab_size=vocab)
    assert loss.grad_fn.tier == "cuda"
    loss.sum().backward()
    cpu = logits.detach().cpu().requires_grad_(True)
    loss_cpu = vocab_parallel_cross_entropy(cpu, target, 0.1, vocab_size=vocab)
    loss_cpu.sum().backward()
    torch.testing.assert_close(loss.cpu(), loss_cpu, **FP32_TOL)
    _assert_one_step(logits.grad.cpu(), cpu.grad, torch.bfloat16)
