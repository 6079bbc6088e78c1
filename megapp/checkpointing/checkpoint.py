"""Save and load a whole training state, reshardable across layouts, written atomically.

A checkpoint directory holds one subdirectory per saved iteration and a marker::

    save_dir/
        latest_checkpointed_iteration.txt     the iteration to resume from
        iter_0000100/
            .metadata, __<rank>_0.distcp     model and optimizer tensors (DCP)
            common.json                      iteration, data position, scheduler,
                                             loss scaler, model config, layout

Tensors go through ``torch.distributed.checkpoint`` as pieces of whole,
layout-independent tensors (:mod:`megapp.checkpointing.state`), so a checkpoint
saved under one (tp, pp, vpp, dp, distributed optimizer) layout loads under any
other. Every rank's RNG states are saved too and restored when the layout is the
same, which makes a resumed run continue exactly.

Atomicity: everything is written into ``iter_XXXXXXX.partial``, renamed to its final
name only once every rank has finished, and the marker is replaced (write, fsync,
rename) last. A crash at any point leaves the previous marker pointing at a complete
checkpoint; a leftover ``.partial`` directory is removed by the next save.

Loading unpickles nothing but DCP's own metadata classes (see
:mod:`megapp.checkpointing.safe_reader`): tensors are read with ``weights_only=True``
and everything else is JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from megapp import comm
from megapp.checkpointing import rng
from megapp.checkpointing.checks import (
    COMMON,
    FORMAT_VERSION,
    check_config,
    check_tensors,
    first_failure,
    load_plain_state,
    model_config,
    plain,
    read_common,
)
from megapp.checkpointing.errors import CheckpointError, NoOptimizerStateError
from megapp.checkpointing.safe_reader import (
    SafeFileSystemReader,
    check_data_files,
    read_metadata_file,
)
from megapp.checkpointing.state import (
    STEP_KEY,
    OptimizerPieces,
    Placement,
    buffer_shards,
    model_shards,
    named_params,
    optimizer_step,
)
from megapp.distributed.ddp import full_weights

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"


@dataclasses.dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` restored besides the tensors."""

    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    args: dict[str, Any]
    """The plain settings given to :func:`save_checkpoint` (for reference and checks)."""
    path: Path
    rng_restored: bool


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def read_latest(load_dir: str | os.PathLike) -> int | None:
    """The iteration the marker in ``load_dir`` names, or None when there is none."""
    marker = Path(load_dir) / LATEST
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{marker} should hold an iteration number, found {text!r:.40}")
    return int(text)


