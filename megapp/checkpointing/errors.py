"""The one error a checkpoint that cannot be loaded raises."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: refused, corrupt, missing, or of another model.
    The message names the file or directory and what to do."""


class NoOptimizerStateError(CheckpointError):
    """A checkpoint saved without optimizer state was asked for it (load the model alone)."""

    def __init__(self, path):
        self.path = path
        super().__init__(
            f"{path} holds no optimizer state; load the model alone (load_optimizer=False)"
        )
