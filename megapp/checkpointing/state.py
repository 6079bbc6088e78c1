"""Model and optimizer state as named pieces of layout-independent tensors.

Every parameter gets one name whatever the layout: the name it has in the
single-process model (layer ``l`` is ``decoder.layers.l`` on whichever stage holds
it; the last stage's copy of a tied embedding is the word embedding). Its value is
saved as this rank's tensor-parallel piece of the whole parameter
(:func:`~megapp.checkpointing.shards.tensor_parallel_shard`); data-parallel replicas
write the same piece, which DCP stores once.

The optimizer's AdamW moments (and fp32 master weights when the model is bf16/fp16)
are saved the same way, shaped like the parameter. With the distributed optimizer each
data-parallel rank holds only a flat slice of them; they are gathered over the
data-parallel group into whole tensor-parallel pieces before saving, and after loading
each rank keeps its own slice again, so a checkpoint does not depend on whether the
optimizer was distributed or on the data-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp.checkpointing.shards import TensorShard, tensor_parallel_shard

MODEL = "model."
OPTIMIZER = "optimizer."
STEP_KEY = "optimizer.step"
MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_name(module: nn.Module, name: str, param: nn.Parameter) -> str:
    """The layout-independent name of ``module``'s parameter ``name``."""
    if getattr(param, "shared", False) and getattr(param, "shared_embedding", False):
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(module.decoder.layers[int(parts[2])].layer_number)
    return ".".join(parts)


@dataclass
class _Param:
    name: str
    param: nn.Parameter
    chunk: nn.Module  # the DistributedDataParallel wrapper
    slice: object | None = None  # the optimizer's _Slice of it on this rank


@dataclass
class _Chunk:
    chunk: nn.Module
    params: list[_Param] = field(default_factory=list)


def named_params(chunks: Sequence[nn.Module], optimizer=None) -> list[_Chunk]:
    """Every parameter of ``chunks`` (DistributedDataParallel wrappers) with its checkpoint
    name, and the optimizer's slice of it on this rank."""
    slices = {id(s.param): s for s in optimizer.slices} if optimizer is not None else {}
    seen: set[str] = set()
    out = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        entry = _Chunk(chunk)
        for name, param in module.named_parameters():
            key = checkpoint_name(module, name, param)
            if key in seen:
                raise ValueError(f"two parameters on this rank are both named {key!r}")
            seen.add(key)
            entry.params.append(_Param(key, param, chunk, slices.get(id(param))))
        out.append(entry)
    return out


def model_shards(chunks: list[_Chunk], tp_rank: int, tp_size: int) -> dict[str, TensorShard]:
    """``{"model.<name>": piece}`` over the parameters' own storage (saving reads it,
    loading writes it in place)."""
    state = {}
    for c in chunks:
        for p in c.params:
            shard = tensor_parallel_shard(p.param.data, p.param, tp_rank, tp_size)
            if shard is not None:
                state[MODEL + p.name] = shard
    return state


def _has_own_masters(optimizer) -> bool:
    """True when the masters are fp32 copies (bf16/fp16 model), not the parameters."""
    return any(
        s.master.data_ptr() != s.param.data.view(-1)[s.lo : s.hi].data_ptr()
        for s in optimizer.slices
    )


def optimizer_kinds(optimizer) -> tuple[str, ...]:
    """The per-parameter states this optimizer keeps: the moments, and masters if separate."""
    return (*MOMENTS, "master") if _has_own_masters(optimizer) else MOMENTS


