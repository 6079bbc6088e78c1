"""Load a Hugging Face model folder into megapp's chunks under any layout, and export back.

- :func:`load_hf` fills this rank's parameters from ``model.safetensors`` (or its shards),
  each rank reading only the slices it holds; vocabulary padding stays zero.
- :func:`save_hf` writes ``config.json`` and sharded safetensors with their index from any
  layout: one whole tensor at a time is gathered on rank 0 and written, so memory holds at
  most one shard file's tensors; tied weights are written once, padding never.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megapp import comm
from megapp.checkpointing.state import MODEL, model_shards, named_params
from megapp.distributed.ddp import full_weights
from megapp.models.gpt import GPTConfig
from megapp.models.hf_config import gpt_config_from_hf, hf_config_from_gpt
from megapp.models.hf_weights import (
    INDEX_FILE,
    SafetensorsFolder,
    check_shapes,
    hf_layout,
    read_region,
)

CONFIG_FILE = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


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


def load_hf(
    chunks: Sequence[nn.Module],
    directory: str,
    model_type: str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> int:
    """Copy the Hugging Face weights into this rank's parameters; returns elements read."""
    folder = SafetensorsFolder(directory)
    config = _config_of(chunks)
    read = 0
    with torch.no_grad(), full_weights(chunks):  # ZeRO-3 keeps what is written
        for key, shard in model_shards(named_params(chunks), tp_rank, tp_size).items():
            name = key.removeprefix(MODEL)
            rows = hf_layout(config, model_type, name)
            check_shapes(folder, rows, list(shard.shape), name)
            region = tuple(
                slice(o, o + n) for o, n in zip(shard.offsets, shard.local.shape, strict=True)
            )
            values = read_region(folder, rows, region)
            shard.local.copy_(values.to(shard.local.dtype))
            read += values.numel()
    return read


def _config_of(chunks: Sequence[nn.Module]) -> GPTConfig:
    return getattr(chunks[0], "module", chunks[0]).config


def _pieces(chunks: Sequence[nn.Module], tp_rank: int, tp_size: int) -> dict[str, Any]:
    return {
        key.removeprefix(MODEL): shard
        for key, shard in model_shards(named_params(chunks), tp_rank, tp_size).items()
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
) -> None:
    """Write the model as a Hugging Face folder. Collective over ``group`` (all ranks holding
    a part of the model; None: the default group when distributed, else this process)."""
    with full_weights(chunks):  # ZeRO-3 gathers the weights whole
        _save_hf(
            chunks, directory, model_type, tp_rank, tp_size, group, max_shard_bytes, tokenizer_dir
        )


def _save_hf(
    chunks, directory, model_type, tp_rank, tp_size, group, max_shard_bytes, tokenizer_dir
):
    from megapp.models.hf_deps import safetensors

    config = _config_of(chunks)
    pieces = _pieces(chunks, tp_rank, tp_size)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    names = sorted(pieces)
    if distributed:
        everyone = comm.all_gather_object(names, group)
        names = sorted({n for ranks_names in everyone for n in ranks_names})
    root = not distributed or comm.rank(group) == 0
    if root:
        os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}  # the next shard file's tensors, nothing more
    written = {"files": 0, "bytes": 0}

    def flush() -> None:
        if pending:
            written["files"] += 1
            written["bytes"] += sum(t.numel() * t.element_size() for t in pending.values())
            name = f"model-{written['files']:05d}.safetensors"
            safetensors.torch.save_file(pending, os.path.join(directory, name), {"format": "pt"})
            weight_map.update(dict.fromkeys(pending, name))
            pending.clear()

    size = 0
    for name in names:
        local = pieces.get(name)
        part = None if local is None else (list(local.offsets), local.local.detach().cpu().clone())
        parts = comm.gather_object(part, group) if distributed else [part]
        if not root:
            continue
        if not any(p is not None for p in parts):
            raise ValueError(f"no rank holds {name}")
        whole = _assemble(name, [p for p in parts if p is not None])
        for hf_name, tensor in _split_to_hf(config, model_type, name, whole).items():
            if hf_name in weight_map or hf_name in pending:
                continue  # a tied weight, written once
            if size + tensor.numel() * tensor.element_size() > max_shard_bytes:
                flush()
                size = 0
            pending[hf_name] = tensor.contiguous()
            size += tensor.numel() * tensor.element_size()
    if not root:
        return
    flush()
    _rename_shards(directory, weight_map, written["files"], written["bytes"])
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as stream:
        json.dump(hf_config_from_gpt(config, model_type), stream, indent=2)
    if tokenizer_dir is not None:
        for file in TOKENIZER_FILES:
            source = os.path.join(tokenizer_dir, file)
            if os.path.isfile(source):
                with open(source, "rb") as src, open(os.path.join(directory, file), "wb") as dst:
                    dst.write(src.read())


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


def _rename_shards(directory: str, weight_map: dict[str, str], count: int, total: int) -> None:
    """``model-0000k-of-0000n.safetensors`` names and the index (one file: no index)."""
    if count == 1:
        os.replace(
            os.path.join(directory, "model-00001.safetensors"),
            os.path.join(directory, "model.safetensors"),
        )
        return
    renamed = {}
    for k in range(1, count + 1):
        old, new = f"model-{k:05d}.safetensors", f"model-{k:05d}-of-{count:05d}.safetensors"
        os.replace(os.path.join(directory, old), os.path.join(directory, new))
        renamed[old] = new
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())},
    }
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as stream:
        json.dump(index, stream, indent=2)
