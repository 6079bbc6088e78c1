"""The routed experts of one rank: ``L`` MLPs run on their rows in one call.

Expert ``e`` is ``fc2_e(act(fc1_e(x)))`` with ``fc1_e`` ``[h, F]`` (``F = 2f``, ``[gate | up]``,
for SwiGLU; ``f`` otherwise) and ``fc2_e`` ``[f, h]``, stored stacked as ``fc1`` ``[L, h, F]`` and
``fc2`` ``[L, f, h]`` (input dimension first, as a grouped matmul takes them), with optional
biases ``[L, F]`` and ``[L, h]``. The rows arrive grouped by expert (``tokens_per_expert``).

Expert tensor parallelism (``etp_group`` of ``etp`` ranks) splits every expert as the dense
MLP is split: ``fc1`` by output columns (SwiGLU: matching gate and up columns), ``fc2`` by
input rows, ``fc2``'s bias whole. Each etp rank brings its own rows; they are all-gathered
over the group (padded to the largest, after the counts per expert), every rank runs its
shard on all of them, and the partial outputs are reduce-scattered back, so each rank gets
the whole output of its own rows. ``fc2``'s bias is added after that, on each rank's own
rows; its gradient is summed over the group in backward, so the copies stay equal.

Two ways to run them, with the same results (checked in the tests):

- one grouped matmul per linear layer (``torch._grouped_mm``), where torch has it for the
  dtype, device and shapes (:func:`grouped_mm_supported`): on CPU float32, bfloat16 and
  float16 with every row 16-byte aligned; on CUDA bfloat16;
- otherwise a loop over the experts, one matmul each on its slice of rows.

Every expert's weights are drawn from a generator seeded by the expert's global index and
one seed from the default generator, so the same seed gives every expert the same weights
whatever the expert-parallel size, without building the other ranks' experts.

The second matmul's input, the activation's output, is not kept for backward: it is rebuilt
from the kept pre-activation (``recompute_saved_inputs``, as the dense MLP does; off inside
full recompute, which rebuilds the whole layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapp import comm
from megapp.autograd.saved import recompute_saved
from megapp.comm import Group
from megapp.fusions.bias_ops import bias_swiglu
from megapp.moe.config import MoEConfig
from megapp.moe.permutation import expert_major_rows, place_rows
from megapp.param_attributes import shard
from megapp.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_first,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["GroupedExperts", "activation", "grouped_mm_supported"]

_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``swiglu`` (x ``[..., 2f]`` = ``[gate | up]`` -> ``[..., f]``), ``gelu`` (tanh
    approximation) or ``gelu_erf``."""
    if kind == "swiglu":
        return bias_swiglu(x, None)
    if kind == "gelu_erf":
        return F.gelu(x)
    return F.gelu(x, approximate="tanh")


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` runs matrices of ``dtype`` on ``device`` whose rows are
    ``widths`` elements long (it needs 16-byte aligned rows)."""
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_DTYPES.get(device.type, ()):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(w * size % 16 == 0 for w in widths)


def _add_per_expert(
    rows: torch.Tensor, bias: torch.Tensor, tokens_per_expert: list[int]
) -> torch.Tensor:
    """``rows`` ``[M, w]`` grouped by expert plus each expert's ``bias`` ``[L, w]``, added
    into ``rows`` (a matmul's output, which its backward does not read): one ``[M, w]``
    of repeated biases alive beside them, not two."""
    counts = torch.tensor(tokens_per_expert, device=rows.device)
    return rows.add_(bias.repeat_interleave(counts, dim=0))


def _seeded_normal(shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


class GroupedExperts(nn.Module):
    """Experts ``[first, first + L)`` of ``config.num_moe_experts`` (``L`` =
    ``config.num_local_experts``; ``first = ep_rank · L``), each split over ``etp_group``
    (``None``: whole)."""

    def __init__(self, config: MoEConfig, ep_rank: int = 0, etp_group: Group = None):
        super().__init__()
        self.config, self.etp_group = config, etp_group
        # Rebuild fc2's saved input in backward (turned off inside full recompute).
        self.recompute_saved_inputs = True
        etp, etp_rank = comm.world_size(etp_group), comm.rank(etp_group)
        if etp != config.expert_tensor_parallel_size:
            raise ValueError(
                f"config.expert_tensor_parallel_size is {config.expert_tensor_parallel_size} "
                f"but the expert tensor-parallel group has {etp} ranks"
            )
        local, h = config.num_local_experts, config.hidden_size
        self.first = ep_rank * local
        # one draw each from the default generator, whatever the layout
        seeds = torch.randint(0, 2**62, (2,)).tolist()
        experts = range(self.first, self.first + local)
        std, dtype = config.init_method_std, config.params_dtype
        stride = 2 if config.activation == "swiglu" else 1  # matching gate and up columns

        def part(shape: tuple[int, int], seed: int, dim: int, stride: int = 1) -> torch.Tensor:
            return shard(_seeded_normal(shape, seed, std), dim, etp_rank, etp, stride)

        fc1 = [part((h, config.fc1_width), seeds[0] + e, 1, stride) for e in experts]
        fc2 = [part((config.moe_ffn_hidden_size, h), seeds[1] + e, 0) for e in experts]
        self.fc1 = nn.Parameter(torch.stack(fc1).to(dtype))
        self.fc2 = nn.Parameter(torch.stack(fc2).to(dtype))
        if config.add_bias_linear:
            self.fc1_bias = nn.Parameter(torch.zeros(local, config.fc1_width // etp, dtype=dtype))
            self.fc2_bias = nn.Parameter(torch.zeros(local, h, dtype=dtype))
        else:
            self.fc1_bias = self.fc2_bias = None

    def uses_grouped_mm(self, rows: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs ``rows`` as grouped matmuls."""
        widths = (self.config.hidden_size, self.fc1.shape[-1], self.fc2.shape[1])
        return (
            self.config.moe_grouped_gemm
            and rows.shape[0] > 0
            and rows.dtype == self.fc1.dtype
            and grouped_mm_supported(rows.dtype, rows.device, *widths)
        )

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``rows`` ``[M, h]`` grouped by local expert -> ``[M, h]``."""
        if len(tokens_per_expert) != self.fc1.shape[0] or sum(tokens_per_expert) != rows.shape[0]:
            raise ValueError(
                f"{rows.shape[0]} rows do not split as tokens_per_expert {tokens_per_expert} "
                f"over {self.fc1.shape[0]} local experts"
            )
        if comm.world_size(self.etp_group) == 1:
            out = self._partial(rows, tokens_per_expert)
        else:
            out = self._split_over_ranks(rows, tokens_per_expert)
        if self.fc2_bias is None:
            return out
        bias = copy_to_tensor_model_parallel_region(self.fc2_bias, self.etp_group)
        return _add_per_expert(out, bias, tokens_per_expert)

    def _partial(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """This rank's shard of every expert on ``rows`` (the whole output without etp), no
        fc2 bias."""
        matmul = self._grouped if self.uses_grouped_mm(rows) else self._looped
        inner = matmul(rows, self.fc1, tokens_per_expert)
        if self.fc1_bias is not None:
            inner = _add_per_expert(inner, self.fc1_bias, tokens_per_expert)
        hidden = activation(inner, self.config.activation)
        if not self.recompute_saved_inputs:
            return matmul(hidden, self.fc2, tokens_per_expert)
        # fc2 would save the activation's output; rebuild it from the kept pre-activation.
        with recompute_saved(hidden, activation, inner, self.config.activation):
            return matmul(hidden, self.fc2, tokens_per_expert)

    def _split_over_ranks(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Every etp rank's rows through this rank's shard; this rank's rows' sums back."""
        group, etp = self.etp_group, comm.world_size(self.etp_group)
        mine = torch.tensor(tokens_per_expert, dtype=torch.int64, device=rows.device)
        counts = gather_first(mine, group).view(etp, -1).cpu()  # [etp rank, local expert]
        slot = int(counts.sum(dim=1).max())
        if slot == 0:  # no rank of the group has a row: all skip alike
            return self._partial(rows, tokens_per_expert)
        padded = F.pad(rows, (0, 0, 0, slot - rows.shape[0]))
        gathered = gather_from_sequence_parallel_region(padded, group)  # [etp · slot, h]
        order = expert_major_rows(counts, slot).to(rows.device)
        out = self._partial(gathered.index_select(0, order), counts.sum(dim=0).tolist())
        back = place_rows(out, order, etp * slot)
        return reduce_scatter_to_sequence_parallel_region(back, group)[: rows.shape[0]]

    @staticmethod
    def _grouped(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ends = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight, offs=ends)

    @staticmethod
    def _looped(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, weight.dtype)
        pieces = x.to(dtype).split(counts)
        return torch.cat([p @ w.to(dtype) for p, w in zip(pieces, weight, strict=True)])
