"""The loop's side of checkpoints: what it saves besides the tensors and how it resumes.

The tensors, optimizer state, loss scaler, LR schedule and RNG streams are
:mod:`megapp.checkpointing`'s business; this module adds the loop's position
(:class:`TrainState`) and the run's settings, and turns a checkpoint that cannot be
loaded, or a ``--load`` directory without one, into an :class:`ArgumentsError` naming
``--load``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megapp.optimizer import ScheduleMismatchError
from megapp.training.config import PretrainConfig, as_flags
from megapp.training.flag_groups import ArgumentsError
from megapp.training.initialize import print_rank_0
from megapp.training.setup import TrainingSetup


@dataclass
class TrainState:
    """Where training stands: iterations done and samples read from each split."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _same_directory(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def load(config: PretrainConfig, setup: TrainingSetup) -> TrainState:
    """Restore everything from ``--load`` (``--ckpt-step`` or the newest iteration).

    A directory without a checkpoint is an error, except when it is also ``--save``: the
    first run of a job that saves and resumes in one place starts fresh. Collective.
    """
    # megapp.checkpointing pulls in torch.distributed.checkpoint (about half a second per
    # process): imported by the runs that save or load, not by every launch
    from megapp.checkpointing import NoOptimizerStateError, load_checkpoint
    from megapp.checkpointing.checkpoint import LATEST

    ckpt = config.checkpoint
    where = {} if ckpt.ckpt_step is None else {"iteration": ckpt.ckpt_step}
    try:
        info = load_checkpoint(
            ckpt.load,
            setup.chunks,
            setup.optimizer,
            groups=setup.groups,
            lr_scheduler=setup.scheduler,
            scheduler_settings=ckpt.scheduler_settings,
            load_optimizer=not ckpt.no_load_optim,
            load_rng=not ckpt.no_load_rng,
            **where,
        )
    except ScheduleMismatchError as error:
        differences = [as_flags(d) for d in error.differences]
        raise ArgumentsError(
            f"--load {ckpt.load}: the saved learning-rate schedule differs from this run's "
            f"({'; '.join(differences)}); pass --use-checkpoint-opt_param-scheduler to "
            "continue the saved schedule or --override-opt_param-scheduler to use this run's"
        ) from error
    except NoOptimizerStateError as error:
        raise ArgumentsError(
            f"--load {ckpt.load}: {error.path} holds no optimizer state; pass --no-load-optim "
            "to load the model alone"
        ) from error
    except (ValueError, OSError) as error:
        raise ArgumentsError(f"--load {ckpt.load}: {error}") from error
    if info is not None:
        print_rank_0(f" > loaded checkpoint {info.path} (iteration {info.iteration})")
        return TrainState(info.iteration, info.consumed_train_samples, info.consumed_valid_samples)
    if not _same_directory(ckpt.load, ckpt.save):
        what = "does not exist" if not Path(ckpt.load).exists() else "holds no checkpoint"
        raise ArgumentsError(
            f"--load {ckpt.load}: the directory {what} (no {LATEST}); check the path, or "
            "drop --load to train from scratch (--load equal to --save starts fresh when "
            "there is nothing to resume yet)"
        )
    print_rank_0(f" > no checkpoint in {ckpt.load} yet; training from scratch")
    return TrainState()


def save(config: PretrainConfig, state: TrainState, setup: TrainingSetup) -> Path:
    """Save everything to ``--save`` after ``state.iteration``; returns the directory.
    Collective."""
    from megapp.checkpointing import save_checkpoint  # see load()

    path = save_checkpoint(
        config.checkpoint.save,
        state.iteration,
        setup.chunks,
        setup.optimizer,
        groups=setup.groups,
        lr_scheduler=setup.scheduler,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        args=config.to_dict(),
    )
    print_rank_0(f" > saved checkpoint at iteration {state.iteration} to {path}")
    return Path(path)
