"""Load a Hugging Face model folder into megapp's chunks under any layout, and export back.

- :func:`load_hf` fills this rank's parameters from ``model.safetensors`` (or its shards),
  each rank reading only the slices it holds; vocabulary padding stays zero.
- :func:`save_hf` writes ``config.json``, ``generation_config.json`` and sharded
  safetensors with their index from any layout: one whole tensor at a time is gathered on
  rank 0 and written, so memory holds at most one shard file's tensors; tied weights are
  written once, padding never. A model imported from a folder goes back with that
  folder's ``config.json`` and ``generation_config.json``; :func:`keep_hf_config` keeps
  them with a checkpoint (in ``KEPT_DIR``) so that its export finds them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megapp import comm
from megapp.checkpointing.state import MODEL, Placement, model_shards, named_params
from megapp.distributed.ddp import full_weights
from megapp.models.gpt import GPTConfig
from megapp.models.hf_config import exported_config, generation_config, gpt_config_from_hf
from megapp.models.hf_weights import (
    INDEX_FILE,
    SINGLE_FILE,
    Experts,
    SafetensorsFolder,
    check_shapes,
    hf_layout,
    read_region,
)

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# A checkpoint directory's copy of the Hugging Face files its model was imported with.
KEPT_DIR = "hf_config"


def read_hf_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{directory}: no {CONFIG_FILE}; is it a Hugging Face model folder?"
        )
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def hf_gpt_config(directory: str, **overrides: Any) -> tuple[GPTConfig, str]:
    """The megapp config of the model in ``directory`` and its ``model_type``."""
    hf = read_hf_config(directory)
    return gpt_config_from_hf(hf, **overrides), hf["model_type"]


def kept_hf_config(checkpoint_dir: str) -> str | None:
    """The folder holding the ``config.json`` a checkpoint's model was imported with, or None
    (a model trained from scratch)."""
    kept = os.path.join(checkpoint_dir, KEPT_DIR)
    return kept if os.path.isfile(os.path.join(kept, CONFIG_FILE)) else None


def keep_hf_config(source_dir: str, checkpoint_dir: str) -> None:
    """Copy ``source_dir``'s ``config.json`` (and ``generation_config.json``) into
    ``checkpoint_dir``'s ``KEPT_DIR``, replacing it whole."""
    read_hf_config(source_dir)  # a folder without one is an error here, not at export
    kept = os.path.join(checkpoint_dir, KEPT_DIR)
    if os.path.abspath(source_dir) == os.path.abspath(kept):
        return
    os.makedirs(checkpoint_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{KEPT_DIR}.", dir=checkpoint_dir)
    try:
        for file in (CONFIG_FILE, GENERATION_FILE):
            if os.path.isfile(os.path.join(source_dir, file)):
                shutil.copyfile(os.path.join(source_dir, file), os.path.join(staging, file))
        os.chmod(staging, 0o777 & ~_umask())
        shutil.rmtree(kept, ignore_errors=True)
        os.replace(staging, kept)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def load_hf(
    chunks: Sequence[nn.Module],
    directory: str,
    model_type: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    placement: Placement | None = None,
) -> int:
    """Copy the Hugging Face weights into this rank's parameters; returns elements read.
    ``placement`` (for a model with experts under expert parallelism) replaces
    ``tp_rank`` and ``tp_size``."""
    folder = SafetensorsFolder(directory)
    config = _config_of(chunks)
    placement = placement or Placement(tp_rank, tp_size)
    read = 0
    with torch.no_grad(), full_weights(chunks):  # ZeRO-3 keeps what is written
        for key, shard in model_shards(named_params(chunks), placement).items():
            name = key.removeprefix(MODEL)
            rows = hf_layout(config, model_type, name)
            region = tuple(
                slice(o, o + n) for o, n in zip(shard.offsets, shard.local.shape, strict=True)
            )
            if isinstance(rows, Experts):
                values = rows.read(folder, region)
                if values.shape != shard.local.shape:
                    raise ValueError(
                        f"{rows.names[0].format(e=0)} and its kin do not fit megapp's {name} "
                        f"of shape {list(shard.shape)}"
                    )
            else:
                check_shapes(folder, rows, list(shard.shape), name)
                values = read_region(folder, rows, region)
            shard.local.copy_(values.to(shard.local.dtype))
            read += values.numel()
    return read


def _config_of(chunks: Sequence[nn.Module]) -> GPTConfig:
    return getattr(chunks[0], "module", chunks[0]).config


def _pieces(chunks: Sequence[nn.Module], placement: Placement) -> dict[str, Any]:
    return {
        key.removeprefix(MODEL): shard
        for key, shard in model_shards(named_params(chunks), placement).items()
    }


def save_hf(
    chunks: Sequence[nn.Module],
    directory: str,
    model_type: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    group: Any = None,
    max_shard_bytes: int = 2 << 30,
    tokenizer_dir: str | None = None,
    source_dir: str | None = None,
    eod: int | None = None,
    placement: Placement | None = None,
) -> None:
    """Write the model as a Hugging Face folder. Collective over ``group`` (all ranks holding
    a part of the model, experts included; None: the default group when distributed, else
    this process). ``placement`` replaces ``tp_rank`` and ``tp_size`` under expert
    parallelism.

    ``source_dir``: a folder with the ``config.json`` (and ``generation_config.json``) the
    model was imported with, written back; without one the config is made from the
    model's, with ``eod`` as its first and last token id. ``tokenizer_dir``'s tokenizer
    files are copied. What ``model_type`` cannot express fails before anything is written.
    """
    config = _config_of(chunks)
    original = None if source_dir is None else read_hf_config(source_dir)
    hf = exported_config(config, model_type, original, eod)
    generation = None
    if source_dir is not None:
        generation = _read_json(os.path.join(source_dir, GENERATION_FILE))
    texts = {CONFIG_FILE: hf, GENERATION_FILE: generation or generation_config(hf)}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and group is None:
        group = torch.distributed.group.WORLD
    root = not distributed or comm.rank(group) == 0
    created = root and not os.path.exists(directory)
    try:
        with full_weights(chunks):  # ZeRO-3 gathers the weights whole
            pieces = _pieces(chunks, placement or Placement(tp_rank, tp_size))
            names = sorted(pieces)
            if distributed:
                everyone = comm.all_gather_object(names, group)
                names = sorted({n for ranks_names in everyone for n in ranks_names})
            writer = _ShardWriter(directory, max_shard_bytes) if root else None
            for name in names:
                local = pieces.get(name)
                part = None
                if local is not None:
                    part = (list(local.offsets), local.local.detach().cpu().clone())
                parts = comm.gather_object(part, group) if distributed else [part]
                if writer is None:
                    continue
                if not any(p is not None for p in parts):
                    raise ValueError(f"no rank holds {name}")
                whole = _assemble(name, [p for p in parts if p is not None])
                for hf_name, tensor in _split_to_hf(config, model_type, name, whole).items():
                    writer.add(hf_name, tensor)
        if writer is None:
            return
        writer.finish()
        for file, content in texts.items():
            with open(os.path.join(directory, file), "w", encoding="utf-8") as stream:
                json.dump(content, stream, indent=2)
        for file in TOKENIZER_FILES if tokenizer_dir is not None else ():
            if os.path.isfile(os.path.join(tokenizer_dir, file)):
                shutil.copyfile(os.path.join(tokenizer_dir, file), os.path.join(directory, file))
    except BaseException:
        if created:  # a folder this export made holds nothing worth keeping
            shutil.rmtree(directory, ignore_errors=True)
        raise


class _ShardWriter:
    """Safetensors shard files of at most ``max_shard_bytes`` (one tensor may exceed it), named
    ``model-0000k-of-0000n.safetensors`` with the index at the end (one file: no index)."""

    def __init__(self, directory: str, max_shard_bytes: int) -> None:
        from megapp.models.hf_deps import safetensors

        os.makedirs(directory, exist_ok=True)
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.save_file = safetensors.torch.save_file
        self.mode = 0o666 & ~_umask()  # safetensors writes 0600; a model folder is shared
        self.weight_map: dict[str, str] = {}
        self.pending: dict[str, torch.Tensor] = {}  # the next file's tensors, nothing more
        self.pending_bytes = self.total_bytes = self.files = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            return  # a tied weight, written once
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        self.files += 1
        self.total_bytes += self.pending_bytes
        name = f"model-{self.files:05d}.safetensors"
        path = os.path.join(self.directory, name)
        self.save_file(self.pending, path, {"format": "pt"})
        os.chmod(path, self.mode)
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending:
            self._flush()
        directory, count = self.directory, self.files
        if count == 1:
            os.replace(
                os.path.join(directory, "model-00001.safetensors"),
                os.path.join(directory, SINGLE_FILE),
            )
            return
        renamed = {}
        for k in range(1, count + 1):
            old, new = f"model-{k:05d}.safetensors", f"model-{k:05d}-of-{count:05d}.safetensors"
            os.replace(os.path.join(directory, old), os.path.join(directory, new))
            renamed[old] = new
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: renamed[v] for k, v in sorted(self.weight_map.items())},
        }
        with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as stream:
            json.dump(index, stream, indent=2)


