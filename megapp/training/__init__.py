"""Training: the iteration step (the loop, logging and checkpoints build on it)."""

from megapp.training.step import TrainGroups, TrainStepResult, train_step

__all__ = ["TrainGroups", "TrainStepResult", "train_step"]
