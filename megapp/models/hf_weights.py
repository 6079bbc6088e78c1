"""Hugging Face safetensors weights into megapp's parameters and back, under any layout.

Every megapp parameter has a layout-independent name and is a piece of a whole tensor
(``megapp.checkpointing.state.model_shards``: offsets into a global shape, a SwiGLU
``fc1`` viewed as ``[2, ffn, h]``). Each whole megapp tensor is made of rows of Hugging
Face tensors (:class:`Rows`): a fused QKV takes, group by group, the query rows of the
group's heads, then its key rows, then its value rows; GPT-2's ``Conv1D`` weights are
stored transposed. Import reads, with safetensors' slicing, only the rows and columns of
this rank's pieces; export assembles one whole tensor at a time.

A mixture-of-experts layer's experts are one megapp tensor over all ``E`` experts
(:class:`Experts`): ``fc1`` ``[E, h, 2, f]`` holds each expert's gate and up
projections transposed, ``fc2`` ``[E, f, h]`` its down projection transposed; import
reads the experts of this rank's piece, export writes one Hugging Face tensor per
expert and projection.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from megapp.models.gpt import GPTConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Segment:
    """``count`` rows of HF tensor ``name`` from row ``start`` (its columns when ``transposed``,
    for GPT-2's ``Conv1D`` weights stored ``[in, out]``)."""

    name: str
    start: int
    count: int
    transposed: bool = False


@dataclass(frozen=True)
class Rows:
    """A megapp tensor whose rows are ``segments`` one after another; ``parts`` > 1 when it is
    the ``[parts, rows, ...]`` view of a strided weight (each part its own list)."""

    segments: tuple[tuple[Segment, ...], ...]

    def __init__(self, *parts: tuple[Segment, ...]) -> None:
        object.__setattr__(self, "segments", parts)


@dataclass(frozen=True)
class Experts:
    """A megapp expert tensor ``[E, ...]`` whose expert ``e`` is made of the Hugging Face
    tensors ``names`` (format strings of ``e``), each ``[out, in]``: ``fc1``'s
    ``[h, 2, f]`` stacks the first two (gate, up) transposed, ``fc2``'s ``[f, h]`` is the
    one (down) transposed."""

    names: tuple[str, ...]
    count: int

    def expert(self, folder: SafetensorsFolder, e: int) -> torch.Tensor:
        """Expert ``e`` in megapp's layout."""
        whole = tuple(slice(None) for _ in range(2))
        tensors = [folder.read(name.format(e=e), whole).t() for name in self.names]
        return torch.stack(tensors, dim=1) if len(tensors) > 1 else tensors[0]

    def read(self, folder: SafetensorsFolder, region: tuple[slice, ...]) -> torch.Tensor:
        """``region`` of the whole ``[E, ...]`` tensor, reading the experts it covers."""
        chosen = range(*region[0].indices(self.count))
        return torch.stack([self.expert(folder, e)[region[1:]] for e in chosen])

    def split(self, whole: torch.Tensor) -> dict[str, torch.Tensor]:
        """The Hugging Face tensors of the whole ``[E, ...]`` tensor."""
        out = {}
        for e in range(self.count):
            parts = whole[e].unbind(1) if len(self.names) > 1 else (whole[e],)
            for name, part in zip(self.names, parts, strict=True):
                out[name.format(e=e)] = part.t().contiguous()
        return out


def _whole(name: str, rows: int, transposed: bool = False) -> tuple[Segment, ...]:
    return (Segment(name, 0, rows, transposed),)


def _qkv(config: GPTConfig, q: str, k: str, v: str, transposed: bool, offsets=(0, 0, 0)) -> Rows:
    d, groups = config.kv_channels, config.num_query_groups
    per_group = config.num_attention_heads // groups
    segments = []
    for g in range(groups):
        segments.append(Segment(q, offsets[0] + g * per_group * d, per_group * d, transposed))
        segments.append(Segment(k, offsets[1] + g * d, d, transposed))
        segments.append(Segment(v, offsets[2] + g * d, d, transposed))
    return Rows(tuple(segments))


def hf_layout(config: GPTConfig, model_type: str, name: str) -> Rows | Experts:
    """How megapp's global tensor ``name`` (a checkpoint name, without ``model.``) is made of
    the Hugging Face tensors of a ``model_type`` model."""
    h, vocab = config.hidden_size, config.vocab_size
    parts = name.split(".")
    gpt2 = model_type == "gpt2"
    neox = model_type == "gpt_neox"
    if name in ("embedding.word_embeddings.weight", "output_weight"):
        tied = name.startswith("embedding") or config.share_embeddings_and_output_weights
        embedding = {"gpt2": "transformer.wte.weight", "gpt_neox": "gpt_neox.embed_in.weight"}
        output = "embed_out.weight" if neox else "lm_head.weight"
        hf = embedding.get(model_type, "model.embed_tokens.weight") if tied else output
        return Rows(_whole(hf, vocab))
    if name == "embedding.position_embeddings.weight" and gpt2:
        return Rows(_whole("transformer.wpe.weight", config.max_position_embeddings))
    if name.startswith("decoder.final_layernorm."):
        final = {"gpt2": "transformer.ln_f.", "gpt_neox": "gpt_neox.final_layer_norm."}
        return Rows(_whole(final.get(model_type, "model.norm.") + parts[-1], h))
    if parts[:2] != ["decoder", "layers"] or len(parts) < 5:
        raise KeyError(f"{name} has no Hugging Face counterpart in a {model_type} model")
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    if gpt2:
        return _gpt2_layer(config, f"transformer.h.{layer}.", module, kind)
    if neox:
        return _neox_layer(config, f"gpt_neox.layers.{layer}.", module, kind)
    if module.startswith("mlp.") and config.is_moe_layer(int(layer)):
        return _moe_layer(config, model_type, f"model.layers.{layer}.", module[4:], kind)
    return _llama_layer(config, f"model.layers.{layer}.", module, kind)


def _moe_layer(config: GPTConfig, model_type: str, p: str, module: str, kind: str):
    """Mixtral's ``block_sparse_moe`` (experts ``w1``, ``w3``, ``w2``) or Qwen2-MoE's ``mlp``
    (experts and the shared expert ``gate_proj``, ``up_proj``, ``down_proj``)."""
    h, count = config.hidden_size, config.num_moe_experts
    mixtral = model_type == "mixtral"
    p += "block_sparse_moe." if mixtral else "mlp."
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if module == "router" and kind == "weight":
        return Rows(_whole(f"{p}gate.weight", count))
    if module == "experts" and kind in ("fc1", "fc2"):
        e = p + "experts.{e}."
        names = (
            (f"{e}{gate}.weight", f"{e}{up}.weight") if kind == "fc1" else (f"{e}{down}.weight",)
        )
        return Experts(names, count)
    shared = config.moe_shared_expert_intermediate_size
    if not mixtral and shared is not None and kind in ("weight", "gate_weight"):
        s = f"{p}shared_expert."
        if module == "shared_expert" and kind == "gate_weight":
            return Rows(_whole(f"{p}shared_expert_gate.weight", 1))
        if module == "shared_expert.linear_fc1":
            return Rows(
                _whole(f"{s}gate_proj.weight", shared), _whole(f"{s}up_proj.weight", shared)
            )
        if module == "shared_expert.linear_fc2":
            return Rows(_whole(f"{s}down_proj.weight", h))
    raise KeyError(f"{p}{module}.{kind} has no Hugging Face counterpart in a {model_type} model")


def _gpt2_layer(config: GPTConfig, p: str, module: str, kind: str) -> Rows:
    h, ffn = config.hidden_size, config.ffn_hidden_size
    norms = {"input_layernorm": "ln_1", "pre_mlp_layernorm": "ln_2"}
    if module in norms:
        return Rows(_whole(f"{p}{norms[module]}.{kind}", h))
    weight = kind == "weight"
    if module == "self_attention.linear_qkv":
        name = f"{p}attn.c_attn.{kind}"
        return _qkv(config, name, name, name, weight, (0, h, 2 * h))
    if module == "self_attention.linear_proj":
        return Rows(_whole(f"{p}attn.c_proj.{kind}", h, weight))
    if module == "mlp.linear_fc1":
        return Rows(_whole(f"{p}mlp.c_fc.{kind}", ffn, weight))
    if module == "mlp.linear_fc2":
        return Rows(_whole(f"{p}mlp.c_proj.{kind}", h, weight))
    raise KeyError(f"{p}{module}.{kind} has no Hugging Face counterpart")


def _neox_layer(config: GPTConfig, p: str, module: str, kind: str) -> Rows:
    h, ffn, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    norms = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}
    if module in norms:
        return Rows(_whole(f"{p}{norms[module]}.{kind}", h))
    if module == "self_attention.linear_qkv":  # per head: its query, key and value rows
        name = f"{p}attention.query_key_value.{kind}"
        heads = range(config.num_attention_heads)
        return Rows(tuple(Segment(name, 3 * g * d + j * d, d) for g in heads for j in range(3)))
    names = {
        "self_attention.linear_proj": ("attention.dense", h),
        "mlp.linear_fc1": ("mlp.dense_h_to_4h", ffn),
        "mlp.linear_fc2": ("mlp.dense_4h_to_h", h),
    }
    if module in names:
        hf, rows = names[module]
        return Rows(_whole(f"{p}{hf}.{kind}", rows))
    raise KeyError(f"{p}{module}.{kind} has no Hugging Face counterpart")