def adam_state(optimizer, master: torch.Tensor) -> dict:
    """The AdamW state of ``master``, created empty (step 0, zero moments) if it has none yet,
    in the layout torch's AdamW itself would create."""
    inner = optimizer.optimizer
    state = inner.state[master]
    if not state:
        group = next(g for g in inner.param_groups if any(p is master for p in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        state["step"] = (
            torch.zeros((), dtype=torch.float32, device=master.device)
            if on_device
            else torch.tensor(0.0, dtype=torch.float32)
        )
        for kind in MOMENTS:
            state[kind] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _value(optimizer, s, kind: str) -> torch.Tensor:
    return s.master if kind == "master" else adam_state(optimizer, s.master)[kind]


def optimizer_step(optimizer) -> float:
    """The number of updates so far (the same on every rank)."""
    steps = [float(st["step"]) for st in optimizer.optimizer.state.values() if "step" in st]
    step = torch.tensor([max(steps, default=0.0)], dtype=torch.float64)
    if dist.is_initialized():  # a rank may own no slice of any parameter
        comm.all_reduce(
            step, None if not dist.is_initialized() else dist.group.WORLD, dist.ReduceOp.MAX
        )
    return float(step)


def set_optimizer_step(optimizer, step: float) -> None:
    for s in optimizer.slices:
        adam_state(optimizer, s.master)["step"].fill_(step)


class OptimizerPieces:
    """Whole-parameter-shaped optimizer states of this rank's tensor-parallel pieces.

    Without the distributed optimizer these are views of the states themselves. With it
    they are gathered (:meth:`gather`, for saving) into, or scattered (:meth:`scatter`,
    after loading) from, one flat fp32 tensor per chunk laid out like its parameter buffer.
    """

    def __init__(self, chunks: list[_Chunk], optimizer, kinds: Sequence[str]):
        self.chunks, self.optimizer, self.kinds = chunks, optimizer, tuple(kinds)
        self.flat: dict[int, torch.Tensor] = {}
        self.tensors: dict[tuple[str, str], tuple[torch.Tensor, nn.Parameter]] = {}
        for c in chunks:
            sharded = optimizer.distributed and c.chunk.dp_size > 1
            if sharded:
                numel = c.chunk.buffer.param_data.numel()
                device = c.chunk.buffer.param_data.device
                flat = torch.zeros(len(self.kinds), numel, dtype=torch.float32, device=device)
                self.flat[id(c)] = flat
            for p in c.params:
                for k, kind in enumerate(self.kinds):
                    if sharded:
                        lo, hi = c.chunk.buffer.ranges[id(p.param)]
                        tensor = self.flat[id(c)][k, lo:hi].view(p.param.shape)
                    else:
                        if p.slice is None:
                            raise ValueError(f"the optimizer does not update {p.name}")
                        tensor = _value(optimizer, p.slice, kind).view(p.param.shape)
                    self.tensors[(kind, p.name)] = (tensor, p.param)

    def _own_ranges(self, c: _Chunk):
        for p in c.params:
            if p.slice is None:
                continue
            start = c.chunk.buffer.ranges[id(p.param)][0]
            lo, hi = start + p.slice.lo, start + p.slice.hi
            for k, kind in enumerate(self.kinds):
                yield k, lo, hi, _value(self.optimizer, p.slice, kind)

    def gather(self) -> None:
        """Fill the flat tensors from every data-parallel rank's slices."""
        works = []
        for c in self.chunks:
            flat = self.flat.get(id(c))
            if flat is None:
                continue
            for k, lo, hi, value in self._own_ranges(c):
                flat[k, lo:hi] = value
            works.append(comm.all_reduce(flat, c.chunk.dp_group, async_op=True))
        for work in works:  # each element has exactly one owner, so the sum is exact
            work.wait()

    def scatter(self) -> None:
        """Copy this rank's slices out of the loaded flat tensors."""
        for c in self.chunks:
            flat = self.flat.get(id(c))
            if flat is None:
                continue
            for k, lo, hi, value in self._own_ranges(c):
                value.copy_(flat[k, lo:hi])

    def shards(self, tp_rank: int, tp_size: int) -> dict[str, TensorShard]:
        state = {}
        for (kind, name), (tensor, param) in self.tensors.items():
            shard = tensor_parallel_shard(tensor, param, tp_rank, tp_size)
            if shard is not None:
                state[f"{OPTIMIZER}{kind}.{name}"] = shard
        return state
