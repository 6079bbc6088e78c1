"""Optimizer pieces: learning-rate schedule, loss scaling, gradient clipping across a
model-parallel layout, weight-decay param groups, the AdamW implementation choice, and
:class:`Optimizer`, which puts them together over data-parallel model chunks."""

from megapp.optimizer.adamw import build_adamw, choose_adamw
from megapp.optimizer.clip_grads import (
    clip_grad_by_total_norm_,
    clip_grad_norm_,
    get_grad_norm,
    grads_for_norm,
    grads_to_clip,
)
from megapp.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, found_inf_in
from megapp.optimizer.lr_scheduler import LRScheduler, ScheduleMismatchError
from megapp.optimizer.optimizer import Optimizer, StepResult, check_per_stage_steps
from megapp.optimizer.param_groups import default_no_decay, get_param_groups

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "LRScheduler",
    "Optimizer",
    "ScheduleMismatchError",
    "StepResult",
    "build_adamw",
    "check_per_stage_steps",
    "choose_adamw",
    "clip_grad_by_total_norm_",
    "clip_grad_norm_",
    "default_no_decay",
    "found_inf_in",
    "get_grad_norm",
    "get_param_groups",
    "grads_for_norm",
    "grads_to_clip",
]
