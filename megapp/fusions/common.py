"""What every fused op's Python front shares: the accumulation dtype of its math, running the
tier :func:`~megapp.fusions.extension.select_tier` chose, and the check of an added bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

Result = TypeVar("Result")


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