def _assemble(name: str, parts: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """A whole tensor from its pieces (offsets, values); duplicates (replicas) agree."""
    dims = parts[0][1].dim()
    shape = [max(offsets[d] + t.shape[d] for offsets, t in parts) for d in range(dims)]
    whole = torch.empty(shape, dtype=parts[0][1].dtype)
    for offsets, tensor in parts:
        index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape, strict=True))
        whole[index] = tensor
    return whole


def _split_to_hf(config: GPTConfig, model_type: str, name: str, whole: torch.Tensor) -> dict:
    """The Hugging Face tensors (or their rows) that megapp's whole tensor ``name`` holds."""
    rows = hf_layout(config, model_type, name)
    if isinstance(rows, Experts):
        return rows.split(whole)
    out: dict[str, torch.Tensor] = {}
    parts = [whole[p] for p in range(len(rows.segments))] if len(rows.segments) > 1 else [whole]
    for segments, tensor in zip(rows.segments, parts, strict=True):
        offset = 0
        pieces: dict[str, list[tuple[int, torch.Tensor, bool]]] = {}
        for seg in segments:
            pieces.setdefault(seg.name, []).append(
                (seg.start, tensor[offset : offset + seg.count], seg.transposed)
            )
            offset += seg.count
        for hf_name, chunks in pieces.items():
            chunks.sort(key=lambda c: c[0])
            joined = torch.cat([c[1] for c in chunks])
            out[hf_name] = joined.t() if chunks[0][2] else joined
    return out
