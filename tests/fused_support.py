"""Fixtures and helpers shared by the fused-op tests (tests/test_fused_*.py)."""

from __future__ import annotations

import os

import pytest
import torch

from megapp.fusions.extension import cpu_ops_available

# A missing build is a defect: kernel tests fail unless the install was deliberately pure-Python.
requires_cpu_ext = pytest.mark.skipif(
    os.environ.get("MEGAPP_BUILD_CPU_EXT") == "0",
    reason="MEGAPP_BUILD_CPU_EXT=0: installed without the C++ extension",
)


@pytest.fixture
def ops():
    assert cpu_ops_available(), (
        "megapp._C is not built or failed to load: run `pip install --no-build-isolation -e .` "
        "(set MEGAPP_BUILD_CPU_EXT=0 to test a pure-Python install)"
    )
    return torch.ops.megapp


@pytest.fixture(autouse=True)
def _fused_enabled(monkeypatch):
    # Tests set MEGAPP_FUSED themselves; an exported value must not change what they check.
    monkeypatch.delenv("MEGAPP_FUSED", raising=False)


def grad_bias_tol(tol, rows):
    # grad_bias sums `rows` terms in a different order than torch.sum: allow ~rows·eps·|terms|.
    return {"rtol": tol["rtol"], "atol": tol["atol"] * max(1, rows) * 10}
