"""Planning a parallel layout without running it: what each rank holds and how long an
iteration takes, predicted from the model's shape and the layout."""

from megapp.planning.layout import Layout, apply_layout, pretrain_config
from megapp.planning.memory import RankMemory, predict_memory
from megapp.planning.model_state import ModelState, chunk_parameters, model_state, rank_parameters

__all__ = [
    "Layout",
    "ModelState",
    "RankMemory",
    "apply_layout",
    "chunk_parameters",
    "model_state",
    "predict_memory",
    "pretrain_config",
    "rank_parameters",
]
