"""The optimizer of a data-parallel model: fp32 master weights, loss scaling, clipping, ZeRO-1.

:class:`Optimizer` updates the parameters of :class:`DistributedDataParallel`
chunks from their fp32 ``main_grad`` buffers.

- Master weights are fp32. For an fp32 model they are the model's parameters
  themselves (views into its buffer, no copy); for bf16/fp16 they are fp32
  copies, and the step writes the rounded result back.
- From ZeRO stage 1 on (the distributed optimizer) each data-parallel rank keeps master weights
  and optimizer states only for its slice of every bucket (1/dp of them, ZeRO-1):
  gradients arrive reduce-scattered, the rank updates its slice, and an
  all-gather over the data-parallel group gives every rank the whole model. Expert
  parameters are sliced the same way over the expert-data-parallel group.
- The gradient norm counts every gradient element once across the whole layout
  (tensor-parallel replicas and tied-embedding copies once; data-parallel
  slices summed when sharded) and is the same on every rank.
- fp16 uses a loss scaler: gradients are unscaled, a step with inf/nan anywhere
  is skipped on every rank and reported.
- With ``per_stage`` each pipeline stage steps on its own, at its own time (PipeDream,
  2BW); :func:`check_per_stage_steps` says what that cannot run with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp import parallel_state as ps
from megapp.comm import Group
from megapp.distributed.ddp import DistributedDataParallel
from megapp.optimizer.adamw import build_adamw
from megapp.optimizer.clip_grads import (
    clip_grad_by_total_norm_,
    counts_in_norm,
    get_grad_norm,
)
from megapp.optimizer.grad_scaler import found_inf_in
from megapp.optimizer.param_groups import default_no_decay
from megapp.param_attributes import is_expert_parallel, is_tied_embedding

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class StepResult:
    """What one optimizer step did; identical on every rank."""

    updated: bool
    """False when the step was skipped (inf/nan gradients under loss scaling)."""
    grad_norm: float
    """Global gradient norm before clipping (nan when skipped)."""


@dataclass
class _Slice:
    """One parameter's part that this rank updates."""

    param: nn.Parameter
    lo: int  # flat element range within the parameter
    hi: int
    master: torch.Tensor  # fp32 weights of that range
    counted: bool  # does its gradient enter the norm on this rank
    separate: bool  # the master is an fp32 copy (bf16/fp16 model), not the weights themselves
    chunk: DistributedDataParallel  # where its gradient is

    def weights(self) -> torch.Tensor:
        """The model's own flat weights of this range (its ZeRO-3 slice under stage 3)."""
        return self.chunk.owned_weights(self.param, self.lo, self.hi)


