"""Loss scaling for 16-bit training: a constant scale, a dynamic one, and the inf/nan check.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to
zero; the gradients are multiplied by ``inv_scale`` before the optimizer step. When any rank
finds an inf or nan gradient (:func:`found_inf_in`), every rank skips the step and
``update(True)`` lowers the scale; after a run of clean steps the scale grows again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megapp import comm


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ConstantGradScaler:
    """A fixed loss scale; ``update`` does nothing.

    ``scale`` and ``inv_scale`` are fp32 one-element tensors on ``device`` (default: the
    current CUDA device when there is one, else CPU), ready to multiply losses and gradients.
    """

    def __init__(self, scale: float, *, device: torch.device | str | None = None) -> None:
        if not scale > 0.0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.device = torch.device(device) if device is not None else _default_device()
        self._set_scale(float(scale))

    def _set_scale(self, value: float) -> None:
        self._scale = value
        # Cached so every microbatch multiplies by a device tensor without a host copy.
        self._scale_tensor = torch.tensor([value], dtype=torch.float32, device=self.device)
        # Reciprocal in fp64 first: exact for the powers of two the dynamic scaler uses.
        self._inv_tensor = self._scale_tensor.double().reciprocal().float()

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale, shape ``[1]``, fp32."""
        return self._scale_tensor

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``, shape ``[1]``, fp32: the factor that unscales gradients."""
        return self._inv_tensor

    @property
    def scale_value(self) -> float:
        """The loss scale as a Python float (no device sync)."""
        return self._scale

    def update(self, found_inf: bool) -> None:
        """Called once per iteration; a constant scale ignores it."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set_scale(float(state["scale"]))


class DynamicGradScaler(ConstantGradScaler):
    """A loss scale that backs off on overflow and grows after clean steps.

    Each step with an inf/nan lowers a hysteresis counter (starting at ``hysteresis``); once
    it has reached zero, that step and every further overflow multiply the scale by
    ``backoff_factor``, never below ``min_scale``. An overflow also restarts the count of clean
    steps; ``growth_interval`` clean steps in a row multiply the scale by ``growth_factor``
    and refill the hysteresis counter. Clean steps alone do not refill it, so overflows spread
    over a stretch without growth still add up.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if not min_scale > 0.0:
            raise ValueError(f"min_scale must be > 0, got {min_scale}")
        if initial_scale < min_scale:
            raise ValueError(f"initial_scale ({initial_scale}) must be >= min_scale ({min_scale})")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        super().__init__(initial_scale, device=device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after one iteration; ``found_inf`` must agree on every rank."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._set_scale(max(self._scale * self.backoff_factor, self.min_scale))
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._set_scale(self._scale * self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set_scale(float(state["scale"]))
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def found_inf_in(grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
    """True when any of ``grads`` on any rank of ``group`` holds an inf or nan.

    Locally, one fused max-abs per tensor (nan propagates through it); across ranks, one
    all-reduce MAX of a single flag over ``group`` (None: no communication), so every rank
    returns the same answer and skips or takes the step together. An empty ``grads`` list
    still joins the all-reduce.
    """
    if grads:
        device = grads[0].device
        peaks = torch._foreach_norm(grads, float("inf"))
        local = torch.stack([peak.float().to(device) for peak in peaks])
        flag = (~torch.isfinite(local)).any().float().reshape(1)
    else:
        flag = torch.zeros(1, dtype=torch.float32, device=_default_device())
    if group is not None:
        comm.all_reduce(flag, group, dist.ReduceOp.MAX)
    return bool(flag.item())