def _llama_layer(config: GPTConfig, p: str, module: str, kind: str) -> Rows:
    h, ffn = config.hidden_size, config.ffn_hidden_size
    norms = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}
    if module in norms:
        return Rows(_whole(f"{p}{norms[module]}.{kind}", h))
    attn = f"{p}self_attn."
    if module == "self_attention.linear_qkv":
        return _qkv(
            config, f"{attn}q_proj.{kind}", f"{attn}k_proj.{kind}", f"{attn}v_proj.{kind}", False
        )
    if module == "self_attention.linear_proj":
        return Rows(_whole(f"{attn}o_proj.{kind}", h))
    if module == "mlp.linear_fc1":  # SwiGLU: [gate; up], viewed as [2, ffn, h]
        return Rows(_whole(f"{p}mlp.gate_proj.{kind}", ffn), _whole(f"{p}mlp.up_proj.{kind}", ffn))
    if module == "mlp.linear_fc2":
        return Rows(_whole(f"{p}mlp.down_proj.{kind}", h))
    raise KeyError(f"{p}{module}.{kind} has no Hugging Face counterpart")


class SafetensorsFolder:
    """The tensors of a Hugging Face model folder (one ``model.safetensors`` or shards with
    ``model.safetensors.index.json``), read by slices; GPT-2 files that drop the
    ``transformer.`` prefix are accepted."""

    def __init__(self, directory: str) -> None:
        from megapp.models.hf_deps import safetensors

        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as stream:
                self.files = dict(json.load(stream)["weight_map"])
        elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
            self.files = None
        else:
            raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._safe_open = safetensors.safe_open
        self._handles: dict[str, Any] = {}
        if self.files is None:
            self.files = dict.fromkeys(self._handle(SINGLE_FILE).keys(), SINGLE_FILE)

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._safe_open(
                os.path.join(self.directory, file), framework="pt", device="cpu"
            )
        return self._handles[file]

    def _resolve(self, name: str) -> str:
        if name in self.files:
            return name
        short = name.removeprefix("transformer.")
        if short in self.files:
            return short
        raise KeyError(f"{self.directory}: no tensor {name!r}")

    def shape(self, name: str) -> list[int]:
        key = self._resolve(name)
        return list(self._handle(self.files[key]).get_slice(key).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        key = self._resolve(name)
        return self._handle(self.files[key]).get_slice(key)[index]


def read_region(folder: SafetensorsFolder, rows: Rows, region: tuple[slice, ...]) -> torch.Tensor:
    """``region`` (one slice per dimension of megapp's whole tensor) of the tensor ``rows``
    describes, reading only what it covers."""
    if len(rows.segments) > 1:  # a strided weight: [parts, rows, ...]
        chosen = range(*region[0].indices(len(rows.segments)))
        return torch.stack(
            [read_region(folder, Rows(rows.segments[p]), region[1:]) for p in chosen]
        )
    first, stop = region[0].start or 0, region[0].stop
    rest = region[1:]
    pieces, offset = [], 0
    for seg in rows.segments[0]:
        lo, hi = max(first, offset), min(stop, offset + seg.count)
        if lo < hi:
            src = slice(seg.start + lo - offset, seg.start + hi - offset)
            if seg.transposed:  # HF [in, out]: megapp rows are HF columns
                piece = folder.read(seg.name, (rest[0], src)).t()
            else:
                piece = folder.read(seg.name, (src, *rest))
            pieces.append(piece)
        offset += seg.count
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def check_shapes(folder: SafetensorsFolder, rows: Rows, global_shape: list[int], name: str) -> None:
    """Every segment fits its HF tensor and the rows add up to megapp's whole tensor."""
    tail = global_shape[2:] if len(rows.segments) > 1 else global_shape[1:]
    for part in rows.segments:
        if sum(seg.count for seg in part) != (
            global_shape[1] if len(rows.segments) > 1 else global_shape[0]
        ):
            raise ValueError(f"{name}: the Hugging Face rows do not add up to {global_shape}")
        for seg in part:
            shape = folder.shape(seg.name)
            if seg.transposed and len(shape) == 2:
                shape = shape[::-1]
            if seg.start + seg.count > shape[0] or list(shape[1:]) != list(tail):
                raise ValueError(
                    f"{seg.name} has shape {folder.shape(seg.name)}, which does not fit megapp's "
                    f"{name} of shape {global_shape}"
                )
