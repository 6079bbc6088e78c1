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

A mixture-of-experts layer's experts are saved under their global expert index
(:func:`~megapp.checkpointing.shards.expert_parallel_shard`), split as the expert
tensor-parallel group splits them, so a checkpoint loads under another
expert-parallel size too; their distributed-optimizer slices are gathered over the
expert-data-parallel group, which shards them.

Saved buffers (a router's expert bias) are not trained and are replicated wherever their
module is: each is saved whole under its module's layout-independent name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp.checkpointing.shards import (
    TensorShard,
    expert_parallel_shard,
    tensor_parallel_shard,
)
from megapp.param_attributes import is_duplicate, is_expert_parallel, is_tied_embedding

MODEL = "model."
OPTIMIZER = "optimizer."
STEP_KEY = "optimizer.step"


def checkpoint_name(module: nn.Module, name: str, param: nn.Parameter) -> str:
    """The layout-independent name of ``module``'s parameter (or buffer) ``name``."""
    if is_duplicate(param) and is_tied_embedding(param):
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(module.decoder.layers[int(parts[2])].layer_number)
    return ".".join(parts)


@dataclass(frozen=True)
class Placement:
    """This rank's coordinates in the tensor-parallel split of dense weights and in the
    expert-tensor-parallel and expert-parallel splits of experts."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def of(cls, groups) -> Placement:
        """From a :class:`~megapp.parallel_state.TrainGroups`."""
        etp, ep = getattr(groups, "expt_tp", groups.tp), getattr(groups, "ep", None)
        return cls(
            comm.rank(groups.tp),
            comm.world_size(groups.tp),
            comm.rank(etp),
            comm.world_size(etp),
            comm.rank(ep),
            comm.world_size(ep),
        )

    def piece(self, tensor: torch.Tensor, param: nn.Parameter) -> TensorShard | None:
        """``tensor`` (``param`` or a state of its shape) as a piece of the whole tensor."""
        if is_expert_parallel(param):
            return expert_parallel_shard(
                tensor, param, self.etp_rank, self.etp_size, self.ep_rank, self.ep_size
            )
        return tensor_parallel_shard(tensor, param, self.tp_rank, self.tp_size)


@dataclass
class _Param:
    name: str
    param: nn.Parameter
    chunk: nn.Module  # the DistributedDataParallel wrapper
    owned: tuple[int, int] | None = None  # the flat range the optimizer updates on this rank


@dataclass
class _Chunk:
    chunk: nn.Module
    params: list[_Param] = field(default_factory=list)


def named_params(chunks: Sequence[nn.Module], optimizer=None) -> list[_Chunk]:
    """Every parameter of ``chunks`` (DistributedDataParallel wrappers) with its checkpoint
    name, and the range of it the optimizer updates on this rank."""
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
            owned = optimizer.owned_range(param) if optimizer is not None else None
            entry.params.append(_Param(key, param, chunk, owned))
        out.append(entry)
    return out


def model_shards(chunks: list[_Chunk], placement: Placement) -> dict[str, TensorShard]:
    """``{"model.<name>": piece}`` over the parameters' own storage (saving reads it,
    loading writes it in place)."""
    state = {}
    for c in chunks:
        for p in c.params:
            shard = placement.piece(p.param.data, p.param)
            if shard is not None:
                state[MODEL + p.name] = shard
    return state


def buffer_shards(chunks: Sequence[nn.Module]) -> dict[str, TensorShard]:
    """``{"model.<name>": whole buffer}`` for every saved (persistent) buffer of ``chunks``,
    such as a router's expert bias: state that is not trained, replicated on every rank that
    holds its module (saving reads it, loading writes it in place)."""
    state = {}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        params = {id(p) for p in module.parameters()}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) not in params:
                key = MODEL + checkpoint_name(module, name, tensor)
                state[key] = TensorShard(tensor.data, [0] * tensor.dim(), tensor.shape)
    return state


def optimizer_step(optimizer) -> float:
    """The number of updates so far, the same on every rank (a rank may own no slice of any
    parameter, and so no AdamW state)."""
    step = torch.tensor([optimizer.step_count()], dtype=torch.float64)
    if dist.is_initialized():
        comm.all_reduce(step, dist.group.WORLD, dist.ReduceOp.MAX)
    return float(step)


class OptimizerPieces:
    """Whole-parameter-shaped optimizer states of this rank's tensor-parallel pieces.

    Without the distributed optimizer these are views of the states themselves. With it
    they are gathered (:meth:`gather`, for saving) into, or scattered (:meth:`scatter`,
    after loading) from, one flat fp32 tensor per chunk laid out like its parameter buffer.
    """

    def __init__(self, chunks: list[_Chunk], optimizer, kinds: Sequence[str]):
        self.chunks, self.optimizer, self.kinds = chunks, optimizer, tuple(kinds)
        self.flat: dict[tuple[int, bool], torch.Tensor] = {}
        self.tensors: dict[tuple[str, str], tuple[torch.Tensor, nn.Parameter]] = {}
        for c in chunks:
            for p in c.params:
                expert = is_expert_parallel(p.param)
                buffer, dp_size, _ = _buffer_of(c.chunk, expert)
                sharded = optimizer.distributed and dp_size > 1
                key = (id(c), expert)
                if sharded and key not in self.flat:
                    self.flat[key] = torch.zeros(
                        len(self.kinds),
                        buffer.numel,
                        dtype=torch.float32,
                        device=buffer.params[0].device,
                    )
                for k, kind in enumerate(self.kinds):
                    if sharded:
                        lo, hi = buffer.ranges[id(p.param)]
                        tensor = self.flat[key][k, lo:hi].view(p.param.shape)
                    else:
                        if p.owned is None:
                            raise ValueError(f"the optimizer does not update {p.name}")
                        tensor = optimizer.state_of(p.param, kind).view(p.param.shape)
                    self.tensors[(kind, p.name)] = (tensor, p.param)

    def _own_ranges(self, c: _Chunk, expert: bool):
        buffer = _buffer_of(c.chunk, expert)[0]
        for p in c.params:
            if p.owned is None or is_expert_parallel(p.param) != expert:
                continue
            start = buffer.ranges[id(p.param)][0]
            lo, hi = start + p.owned[0], start + p.owned[1]
            for k, kind in enumerate(self.kinds):
                yield k, lo, hi, self.optimizer.state_of(p.param, kind)

    def _flats(self):
        for c in self.chunks:
            for expert in (False, True):
                flat = self.flat.get((id(c), expert))
                if flat is not None:
                    yield c, expert, flat

    def gather(self) -> None:
        """Fill the flat tensors from every (expert-)data-parallel rank's slices."""
        works = []
        for c, expert, flat in self._flats():
            for k, lo, hi, value in self._own_ranges(c, expert):
                flat[k, lo:hi] = value
            group = _buffer_of(c.chunk, expert)[2]
            works.append(comm.all_reduce(flat, group, async_op=True))
        for work in works:  # each element has exactly one owner, so the sum is exact
            work.wait()

    def scatter(self) -> None:
        """Copy this rank's slices out of the loaded flat tensors."""
        for c, expert, flat in self._flats():
            for k, lo, hi, value in self._own_ranges(c, expert):
                value.copy_(flat[k, lo:hi])

    def shards(self, placement: Placement) -> dict[str, TensorShard]:
        state = {}
        for (kind, name), (tensor, param) in self.tensors.items():
            shard = placement.piece(tensor, param)
            if shard is not None:
                state[f"{OPTIMIZER}{kind}.{name}"] = shard
        return state


def _buffer_of(chunk: nn.Module, expert: bool):
    """The buffer holding a chunk's dense or expert parameters, the size of the group that
    shards their optimizer states, and that group."""
    if expert:
        return chunk.expert_buffer, chunk.expert_dp_size, chunk.expert_dp_group
    return chunk.buffer, chunk.dp_size, chunk.dp_group
