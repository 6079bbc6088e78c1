"""The planner's prediction for a sweep point, put next to what the point measured.

Memory per pipeline rank comes from ``megapp.planning.memory.predict_memory`` and the step
time from ``megapp.planning.profiles.predict_step_time`` on a hardware profile, both split
into their lines by ``megapp.planning.explain`` (as ``python -m megapp.plan --explain``
splits them); either is left empty (with a note saying why) when its module is not there or
cannot price the point, so a sweep runs with or without the planner.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING

from megapp.ablation.records import Prediction
from megapp.data import build_tokenizer
from megapp.training.config import PretrainConfig

if TYPE_CHECKING:
    from megapp.planning.timing import TimeModel


def vocab_size(config: PretrainConfig) -> int:
    """The tokenizer's vocabulary, the size ``pretrain_gpt.py`` builds the model for."""
    data = config.data
    tokenizer = build_tokenizer(
        data.tokenizer_type, data.vocab_file, data.merge_file, data.tokenizer_model
    )
    return tokenizer.vocab_size


def predict(config: PretrainConfig, hardware: str | None) -> Prediction:
    """The predicted memory per pipeline rank (bytes) and, with a ``hardware`` profile
    (name or JSON file), the iteration time and bubble of ``config``."""
    out = Prediction()
    notes = []
    vocab = vocab_size(config)
    memory = _optional_module("megapp.planning.memory")
    if memory is None:
        notes.append("no megapp.planning.memory")
    else:
        try:
            out.memory_per_stage = [float(r.total) for r in memory.predict_memory(config, vocab)]
        except (ValueError, NotImplementedError) as error:
            notes.append(f"memory: {error}")
    timing = _optional_module("megapp.planning.timing")
    # the memory of the run as it is measured, on this machine, whatever profile times it
    memory_transport = None
    if memory is not None:
        memory_transport = "gloo" if memory.runs_on_gloo(config) else "nccl"
    if hardware is None:
        notes.append("no hardware profile for the time")
    elif timing is None:
        notes.append("no megapp.planning.timing")
    else:
        from megapp.planning.profiles import load_profile, time_model

        try:
            explain_into(out, config, vocab, time_model(load_profile(hardware)), memory_transport)
        except (ValueError, NotImplementedError) as error:
            notes.append(f"time: {error}")
    out.note = "; ".join(notes) or None
    return out


def explain_into(
    out: Prediction,
    config: PretrainConfig,
    vocab: int,
    model: TimeModel,
    transport: str | None = None,
) -> None:
    """Store in ``out`` the rows of :func:`megapp.planning.explain.explain` of ``config``
    under the time ``model``, its memory on devices moving tensors by ``transport`` (a row
    without a value, MFU on a machine without a peak, as None) and the pipeline ranks they
    describe."""
    from megapp.planning.explain import explain, explanation_rows

    explanation = explain(config, vocab, model, transport=transport)
    step = explanation.step_time  # the step timing.predict gives, and why
    out.iteration_seconds, out.bubble = float(step.seconds), float(step.bubble)
    rows = explanation_rows(explanation)
    out.breakdown = {key: None if math.isnan(value) else float(value) for key, value in rows}
    out.step_rank, out.memory_rank = explanation.step.rank, explanation.peak.pp_rank


def _optional_module(name: str):
    """The module ``name``, or None where it is not part of this checkout yet."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        return None
