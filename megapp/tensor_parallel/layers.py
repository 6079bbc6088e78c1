"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Activations are ``[s, b, h]``. A column-parallel linear splits its output
features over the TP ranks, a row-parallel linear its input features, so
``Column -> Row`` needs one all-reduce forward and one backward (Megatron's
MLP and attention split). With sequence parallelism the activations outside
those pairs are split along the sequence instead of replicated, and the
all-reduce becomes an all-gather before the column layer and a
reduce-scatter after the row layer (same bytes, s/tp activation memory).

Every layer builds its full weight from the default generator and keeps its
slice, so the same seed gives the same model under any tensor-parallel size.
Layers return ``(output, bias)``: ``bias`` is ``None`` unless
``skip_bias_add`` hands it to the caller to fuse into the next op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megapp import comm
from megapp.autograd import deferred
from megapp.comm import Group
from megapp.param_attributes import (
    mark_sequence_parallel,
    set_tensor_parallel,
    set_unpadded_size,
    shard,
)
from megapp.tensor_parallel.mappings import (
    gather_first,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_first,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megapp.tensor_parallel.overlap import OverlappedColumn, OverlappedRow
from megapp.tensor_parallel.utils import pad_vocab_size, vocab_range

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(std: float = 0.02) -> InitMethod:
    """Normal(0, std) initialization, Megatron's default."""

    def init(tensor: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(tensor, mean=0.0, std=std)

    return init


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size "
            f"({denominator}); choose a tensor-parallel size that divides it"
        )
    return numerator // denominator


def sliced_weight(
    shape: tuple[int, int],
    partition_dim: int,
    group: Group,
    init_method: InitMethod,
    dtype: torch.dtype,
    device: torch.device | str | None,
    padded_rows: int = 0,
    stride: int = 1,
) -> nn.Parameter:
    """Make the full ``shape`` weight in fp32 on CPU, zero-pad ``padded_rows`` rows,
    keep this rank's slice along ``partition_dim`` (see :func:`shard`). A padded weight
    records its real row count as ``unpadded_size`` (checkpoints store only those rows)."""
    full = torch.empty(shape, dtype=torch.float32)
    init_method(full)
    if padded_rows:
        full = torch.cat([full, full.new_zeros(padded_rows, shape[1])])
    part = shard(full, partition_dim, comm.rank(group), comm.world_size(group), stride)
    weight = nn.Parameter(part.to(dtype=dtype, device=device).contiguous())
    set_tensor_parallel(weight, partition_dim, stride, comm.world_size(group))
    if padded_rows:
        set_unpadded_size(weight, shape[0])
    return weight


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear``, or while a split-backward schedule runs its deferrable twin."""
    if deferred.state.record is None:
        return F.linear(x, weight, bias)
    return deferred.linear(x, weight, bias)


def _check_overlap(tp_comm_overlap: bool, sequence_parallel: bool) -> None:
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError("tp_comm_overlap overlaps sequence parallelism's collectives: it needs "
                         "sequence_parallel")  # fmt: skip


def _overlaps(group: Group) -> bool:
    """Whether a layer asked to overlap runs its ring now: with more than one rank, and
    not while a split-backward schedule records (its weight gradients are deferred by the
    plain path)."""
    return comm.world_size(group) > 1 and deferred.state.record is None


class _ColumnParallelMatmul(torch.autograd.Function):
    """``y = x Wᵀ (+ b)`` with the collectives of the column layer fused in.

    Without sequence parallelism the input is replicated: forward is a local
    matmul, backward all-reduces the input gradient. With it the input is a
    sequence shard: forward all-gathers it, backward reduce-scatters the
    input gradient. Backward launches those collectives asynchronously and
    computes the weight gradient while they run; during a split backward's ``I``
    the weight gradient is deferred instead (:mod:`~megapp.autograd.deferred`),
    and the input is gathered again, in the same order on every rank, at ``W``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.has_bias = bias is not None
        # Built under a split-backward schedule: the weight gradient may be deferred.
        ctx.deferrable = deferred.state.record is not None
        if ctx.deferrable:
            deferred.note_deferrable()
            ctx.param = weight  # the parameter itself, for a deferred weight gradient
        # Only the shard is saved; backward gathers it again (Megatron's memory trade).
        ctx.save_for_backward(x, weight)
        total = gather_first(x, group) if sequence_parallel else x
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, sequence_parallel = ctx.group, ctx.sequence_parallel

        kept = x.detach()  # without its graph, which would keep the chunk's input until W

        def gathered_input() -> torch.Tensor:
            return gather_first(kept, group) if sequence_parallel else kept

        later = (
            ctx.deferrable
            and ctx.needs_input_grad[1]
            and deferred.defer_weight_grad(
                ctx.param,
                lambda: deferred.weight_grad_of_linear(grad, gathered_input()),
                grad,
                kept,
            )
        )
        gathering = None
        if sequence_parallel and not later:
            total, gathering = gather_first(x, group, async_op=True)
        grad_input = grad.matmul(weight)
        work = None
        if sequence_parallel:
            if gathering is not None:
                gathering.wait()
            grad_input, work = reduce_scatter_first(grad_input, group, async_op=True)
        else:
            total = x
            if comm.world_size(group) > 1:
                grad_input = grad_input.contiguous()
                work = comm.all_reduce(grad_input, group, async_op=True)
        # The weight gradient overlaps the input-gradient collective.
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = None if later else deferred.weight_grad_of_linear(grad, total)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return grad_input, grad_weight, grad_bias, None, None


def column_parallel_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    sequence_parallel: bool,
) -> torch.Tensor:
    """``x Wᵀ (+ b)`` for this rank's column block ``weight [out/tp, in]``.

    ``x`` is ``[s, b, in]`` (``[s/tp, b, in]`` with sequence parallelism, gathered here);
    the result is ``[s, b, out/tp]``. With one rank there is nothing to communicate and it
    is plain ``F.linear``, whose autograd node is C++ (or, while a split-backward schedule
    runs, :func:`~megapp.autograd.deferred.linear`, whose weight gradient may be deferred).
    """
    if comm.world_size(group) == 1:
        return _linear(x, weight, bias)
    return _ColumnParallelMatmul.apply(x, weight, bias, group, sequence_parallel)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns (output features) over the TP ranks.

    Args:
        input_size, output_size: the full layer's features; ``output_size`` must
            divide by the TP size.
        bias: add a bias (split like the output).
        gather_output: all-gather the output so every rank holds all of it.
        init_method: fills the full ``[output_size, input_size]`` weight in place.
        skip_bias_add: return the bias instead of adding it.
        sequence_parallel: the input is ``[s/tp, b, h]``, gathered here.
        tp_comm_overlap: with sequence parallelism, gather the input shard by shard
            while the matmul runs (:class:`~megapp.tensor_parallel.overlap.OverlappedColumn`).
        tp_group: the tensor-parallel group (``None``: no tensor parallelism).
        stride: see :func:`shard` (2 for a fused ``[gate; up]`` SwiGLU weight).

    Input ``[s, b, input_size]`` (``[s/tp, b, ...]`` with sequence parallelism);
    output ``[s, b, output_size/tp]`` (``[s, b, output_size]`` if gathered).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod | None = None,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        tp_group: Group = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        stride: int = 1,
    ):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output and sequence_parallel cannot be combined")
        _check_overlap(tp_comm_overlap, sequence_parallel)
        self.tp_comm_overlap = tp_comm_overlap
        world = comm.world_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, world, "output_size")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        init = init_method or init_method_normal()
        divide(output_size, world * stride, "output_size / stride")
        self.weight = sliced_weight(
            (output_size, input_size), 0, tp_group, init, params_dtype, device, stride=stride
        )
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device)
            )
            set_tensor_parallel(self.bias, 0, stride, world)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        if self.tp_comm_overlap and _overlaps(self.tp_group):
            out = OverlappedColumn.apply(x, self.weight, bias, self.tp_group)
        else:
            out = column_parallel_matmul(
                x, self.weight, bias, self.tp_group, self.sequence_parallel
            )
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows (input features) over the TP ranks.

    Args:
        input_is_parallel: the input is already split along its last dim (the
            output of a column-parallel layer); otherwise it is split here.
        sequence_parallel: reduce-scatter the output to ``[s/tp, b, h]`` instead
            of all-reducing it; needs ``input_is_parallel``.
        tp_comm_overlap: with sequence parallelism, reduce-scatter piece by piece while
            the matmul runs (:class:`~megapp.tensor_parallel.overlap.OverlappedRow`).
        Others as in :class:`ColumnParallelLinear`. The bias is whole on every
        rank and added after the reduction.

    Input ``[s, b, input_size/tp]``; output ``[s, b, output_size]``
    (``[s/tp, b, output_size]`` with sequence parallelism).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_method: InitMethod | None = None,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        tp_group: Group = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        _check_overlap(tp_comm_overlap, sequence_parallel)
        self.tp_comm_overlap = tp_comm_overlap
        world = comm.world_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, world, "input_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        init = init_method or init_method_normal()
        self.weight = sliced_weight(
            (output_size, input_size), 1, tp_group, init, params_dtype, device
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            # Each rank sees only its sequence shard: the gradient needs a TP all-reduce.
            mark_sequence_parallel(self.bias, sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        if self.tp_comm_overlap and _overlaps(self.tp_group):
            out = OverlappedRow.apply(x, self.weight, self.tp_group)
        elif self.sequence_parallel:
            partial = _linear(x, self.weight)
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(_linear(x, self.weight), self.tp_group)
        if self.bias is None or self.skip_bias_add:
            return out, self.bias
        return out + self.bias, None


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the vocabulary split over the TP ranks.

    The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by ×``
    the TP size (padded rows are zero and never looked up); rank ``r`` holds a
    contiguous block of rows.
    Each rank looks up the ids it owns, zeros the rest, and the partial
    results are summed: all-reduce, or with sequence parallelism a
    reduce-scatter that leaves ``[s/tp, b, h]``.

    Input ids ``[s, b]``; output ``[s, b, h]`` (``[s/tp, b, h]``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        tp_group: Group = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        make_vocab_size_divisible_by: int = 1,
    ):
        super().__init__()
        world, rank = comm.world_size(tp_group), comm.rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = pad_vocab_size(
            num_embeddings, world, multiple=make_vocab_size_divisible_by
        )
        self.vocab_start, self.vocab_end = vocab_range(self.padded_num_embeddings, rank, world)
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        self.weight = sliced_weight(
            (num_embeddings, embedding_dim),
            0,
            tp_group,
            init_method or init_method_normal(),
            params_dtype,
            device,
            padded_rows=self.padded_num_embeddings - num_embeddings,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if comm.world_size(self.tp_group) > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            partial = F.embedding(local, self.weight)
            partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            partial = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)
