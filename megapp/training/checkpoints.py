"""The loop's side of checkpoints: what it saves besides the tensors and how it resumes.

The tensors, optimizer state, loss scaler, LR schedule and RNG streams are
:mod:`megapp.checkpointing`'s business; this module adds the loop's position
(:class:`TrainState`) and the run's plain settings, and turns a checkpoint that
cannot be loaded, or a ``--load`` directory without one, into an :class:`ArgumentsError`
naming ``--load``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megapp.checkpointing import NoOptimizerStateError, load_checkpoint, save_checkpoint
from megapp.checkpointing.checkpoint import LATEST
from megapp.optimizer import ScheduleMismatchError
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


SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "warmup_steps": "--lr-warmup-iters",
    "decay_steps": "--lr-decay-iters",
    "decay_style": "--lr-decay-style",
}


def _same_directory(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def load(args: argparse.Namespace, chunks, optimizer, scheduler, groups) -> TrainState:
    """Restore everything from ``--load`` (``--ckpt-step`` or the newest iteration).

    A directory without a checkpoint is an error, except when it is also ``--save``: the
    first run of a job that saves and resumes in one place starts fresh. Collective.
    """
    where = {} if args.ckpt_step is None else {"iteration": args.ckpt_step}
    settings = "match"
    if args.use_checkpoint_opt_param_scheduler:
        settings = "checkpoint"
    elif args.override_opt_param_scheduler:
        settings = "current"
    try:
        info = load_checkpoint(
            args.load,
            chunks,
            optimizer,
            groups=groups,
            lr_scheduler=scheduler,
            scheduler_settings=settings,
            load_optimizer=not args.no_load_optim,
            load_rng=not args.no_load_rng,
            **where,
        )
    except ScheduleMismatchError as error:
        differences = [_flag_names(d) for d in error.differences]
        raise ArgumentsError(
            f"--load {args.load}: the saved learning-rate schedule differs from this run's "
            f"({'; '.join(differences)}); pass --use-checkpoint-opt_param-scheduler to "
            "continue the saved schedule or --override-opt_param-scheduler to use this run's"
        ) from error
    except NoOptimizerStateError as error:
        raise ArgumentsError(
            f"--load {args.load}: {error.path} holds no optimizer state; pass --no-load-optim "
            "to load the model alone"
        ) from error
    except (ValueError, OSError) as error:
        raise ArgumentsError(f"--load {args.load}: {error}") from error
    if info is not None:
        print_rank_0(f" > loaded checkpoint {info.path} (iteration {info.iteration})")
        return TrainState(info.iteration, info.consumed_train_samples, info.consumed_valid_samples)
    if not _same_directory(args.load, args.save):
        what = "does not exist" if not Path(args.load).exists() else "holds no checkpoint"
        raise ArgumentsError(
            f"--load {args.load}: the directory {what} (no {LATEST}); check the path, or "
            "drop --load to train from scratch (--load equal to --save starts fresh when "
            "there is nothing to resume yet)"
        )
    print_rank_0(f" > no checkpoint in {args.load} yet; training from scratch")
    return TrainState()


def _flag_names(difference: str) -> str:
    """``"max_lr: saved 1, now 2"`` as ``"--lr: saved 1, now 2"``."""
    name, _, rest = difference.partition(":")
    return f"{SCHEDULE_FLAGS.get(name, name)}:{rest}"


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