def read_saved_settings(
    load_dir: str | os.PathLike, iteration: int | None = None
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The model config and run settings a checkpoint recorded, and its iteration (the
    latest unless given), read without loading any tensor."""
    if iteration is None:
        iteration = read_latest(load_dir)
        if iteration is None:
            raise CheckpointError(f"{load_dir}: no checkpoint (no {LATEST} marker)")
    common = read_common(iteration_dir(load_dir, iteration))
    if not common.get("model_config"):
        raise CheckpointError(f"{iteration_dir(load_dir, iteration)} records no model config")
    return common["model_config"], common.get("args") or {}, iteration


def _layout(chunks, optimizer, groups) -> dict[str, Any]:
    return {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": comm.world_size(groups.tp),
        "pp": comm.world_size(groups.pp),
        "dp": comm.world_size(groups.dp),
        "cp": comm.world_size(groups.cp),
        "vpp": len(chunks),
        "ep": comm.world_size(getattr(groups, "ep", None)),
        "etp": comm.world_size(getattr(groups, "expt_tp", groups.tp)),
        "distributed_optimizer": bool(optimizer is not None and optimizer.distributed),
    }


def _rank_tag() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        comm.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP runs in one process, as meant; it need not warn so."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(partial: Path, params, optimizer, placement: Placement, rank: int):
    """Every tensor of the training state into the ``partial`` directory (collective)."""
    state: dict[str, torch.Tensor] = model_shards(params, placement)
    state.update(buffer_shards([c.chunk for c in params]))
    if optimizer is not None:
        pieces = OptimizerPieces(params, optimizer, optimizer.state_kinds())
        pieces.gather()
        state.update(pieces.shards(placement))
        state[STEP_KEY] = torch.tensor(optimizer_step(optimizer), dtype=torch.float64)
    for key, tensor in rng.capture().items():
        state[f"rng.{rank}.{key}"] = tensor
    with _single_process_quiet():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
            no_dist=not dist.is_initialized(),
        )


def save_checkpoint(
    save_dir: str | os.PathLike,
    iteration: int,
    chunks: Sequence[torch.nn.Module],
    optimizer=None,
    *,
    groups,
    lr_scheduler=None,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    args: dict[str, Any] | None = None,
) -> Path:
    """Save the training state after ``iteration`` and point the marker at it.

    Collective: every rank calls it with its own chunks (DistributedDataParallel wrappers)
    and the optimizer over them. ``groups`` is the step's
    :class:`~megapp.training.step.TrainGroups`; the loss scaler is the optimizer's.
    Returns the checkpoint's directory.
    """
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    final = iteration_dir(save_dir, iteration)
    partial = final.with_name(final.name + ".partial")
    rank = _rank_tag()
    if rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that did not finish
        partial.mkdir()
    _barrier()

    params = named_params(chunks, optimizer)
    with full_weights(chunks):  # ZeRO-3: whole weights to save
        _save_tensors(partial, params, optimizer, Placement.of(groups), rank)

    if rank == 0:
        scaler = optimizer.grad_scaler if optimizer is not None else None
        _write_json(
            partial / COMMON,
            {
                "format_version": FORMAT_VERSION,
                "iteration": int(iteration),
                "consumed_train_samples": int(consumed_train_samples),
                "consumed_valid_samples": int(consumed_valid_samples),
                "lr_scheduler": plain(lr_scheduler.state_dict()) if lr_scheduler else None,
                "grad_scaler": plain(scaler.state_dict()) if scaler is not None else None,
                "has_optimizer": optimizer is not None,
                "model_config": model_config(chunks),
                "layout": _layout(chunks, optimizer, groups),
                "args": plain(args or {}),
            },
        )
    _barrier()  # every rank's files are complete before the directory becomes final
    if rank == 0:
        old = final.with_name(final.name + ".old")
        if final.exists():  # saving the same iteration again replaces it
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        partial.rename(final)
        _fsync_dir(final.parent)
        marker = Path(save_dir) / LATEST
        tmp = marker.with_name(marker.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
        logger.info("megapp: saved iteration %d to %s", iteration, final)
    _barrier()
    return final


def load_checkpoint(
    load_dir: str | os.PathLike,
    chunks: Sequence[torch.nn.Module],
    optimizer=None,
    *,
    groups,
    lr_scheduler=None,
    iteration: int | None = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    scheduler_settings: str = "match",
) -> CheckpointInfo | None:
    """Restore the state saved by :func:`save_checkpoint`; None when ``load_dir`` has none.

    Collective. Loads the iteration the marker names (or ``iteration``), into any layout.
    RNG states are restored only when the layout is the one saved (each rank's generators
    belong to its position in the grid); otherwise the run continues with its own seeds
    and a warning says so. ``load_optimizer=False`` restores the model only (fine-tuning).
    ``scheduler_settings`` is :meth:`LRScheduler.load_state_dict`'s ``settings``. Every
    checkpoint that cannot be loaded raises :class:`CheckpointError` naming the file
    (:class:`~megapp.optimizer.ScheduleMismatchError` for a schedule that differs).
    """
    if iteration is None:
        iteration = read_latest(load_dir)
        if iteration is None:
            return None
    path = iteration_dir(load_dir, iteration)
    common = read_common(path)
    check_config(common.get("model_config"), chunks, path)
    metadata = read_metadata_file(path / ".metadata")
    check_data_files(metadata, path)
    saved = metadata.state_dict_metadata

    placement = Placement.of(groups)
    params = named_params(chunks, optimizer)
    # ZeRO-3 chunks hold slices: the weights are whole from here until they are read.
    with full_weights(chunks):
        state: dict[str, torch.Tensor] = model_shards(params, placement)
        state.update(buffer_shards(chunks))
        pieces = None
        load_optimizer = load_optimizer and optimizer is not None
        if load_optimizer:
            if not common.get("has_optimizer"):
                raise NoOptimizerStateError(path)
            kinds = optimizer.state_kinds()
            if "master" in kinds and not any(k.startswith("optimizer.master.") for k in saved):
                kinds = tuple(k for k in kinds if k != "master")  # masters from the weights
            pieces = OptimizerPieces(params, optimizer, kinds)
            state.update(pieces.shards(placement))
            state[STEP_KEY] = torch.zeros((), dtype=torch.float64)
        rank = _rank_tag()
        saved_layout, layout = common.get("layout") or {}, _layout(chunks, optimizer, groups)
        # checkpoints from before expert parallelism recorded no ep or etp: 1 and tp
        saved_layout = {"ep": 1, "etp": saved_layout.get("tp"), **saved_layout}
        keys = ("world_size", "tp", "pp", "ep", "etp")
        same_layout = all(saved_layout.get(k) == layout[k] for k in keys)
        rng_states = rng.capture() if load_rng and same_layout else {}
        if any(f"rng.{rank}.{key}" not in saved for key in rng_states):
            rng_states = {}  # saved with other generators (e.g. without CUDA): keep our seeds
        for key, tensor in rng_states.items():
            state[f"rng.{rank}.{key}"] = tensor
        check_tensors(state, metadata, path)

        if load_optimizer:  # plain settings first: a mismatch fails before any tensor is read
            load_plain_state(lr_scheduler, common.get("lr_scheduler"), scheduler_settings, path)
            load_plain_state(optimizer.grad_scaler, common.get("grad_scaler"), None, path)
        with _single_process_quiet():
            reader = SafeFileSystemReader(path, metadata)
            try:
                dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
            except (Exception, CheckpointException) as error:  # DCP gathers every failure
                raise CheckpointError(
                    f"{path}: its tensors cannot be read ({first_failure(error)}); "
                    "the checkpoint is corrupt"
                ) from error

    if load_optimizer:
        pieces.scatter()
        optimizer.set_step_count(float(state[STEP_KEY]))
        if "master" not in pieces.kinds:
            optimizer.copy_masters_from_weights()  # fp32 copies of the loaded bf16/fp16 weights
    elif optimizer is not None:
        optimizer.copy_masters_from_weights()
    if rng_states:
        rng.restore(rng_states)
    elif load_rng and rank == 0:
        logger.warning(
            "megapp: RNG states not restored from %s: saved under layout %s or with other "
            "generators, this run is %s",
            path,
            saved_layout,
            layout,
        )
    return CheckpointInfo(
        iteration=int(common["iteration"]),
        consumed_train_samples=int(common["consumed_train_samples"]),
        consumed_valid_samples=int(common["consumed_valid_samples"]),
        args=common.get("args", {}),
        path=path,
        rng_restored=bool(rng_states),
    )
