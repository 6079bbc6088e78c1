"""The loop's side of checkpoints: what it saves besides the tensors and how it resumes.

The tensors, optimizer state, loss scaler, LR schedule and RNG streams are
:mod:`megapp.checkpointing`'s business; this module adds the loop's position
(:class:`TrainState`) and the run's plain settings, and turns a checkpoint that
cannot be loaded into an :class:`ArgumentsError` naming ``--load``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megapp.checkpointing import load_checkpoint, save_checkpoint
from megapp.training.arguments import ArgumentsError
from megapp.training.initialize import print_rank_0


@dataclass
class TrainState:
    """Where training stands: iterations done and samples read from each split."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def checkpoint_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The plain settings of ``args`` (numbers, strings, flags, lists of strings)."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, plain):
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, plain) for v in value):
            out[key] = list(value)
    return out


def load(args: argparse.Namespace, chunks, optimizer, scheduler, groups) -> TrainState:
    """Restore everything from ``--load`` (``--ckpt-step`` or the newest iteration);
    a fresh state when the directory holds no checkpoint. Collective."""
    where = {} if args.ckpt_step is None else {"iteration": args.ckpt_step}
    try:
        info = load_checkpoint(
            args.load, chunks, optimizer, groups=groups, lr_scheduler=scheduler, **where
        )
    except (ValueError, OSError) as error:
        raise ArgumentsError(f"--load {args.load}: {error}") from error
    if info is None:
        print_rank_0(f" > no checkpoint in {args.load}; training from scratch")
        return TrainState()
    print_rank_0(f" > loaded checkpoint {info.path} (iteration {info.iteration})")
    return TrainState(info.iteration, info.consumed_train_samples, info.consumed_valid_samples)


def save(args: argparse.Namespace, state: TrainState, chunks, optimizer, scheduler, groups) -> Path:
    """Save everything to ``--save`` after ``state.iteration``; returns the directory.
    Collective."""
    path = save_checkpoint(
        args.save,
        state.iteration,
        chunks,
        optimizer,
        groups=groups,
        lr_scheduler=scheduler,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        args=checkpoint_settings(args),
    )
    print_rank_0(f" > saved checkpoint at iteration {state.iteration} to {path}")
    return Path(path)
