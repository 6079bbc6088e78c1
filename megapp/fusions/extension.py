"""Loading of megapp's compiled op libraries, the choice of implementation tier and running it.

``megapp._C`` defines every ``torch.ops.megapp`` op and registers the CPU kernels;
``megapp._C_cuda`` (optional) registers CUDA kernels for the same ops. Neither has a Python
module init: they are located with ``importlib`` and loaded with ``torch.ops.load_library``.

Each fused op runs in one of three tiers: ``"cuda"``, ``"cpu"`` (compiled kernels) or
``"reference"`` (pure PyTorch). ``MEGAPP_FUSED=0`` forces the reference everywhere.
:func:`select_tier` chooses one per call and :func:`run_tier` runs it; every op's Python
front also shares the accumulation dtype of its math (:func:`acc_dtype`) and the check of an
added bias (:func:`check_bias`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

Result = TypeVar("Result")

CPU_EXTENSION = "megapp._C"
CUDA_EXTENSION = "megapp._C_cuda"

# Dtypes each compiled tier implements, per op.
_FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})
_ALL = {"cpu": _FLOATS | {torch.float64}, "cuda": _FLOATS}
KERNEL_DTYPES: dict[str, dict[str, frozenset[torch.dtype]]] = {
    "bias_gelu": _ALL,
    "bias_swiglu": _ALL,
    "bias_dropout_add": _ALL,
    "scaled_masked_softmax": _ALL,
    "layer_norm": _ALL,
    "rms_norm": _ALL,
    "rope": _ALL,
    "cross_entropy": _ALL,
}


def _library_path(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # the parent package itself is missing
        return None
    return spec.origin if spec is not None else None


@functools.cache
def _load_library(name: str) -> bool:
    path = _library_path(name)
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
    except OSError as err:  # e.g. built against another torch; fall back to the reference
        logger.warning("megapp: could not load %s from %s: %s", name, path, err)
        return False
    return True


@functools.cache
def cpu_ops_available() -> bool:
    """Whether ``megapp._C`` is built and loaded (``torch.ops.megapp`` CPU kernels)."""
    return _load_library(CPU_EXTENSION)


@functools.cache
def cuda_ops_available() -> bool:
    """Whether a CUDA device is usable and ``megapp._C_cuda`` is built and loaded."""
    # _C_cuda only registers kernels for ops that _C defines, so _C must load first.
    return torch.cuda.is_available() and cpu_ops_available() and _load_library(CUDA_EXTENSION)


def built_tiers() -> frozenset[str]:
    """The compiled tiers usable in this process: a subset of ``{"cpu", "cuda"}``."""
    tiers = set()
    if cpu_ops_available():
        tiers.add("cpu")
    if cuda_ops_available():
        tiers.add("cuda")
    return frozenset(tiers)


def fused_enabled() -> bool:
    """False when the environment sets ``MEGAPP_FUSED=0``."""
    return os.environ.get("MEGAPP_FUSED", "1") != "0"


@contextlib.contextmanager
def fused(enabled: bool) -> Iterator[None]:
    """Set ``MEGAPP_FUSED`` for the block (the tier is chosen per call, so this switches it):
    the compiled kernels where built (True) or the pure-PyTorch reference (False)."""
    before = os.environ.get("MEGAPP_FUSED")
    os.environ["MEGAPP_FUSED"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MEGAPP_FUSED"]
        else:
            os.environ["MEGAPP_FUSED"] = before


def choose_tier(
    op: str,
    device_type: str,
    dtype: torch.dtype,
    built: frozenset[str],
    *,
    enabled: bool | None = None,
) -> str:
    """Pick ``"cuda"``, ``"cpu"`` or ``"reference"`` for one call of ``op``.

    Pure: ``built`` says which compiled tiers exist (see :func:`built_tiers`); ``enabled``
    defaults to :func:`fused_enabled`. A compiled tier is chosen only when it was built, matches
    the device type and implements ``dtype``.
    """
    if op not in KERNEL_DTYPES:
        raise ValueError(f"unknown fused op {op!r}; known: {sorted(KERNEL_DTYPES)}")
    if enabled is None:
        enabled = fused_enabled()
    if enabled and device_type in built and dtype in KERNEL_DTYPES[op].get(device_type, ()):
        return device_type
    return "reference"


def select_tier(op: str, x: torch.Tensor) -> str:
    """:func:`choose_tier` for a tensor argument, logging each new choice once.

    Decided once per (op, device type, dtype, ``MEGAPP_FUSED``): the environment is still
    read on every call, so setting ``MEGAPP_FUSED=0`` takes effect in a running process.
    """
    return _select(op, x.device.type, x.dtype, fused_enabled())


@functools.cache
def _select(op: str, device_type: str, dtype: torch.dtype, enabled: bool) -> str:
    tier = choose_tier(op, device_type, dtype, built_tiers(), enabled=enabled)
    _log_tier(op, device_type, dtype, tier)
    return tier


@functools.cache
def cpu_kernels_isa() -> str | None:
    """The instruction set of the CPU kernels' vectorized loops in this process (``"avx2"`` or
    ``"default"``, chosen once after torch's CPU capability), or None without ``megapp._C``."""
    return str(torch.ops.megapp.cpu_kernels_isa()) if cpu_ops_available() else None


@functools.cache
def _log_tier(op: str, device_type: str, dtype: torch.dtype, tier: str) -> None:
    # Cached: logs once per (op, device type, dtype) and again only if the tier changes.
    isa = f" ({cpu_kernels_isa()} vector loops)" if tier == "cpu" else ""
    logger.info(
        "megapp: %s on %s/%s uses the %s implementation%s", op, device_type, dtype, tier, isa
    )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a fused op computes in for inputs of ``dtype``: float32 for float32, bfloat16 and
    float16 (as the compiled kernels), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def run_tier(
    tier: str, kernel: str, reference: Callable[..., Result], *args: Any, **kwargs: Any
) -> Result:
    """``reference(*args, **kwargs)`` in the ``"reference"`` tier, else the compiled op
    ``torch.ops.megapp.<kernel>`` with the same arguments (its CPU or CUDA kernel, by the
    arguments' device).

    The reference and the op take the same arguments: by position, or by name where their orders
    differ (the op's names are those of its schema in ``csrc/``).
    """
    if tier == "reference":
        return reference(*args, **kwargs)
    # Looked up per call: torch.ops.megapp has the op only once megapp._C is loaded.
    return getattr(torch.ops.megapp, kernel)(*args, **kwargs)


def check_bias(op: str, x: torch.Tensor, bias: torch.Tensor, size: str = "h") -> None:
    """Raise ``ValueError`` naming ``op`` unless bias ``[size]`` fits x ``[..., size]`` in shape
    and dtype (``size`` is how the message writes the last dim, e.g. ``"h"`` or ``"2f"``)."""
    if bias.dim() != 1 or x.dim() == 0 or x.shape[-1] != bias.shape[0]:
        raise ValueError(
            f"{op}: bias must be [{size}] and x [..., {size}]; got x {tuple(x.shape)}, "
            f"bias {tuple(bias.shape)}"
        )
    if x.dtype != bias.dtype:
        raise ValueError(f"{op}: x and bias dtypes differ: {x.dtype} vs {bias.dtype}")
