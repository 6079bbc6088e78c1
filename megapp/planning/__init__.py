"""Planning a parallel layout without running it: what each rank holds and how long an
iteration takes, predicted from the model's shape and the layout."""

from megapp.planning.model_state import ModelState, chunk_parameters, model_state, rank_parameters

__all__ = ["ModelState", "chunk_parameters", "model_state", "rank_parameters"]
