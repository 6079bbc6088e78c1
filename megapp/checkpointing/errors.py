"""The one error a checkpoint that cannot be loaded raises."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: refused, corrupt, missing, or of another model.
    The message names the file or directory and what to do."""
