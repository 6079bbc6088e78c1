"""Training: the typed config of a run, the setup builder, the iteration step (the loop,
logging and checkpoints build on them)."""

from megapp.parallel_state import TrainGroups
from megapp.training.config import PretrainConfig
from megapp.training.setup import TrainingSetup, build_training_setup
from megapp.training.step import TrainStepResult, train_step

__all__ = [
    "PretrainConfig",
    "TrainGroups",
    "TrainStepResult",
    "TrainingSetup",
    "build_training_setup",
    "train_step",
]
