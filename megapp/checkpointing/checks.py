"""What a checkpoint must be before anything is loaded from it: a readable, well-formed
``common.json`` of a known format, the same model shape, tensors that fit, and plain
settings (LR schedule, loss scaler) that load; each failure is a :class:`CheckpointError`
naming the file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapp import comm
from megapp.checkpointing.errors import CheckpointError

COMMON = "common.json"
FORMAT_VERSION = 1

# Config fields that fix the tensors' shapes; a checkpoint loads only into a model that
# agrees on all of them.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "activation",
    "add_bias_linear",
    "share_embeddings_and_output_weights",
)


def plain(value: Any) -> Any:
    """``value`` as JSON-able data (dtypes and other objects become their str)."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return str(value)


def model_config(chunks) -> dict[str, Any] | None:
    module = getattr(chunks[0], "module", chunks[0])
    config = getattr(module, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


_COMMON_COUNTERS = (
    "format_version",
    "iteration",
    "consumed_train_samples",
    "consumed_valid_samples",
)
_COMMON_OBJECTS = ("model_config", "layout", "lr_scheduler", "grad_scaler", "args")


def read_common(path: Path) -> dict[str, Any]:
    """The checked contents of ``path/common.json``."""
    file = path / COMMON
    try:
        common = json.loads(file.read_text())
    except FileNotFoundError as error:
        raise CheckpointError(f"no complete checkpoint at {path} (missing {COMMON})") from error
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file}: unreadable ({error}); the checkpoint is corrupt") from error
    if not isinstance(common, dict):
        raise CheckpointError(f"{file}: not a JSON object; the checkpoint is corrupt")
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: unknown checkpoint format {common.get('format_version')!r:.40} "
            f"(this megapp reads format {FORMAT_VERSION})"
        )
    for name in _COMMON_COUNTERS:
        value = common.get(name)
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{file}: {name} is {value!r:.40}; the checkpoint is corrupt")
    for name in _COMMON_OBJECTS:
        if not isinstance(common.get(name), dict | None):
            raise CheckpointError(f"{file}: {name} is not an object; the checkpoint is corrupt")
    return common


def load_plain_state(owner, state: dict | None, settings: str | None, path: Path) -> None:
    """Load the JSON state of the LR scheduler or loss scaler; a malformed one is corrupt."""
    if owner is None or state is None:
        return
    try:
        if settings is None:
            owner.load_state_dict(state)
        else:
            owner.load_state_dict(state, settings=settings)
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"{path / COMMON}: the {type(owner).__name__} state is malformed ({error!r:.80}); "
            "the checkpoint is corrupt"
        ) from error


def first_failure(error: Exception) -> str:
    """One line for what went wrong: the first rank's own error inside DCP's summary."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback summary)
            error = error[0]
    return f"{type(error).__name__}: {comm.one_line(error, 300)}"


def check_config(saved: dict | None, chunks, path: Path) -> None:
    current = model_config(chunks)
    if saved is None or current is None:
        return
    diffs = [
        f"{name}: checkpoint {saved[name]!r}, this model {current[name]!r}"
        for name in SHAPE_FIELDS
        if name in saved and name in current and saved[name] != current[name]
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} is of a different model shape; set the model flags to the "
            "checkpoint's or train from scratch:\n  " + "\n  ".join(diffs)
        )


def check_tensors(state: dict[str, torch.Tensor], metadata, path: Path) -> None:
    saved = metadata.state_dict_metadata
    problems = []
    for key, tensor in state.items():
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: not in the checkpoint")
        elif md.size != tensor.size():
            problems.append(
                f"{key}: checkpoint {tuple(md.size)}, this model {tuple(tensor.size())}"
            )
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError(f"checkpoint {path} does not fit this model:\n  {shown}{more}")
