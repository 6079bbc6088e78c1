"""The CPU kernels' vectorized loops: which instruction-set build runs, and each build's results.

``megapp._C`` holds the row loops of bias + GeLU, bias + SwiGLU, bias + dropout + residual,
the scaled masked softmax, LayerNorm, RMSNorm, RoPE and the cross entropy twice: a baseline build
and, on x86-64 with GCC, an AVX2 build, chosen once per process after torch's own CPU capability
(``ATEN_CPU_CAPABILITY=default`` selects the baseline). The kernel tests in
test_fused_{bias_dropout_add,bias_gelu,bias_swiglu,norm,softmax,rope}.py check whichever build
this process runs; one test here runs them again in a process pinned to the baseline build
(test_fused_cross_entropy.py does so for its own kernels).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapp.fusions.bias_ops import bias_gelu_reference, bias_swiglu_reference
from megapp.fusions.norm import layer_norm_reference
from megapp.fusions.rms_norm import rms_norm_reference
from megapp.fusions.rope import rope_reference, rotary_freqs
from megapp.fusions.softmax import scaled_masked_softmax_reference
from tests import support
from tests.support import requires_cpu_ext

ops = support.ops
fused_unset = support.fused_unset

REPO = Path(__file__).resolve().parents[1]
KERNEL_TESTS = [
    "tests/test_fused_bias_dropout_add.py",
    "tests/test_fused_bias_gelu.py",
    "tests/test_fused_bias_swiglu.py",
    "tests/test_fused_cross_entropy.py",
    "tests/test_fused_norm.py",
    "tests/test_fused_rope.py",
    "tests/test_fused_softmax.py",
    "tests/test_fused_cpu_isa.py",
]


def _expected_isa() -> str:
    torch_isa = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "avx2" if x86 and torch_isa in ("AVX2", "AVX512") else "default"


@requires_cpu_ext
def test_cpu_kernels_isa_follows_torch(ops):
    # The AVX2 build exists on x86-64 GCC builds (the project's Linux toolchain).
    assert ops.cpu_kernels_isa() == _expected_isa(), (
        f"torch runs {torch.backends.cpu.get_cpu_capability()} kernels on {platform.machine()}"
    )


def _shapes():
    # Rows longer than one 256-element staging chunk, with partial vectors at the end of a chunk
    # and of a row, and rows shorter than one vector.
    return [(64, 1000), (33, 300), (128, 13), (16, 5)]


def _rope_freqs(x):
    # Angles for rows of x as positions (one row per position), on the even part of the row: an
    # odd last channel passes through.
    return rotary_freqs(x.shape[0], x.shape[-1] // 2 * 2)


# op -> (kernel forward, reference forward, x's last dim in units of h, number of parameters:
# (), (bias,), (weight,) or (weight, bias)). Softmax and RoPE see x [rows, h] as
# [1, 1, rows, h] scores and as [rows, 1, 1, h] heads.
_FORWARDS = {
    "bias_gelu": (lambda ops, x, b: ops.bias_gelu_fwd(x, b), bias_gelu_reference, 1, 1),
    "bias_swiglu": (lambda ops, x, b: ops.bias_swiglu_fwd(x, b), bias_swiglu_reference, 2, 1),
    "layer_norm": (
        lambda ops, x, w, b: ops.layer_norm_fwd(x, w, b, 1e-5)[0],
        lambda x, w, b: layer_norm_reference(x, w, b, 1e-5),
        1,
        2,
    ),
    "rms_norm": (
        lambda ops, x, w: ops.rms_norm_fwd(x, w, 1e-5)[0],
        lambda x, w: rms_norm_reference(x, w, 1e-5),
        1,
        1,
    ),
    "scaled_masked_softmax": (
        lambda ops, x: ops.scaled_masked_softmax_fwd(x[None, None], None, 0.5, False)[0, 0],
        lambda x: scaled_masked_softmax_reference(x[None, None], None, 0.5, False)[0, 0],
        1,
        0,
    ),
    "rope": (
        lambda ops, x: ops.rope_fwd(x[:, None, None], _rope_freqs(x))[:, 0, 0],
        lambda x: rope_reference(x[:, None, None], _rope_freqs(x))[:, 0, 0],
        1,
        0,
    ),
}


@requires_cpu_ext
@pytest.mark.parametrize("op", sorted(_FORWARDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_outputs_round_to_nearest(ops, op, dtype):
    # The kernels compute in float and round once, to nearest even, like `.to(dtype)` of the
    # float reference: the two can differ only where the float values straddle a rounding
    # boundary (they differ by round-off), then by one step of the output type. Truncating, or
    # rounding twice, would differ on about half of the elements.
    kernel, reference, width, num_params = _FORWARDS[op]
    gen = torch.Generator().manual_seed(1)
    mismatched = total = 0
    for shape in _shapes():
        cols = width * shape[-1]
        x = (2 * torch.randn(*shape[:-1], cols, generator=gen)).to(dtype)
        params = [(0.3 * torch.randn(cols, generator=gen)).to(dtype) for _ in range(num_params)]
        if op.endswith("norm"):
            params[0] = (params[0] + 1).to(dtype)  # weight around 1
        got = kernel(ops, x, *params)
        want = reference(x.float(), *(p.float() for p in params)).to(dtype)
        assert got.dtype == dtype and got.shape == want.shape
        diff = got.float() - want.float()
        # At least one step of `dtype` at each value (eps·|value| >= the spacing there).
        step = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool((diff.abs() <= step).all()), f"{op} {shape}: off by more than one step"
        mismatched += int((diff != 0).sum())
        total += diff.numel()
    assert mismatched <= 0.01 * total, f"{op}: {mismatched} of {total} elements rounded differently"


@pytest.mark.slow  # a pytest subprocess on the baseline build
@requires_cpu_ext
@pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default",
    reason="this process already runs the baseline build",
)
def test_baseline_build_passes_the_kernel_tests(ops):
    if ops.cpu_kernels_isa() == "default":
        pytest.skip("the baseline build is the one this process runs; the other tests cover it")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(REPO)}
    selection = "cpu_kernel or cpu_grad or cpu_param or cpu_layer_norm or cpu_memory or round"
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, "-k", selection, *KERNEL_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