def check_per_stage_steps(
    who: str,
    *,
    pipeline_stages: int,
    clip_grad: float | None,
    tied_embedding: bool,
    sharded: bool,
    loss_scaling: bool,
) -> None:
    """Refuse what an optimizer that steps each of ``pipeline_stages`` stages on its own,
    at its own time (PipeDream, 2BW), cannot run with: a sharded optimizer, fp16 loss
    scaling, and over several stages clipping by the global norm or a word embedding
    tied across stages. ``who`` names the caller in the message; the message names the
    settings to change (``clip_grad``, ``zero_stage``, ...)."""
    several = pipeline_stages > 1
    refusals = [
        (
            sharded,
            "a sharded optimizer (zero_stage, use_distributed_optimizer), whose gradient "
            "norm and weight gathers span data-parallel ranks that step at other times; "
            "turn it off (zero_stage 0, no use_distributed_optimizer)",
        ),
        (
            loss_scaling,
            "fp16 loss scaling, whose skipped steps every stage must skip at once; use bf16",
        ),
        (
            several and bool(clip_grad),
            f"clipping by the global gradient norm (clip_grad) over {pipeline_stages} "
            "pipeline stages, which needs every stage's gradients of a step at once; set "
            "clip_grad to 0",
        ),
        (
            several and tied_embedding,
            "a word embedding tied across the first and last stage, whose two copies would "
            "step at different times; untie them (share_embeddings_and_output_weights)",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(
                f"{who} steps each pipeline stage on its own and cannot run with {why}"
            )


def _norm_groups(
    distributed: bool, tp_group: Group, norm_group: Group, per_stage: bool
) -> tuple[Group, Group]:
    """The (tp_group, norm_group) to use: the layout's, given ones checked against it."""
    if per_stage:
        if tp_group is None and ps.model_parallel_is_initialized():
            tp_group = ps.layout_group("tp", "Optimizer needs tp_group")
        return tp_group, tp_group
    if not ps.model_parallel_is_initialized():
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return tp_group, norm_group
        if distributed and norm_group is None:
            norm_group = dist.group.WORLD  # every rank holds its own slice of the gradients
        if norm_group is None:
            raise ValueError(
                f"Optimizer needs norm_group (the ranks that together hold every gradient "
                f"once) in a job of {dist.get_world_size()} ranks without a "
                "megapp.parallel_state layout; call initialize_model_parallel() first or "
                "pass tp_group and norm_group"
            )
        return tp_group, norm_group
    want = {
        "tp_group": (ps.layout_group("tp", "Optimizer needs tp_group"), "tensor-parallel group"),
        "norm_group": (
            (dist.group.WORLD, "every rank (distributed optimizer)")
            if distributed
            else (ps.layout_group("mp", "Optimizer needs norm_group"), "model-parallel group")
        ),
    }
    given = {"tp_group": tp_group, "norm_group": norm_group}
    for name, (group, what) in want.items():
        size = comm.world_size(group)
        if given[name] is None:
            given[name] = group
        elif comm.world_size(given[name]) != size:
            raise ValueError(
                f"Optimizer {name} has {comm.world_size(given[name])} ranks, but this layout's "
                f"{what} has {size}; leave {name} out to use the layout's"
            )
    return given["tp_group"], given["norm_group"]


class Optimizer:
    """AdamW over the master weights of ``chunks``.

    Args:
        chunks: this rank's model chunks, each wrapped in DistributedDataParallel
            (all sharding the optimizer, ZeRO stage 1 and up, or none).
        lr, weight_decay, betas, eps: AdamW settings (no decay on biases and 1-D params).
        clip_grad: clip the global gradient norm to this (0 or None: no clipping).
        grad_scaler: a loss scaler (fp16), or None.
        tp_group: the tensor-parallel group (which replicas to count once in the norm).
        norm_group: the group whose ranks together hold every gradient once: the
            model-parallel (tp × pp) group, or every rank with the distributed optimizer.
        Both default to the groups of :mod:`megapp.parallel_state`'s layout, and given ones
        are checked against it; without a layout, a job of one rank needs none, and a
        larger one must pass them (the distributed optimizer's norm group is then every
        rank). A wrong group gives a different gradient norm per rank, so the replicas
        would drift apart silently.
        expert_norm_group: the group whose ranks together hold every expert once (Megatron's
            expert tensor-model-pipeline group, etp × ep × pp; every rank with the
            distributed optimizer): the experts' share of the norm is summed there, each
            expert shard counted once (``expert_tp_group``: on its first expert
            tensor-parallel rank where it is replicated over them). Needed only when the
            chunks hold experts.
        per_stage: each pipeline stage steps on its own, at its own time (PipeDream,
            2BW): the norm is of this stage's gradients, over the tensor-parallel group.
            What cannot run so (:func:`check_per_stage_steps`) is refused here, on every
            rank of ``pp_group`` (a collective over it; default the layout's pipeline group).
    """

    def __init__(
        self,
        chunks: Sequence[DistributedDataParallel],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float | None = 1.0,
        grad_scaler=None,
        tp_group: Group = None,
        norm_group: Group = None,
        per_stage: bool = False,
        pp_group: Group = None,
        expert_norm_group: Group = None,
        expert_tp_group: Group = None,
    ):
        self.chunks = list(chunks)
        stages = {c.zero_stage for c in self.chunks}
        if len(stages) != 1:
            raise ValueError(f"all chunks must have the same ZeRO stage, got {sorted(stages)}")
        (self.zero_stage,) = stages
        self.per_stage = per_stage
        if per_stage:
            self._check_per_stage(clip_grad, grad_scaler, pp_group)
        tp_group, norm_group = _norm_groups(self.distributed, tp_group, norm_group, per_stage)
        self.clip_grad, self.grad_scaler, self.norm_group = clip_grad, grad_scaler, norm_group
        tp_rank, etp_rank = comm.rank(tp_group), comm.rank(expert_tp_group)
        self.expert_norm_group = expert_norm_group
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        if any(c.expert_params for c in self.chunks) and expert_norm_group is None and not alone:
            raise ValueError(
                "the model has experts but no expert_norm_group was given: the gradient "
                "norm would miss the other expert-parallel ranks' experts"
            )
        self.slices: list[_Slice] = []
        decay, no_decay = [], []
        for chunk in self.chunks:
            names = {id(p): n for n, p in chunk.module.named_parameters()}
            rank = chunk.dp_rank if self.distributed else 0
            world = chunk.dp_size if self.distributed else 1
            # every ZeRO stage shards the experts over the expert-data-parallel group
            erank = chunk.expert_dp_rank if self.distributed else 0
            eworld = chunk.expert_dp_size if self.distributed else 1
            for p in [*chunk.buffer.params, *chunk.expert_params]:
                expert = is_expert_parallel(p)
                if expert:
                    buffer, r, w = chunk.expert_buffer, erank, eworld
                else:
                    buffer, r, w = chunk.buffer, rank, world
                part = buffer.param_shard(p, r) if w > 1 else (0, p.numel())
                if part is None:
                    continue
                lo, hi = part
                flat = chunk.owned_weights(p, lo, hi)
                separate = flat.dtype != torch.float32
                master = flat.float() if separate else flat
                counted = counts_in_norm(p, etp_rank if expert else tp_rank)
                self.slices.append(_Slice(p, lo, hi, master, counted, separate, chunk))
                (no_decay if default_no_decay(names[id(p)], p) else decay).append(master)
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        self.optimizer = build_adamw(groups, lr=lr, betas=betas, eps=eps)
        self._slice_of = {id(s.param): s for s in self.slices}
        self._expert_slices = [is_expert_parallel(s.param) for s in self.slices]

    @property
    def distributed(self) -> bool:
        """Whether this rank keeps only its slice of the optimizer states (ZeRO stage 1 on)."""
        return self.zero_stage >= 1

    def _check_per_stage(self, clip_grad: float | None, grad_scaler, pp_group: Group) -> None:
        if pp_group is None:
            pp_group = ps.layout_group(
                "pp", "Optimizer(per_stage=True) needs pp_group (its pipeline stages)"
            )
        stages = comm.world_size(pp_group)
        params = [p for chunk in self.chunks for p in chunk.buffer.params]
        tied = any(is_tied_embedding(p) for p in params)
        if stages > 1:  # only the end stages hold the tied copies: every stage must refuse
            device = params[0].device if params else torch.device("cpu")
            flag = torch.tensor([float(tied)], device=device)
            comm.all_reduce(flag, pp_group, dist.ReduceOp.MAX)
            tied = bool(flag.item())
        check_per_stage_steps(
            "Optimizer(per_stage=True)",
            pipeline_stages=stages,
            clip_grad=clip_grad,
            tied_embedding=tied,
            sharded=self.distributed,
            loss_scaling=grad_scaler is not None,
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _grads(self) -> list[torch.Tensor]:
        return [s.chunk.owned_grad(s.param, s.lo, s.hi) for s in self.slices]

    @torch.no_grad()
    def step(self) -> StepResult:
        """Unscale, check, clip and apply this iteration's gradients (after finalize)."""
        grads = self._grads()
        if self.grad_scaler is not None:
            inv = 1.0 / float(self.grad_scaler.scale)
            torch._foreach_mul_(grads, inv)
            # every rank skips together
            found_inf = found_inf_in(grads, dist.group.WORLD if dist.is_initialized() else None)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return StepResult(False, float("nan"))
        grad_norm = self._grad_norm(grads)
        if self.clip_grad:
            clip_grad_by_total_norm_(grads, self.clip_grad, grad_norm)
        for s, g in zip(self.slices, grads, strict=True):
            s.master.grad = g
        self.optimizer.step()
        for s in self.slices:
            s.master.grad = None
            if s.separate:
                s.weights().copy_(s.master)
        if self.distributed:
            self._all_gather_params()
        return StepResult(True, grad_norm)

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global L2 norm: the dense gradients' squares summed over ``norm_group``, the
        experts' over ``expert_norm_group``, each element once."""
        if self.expert_norm_group is None:
            counted = [g for g, s in zip(grads, self.slices, strict=True) if s.counted]
            return get_grad_norm(counted, group=self.norm_group)
        pairs = list(zip(grads, self.slices, self._expert_slices, strict=True))
        dense = [g for g, s, expert in pairs if s.counted and not expert]
        experts = [g for g, s, expert in pairs if s.counted and expert]
        dense_norm = get_grad_norm(dense, group=self.norm_group)
        expert_norm = get_grad_norm(experts, group=self.expert_norm_group)
        return (dense_norm**2 + expert_norm**2) ** 0.5

    def _all_gather_params(self) -> None:
        works = []
        for chunk in self.chunks:
            if chunk.dp_size == 1:
                continue
            if chunk.sharded_params is not None:
                continue  # gathered when each layer next runs
            for bucket in chunk.buffer.buckets:
                lo, hi = bucket.shard(chunk.dp_rank, chunk.dp_size)
                full = chunk.buffer.param_data[bucket.start : bucket.end]
                own = chunk.buffer.param_data[lo:hi].clone()
                works.append(comm.all_gather_into(full, own, chunk.dp_group, async_op=True))
        for chunk in self.chunks:  # the experts' slices, over the expert-data-parallel group
            if chunk.expert_buffer is None or chunk.expert_dp_size == 1:
                continue
            if chunk.expert_sharded_params is not None:
                continue  # ZeRO-3: gathered when each layer next runs
            buffer = chunk.expert_buffer
            for bucket in buffer.buckets:
                lo, hi = bucket.shard(chunk.expert_dp_rank, chunk.expert_dp_size)
                full = buffer.param_data[bucket.start : bucket.end]
                own = buffer.param_data[lo:hi].clone()
                works.append(comm.all_gather_into(full, own, chunk.expert_dp_group, async_op=True))
        for work in works:
            work.wait()

    def state_bytes(self) -> int:
        """Bytes of optimizer state and separate master weights held on this rank."""
        total = 0
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if t.dim() > 0)
        for s in self.slices:
            if s.separate:
                total += s.master.numel() * s.master.element_size()
        return total

    # ----- what a checkpoint needs ------------------------------------------
    @property
    def has_separate_masters(self) -> bool:
        """True when the fp32 masters are copies (a bf16/fp16 model), not the weights."""
        return any(s.separate for s in self.slices)

    def state_kinds(self) -> tuple[str, ...]:
        """The per-parameter states a checkpoint keeps: AdamW's moments, and the masters
        when they are copies."""
        return (*MOMENTS, "master") if self.has_separate_masters else MOMENTS

    def owned_range(self, param: nn.Parameter) -> tuple[int, int] | None:
        """The flat range ``[lo, hi)`` of ``param`` this rank updates (all of it without the
        distributed optimizer); None when it owns none of it."""
        s = self._slice_of.get(id(param))
        return None if s is None else (s.lo, s.hi)

    def state_of(self, param: nn.Parameter, kind: str) -> torch.Tensor:
        """The flat fp32 state ``kind`` (``exp_avg``, ``exp_avg_sq`` or ``master``) of the
        range of ``param`` this rank updates; moments are created (zero, step 0) the way
        AdamW would create them if it has not stepped yet."""
        s = self._slice_of[id(param)]
        if kind == "master":
            return s.master
        if kind not in MOMENTS:
            raise ValueError(f"unknown optimizer state {kind!r}; known: master, {MOMENTS}")
        return self._adam_state(s.master)[kind]

    def _adam_state(self, master: torch.Tensor) -> dict:
        state = self.optimizer.state[master]
        if not state:
            group = next(g for g in self.param_groups if any(p is master for p in g["params"]))
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = (
                torch.zeros((), dtype=torch.float32, device=master.device)
                if on_device
                else torch.tensor(0.0, dtype=torch.float32)
            )
            for kind in MOMENTS:
                state[kind] = torch.zeros_like(master, memory_format=torch.preserve_format)
        return state

    def step_count(self) -> float:
        """Updates applied so far, as this rank's AdamW state records them (0 before the first,
        and on a rank that owns no parameter slice)."""
        steps = [float(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        return max(steps, default=0.0)

    def set_step_count(self, step: float) -> None:
        for s in self.slices:
            self._adam_state(s.master)["step"].fill_(step)

    def copy_masters_from_weights(self) -> None:
        """Refresh the fp32 masters from the model's weights (after loading weights alone)."""
        for s in self.slices:
            if s.separate:
                s.master.copy_(s.weights())
