"""Torch process groups built from a :class:`ProcessGrid`, with Megatron-named getters.

Layers and engines take the groups they use as arguments; the getters here are
a thin convenience over one module-level state for scripts that expect
Megatron's API. ``destroy_model_parallel()`` tears the groups down so the same
processes can initialize another layout.

Run ``python -m megapp.parallel_state --world-size 16 --tp 2 --pp 4`` to print
where every rank goes before launching.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megapp import comm
from megapp.pipeline_parallel.channels import Channels, make_channels
from megapp.process_grid import CONTEXT_GROUPS, EXPERT_GROUP_NAMES, GROUP_NAMES, ProcessGrid

# What errors (and NCCL's watchdog) call each kind of group.
GROUP_DESCRIPTIONS = {
    "tp": "tensor-parallel",
    "pp": "pipeline-parallel",
    "dp": "data-parallel",
    "mp": "model-parallel",
    "embedding": "embedding",
    "position_embedding": "position-embedding",
    "cp": "context-parallel",
    "tp_cp": "tensor-and-context-parallel",
    "dp_cp": "data-and-context-parallel",
    "ep": "expert-model-parallel",
    "expt_tp": "expert-tensor-parallel",
    "expt_dp": "expert-data-parallel",
    "tp_ep": "expert-tensor-and-model-parallel",
    "tp_ep_pp": "expert-tensor-model-pipeline-parallel",
}

__all__ = [
    "ProcessGrid",
    "TrainGroups",
    "destroy_model_parallel",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_group_with_cp",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_embedding_group",
    "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group",
    "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_parallel_group",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_grid",
    "get_group",
    "get_group_ranks",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_position_embedding_group",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "layout_group",
    "model_parallel_is_initialized",
    "set_virtual_pipeline_model_parallel_rank",
]


@dataclass
class _State:
    grid: ProcessGrid
    rank: int
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    virtual_pipeline_rank: int | None = None
    channels: Channels | None = None


_STATE: _State | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    order: str = "tp-cp-dp-pp",
    timeout: timedelta | None = None,
    *,
    context_parallel_size: int = 1,
    strict_p2p: bool = False,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ProcessGrid:
    """Create the tp, pp, dp, mp, embedding and position-embedding groups, and with
    ``context_parallel_size`` > 1 the cp, tp_cp and dp_cp groups.

    The expert layout's groups (ep, expt_tp, expt_dp, tp_ep, tp_ep_pp; see
    :meth:`ProcessGrid.expert_groups`) are new process groups only where they differ
    from a group made above: with ``expert_model_parallel_size`` 1 and
    ``expert_tensor_parallel_size`` None (= tp), expt_tp is tp, expt_dp is dp (dp_cp),
    and no ep group exists (its getter returns None, like cp's).

    Needs an initialized default group; every rank must call it with the same
    arguments. The groups use the default group's backend (gloo on CPU, NCCL
    on GPU) and ``timeout`` (default: the default group's), so a collective that
    waits on a dead or stuck rank fails within it. On NCCL, or with ``strict_p2p``
    on gloo, it also makes the pipeline's one-way channels
    (:mod:`~megapp.pipeline_parallel.channels`; strict ones with ``strict_p2p``).
    Returns the grid.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() (or launch with torchrun) first"
        )
    if _STATE is not None:
        raise RuntimeError(
            "model parallel groups are already initialized; call destroy_model_parallel() "
            "before initializing another layout"
        )
    grid = ProcessGrid(
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        order,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    state = _State(grid=grid, rank=dist.get_rank())
    if grid.vpp is not None:
        state.virtual_pipeline_rank = 0
    for name in GROUP_NAMES:
        if grid.cp == 1 and name in CONTEXT_GROUPS:
            continue  # a cp group of one rank; tp_cp and dp_cp equal tp and dp
        # Every rank creates every group, in the same order, as new_group requires.
        for members in grid.groups(name):
            group = comm.new_group(members, GROUP_DESCRIPTIONS[name], timeout)
            if state.rank in members:
                state.groups[name] = group
                state.ranks[name] = members
    _make_expert_groups(state, timeout)
    if grid.pp > 1 and (strict_p2p or dist.get_backend() == "nccl"):
        state.channels = make_channels(grid.groups("pp"), timeout, strict=strict_p2p)
    _STATE = state
    return grid


# Without an expert layout (ep 1, etp = tp) expert layers use these dense groups.
_DENSE_TWINS = {"expt_tp": "tp", "expt_dp": "dp_cp", "tp_ep": "tp", "tp_ep_pp": "mp"}


def _make_expert_groups(state: _State, timeout: timedelta | None) -> None:
    """The expert layout's groups. Without one (ep 1, etp = tp) they are the dense twins
    and ep has none; with one, a dense group of the same members where there is one, a new
    process group otherwise. Pure arithmetic on the grid decides, so every rank creates the
    same groups in the same order."""
    grid = state.grid
    if not grid.has_expert_layout:
        for name, twin in _DENSE_TWINS.items():
            twin = twin if twin in state.groups else "dp"  # dp_cp exists with cp > 1 only
            state.groups[name], state.ranks[name] = state.groups[twin], state.ranks[twin]
        return
    made = [kind for kind in GROUP_NAMES if kind in state.groups]
    dense = {kind: grid.groups(kind) for kind in made}
    for name in EXPERT_GROUP_NAMES:
        members_of = grid.expert_groups(name)
        if name == "ep" and grid.ep == 1:
            continue
        twin = next((kind for kind, groups in dense.items() if groups == members_of), None)
        if twin is not None:
            state.groups[name], state.ranks[name] = state.groups[twin], state.ranks[twin]
            continue
        for members in members_of:
            group = comm.new_group(members, GROUP_DESCRIPTIONS[name], timeout)
            if state.rank in members:
                state.groups[name] = group
                state.ranks[name] = members


def destroy_model_parallel() -> None:
    """Destroy the groups made by :func:`initialize_model_parallel` (no-op if none)."""
    global _STATE
    if _STATE is None:
        return
    # An expert group may be a dense one under a second name: destroy each once.
    for group in {id(g): g for g in _STATE.groups.values()}.values():
        dist.destroy_process_group(group)
    if _STATE.channels is not None:
        _STATE.channels.destroy()
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def layout_group(name: str, needs: str) -> dist.ProcessGroup | None:
    """The current layout's group of kind ``name`` for an API that was not given one.

    Without a layout: ``None`` (no such parallelism) in a job of one rank; in a larger
    job a ValueError that starts with ``needs`` (what the caller must pass), since
    guessing there gives silently wrong numbers.
    """
    if _STATE is not None:
        return get_group(name)
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{needs}: this job has {dist.get_world_size()} ranks and no megapp.parallel_state "
            "layout to take it from (call initialize_model_parallel() first, or pass it)"
        )
    return None


@dataclass
class TrainGroups:
    """The process groups a training step talks to, by purpose (``None``: that dimension
    is 1, or this rank is in no such group). ``mp``: the model-parallel group, the ranks
    that together hold one copy of the model (tp × pp) for one context-parallel slice.
    ``dp`` splits the batch (its ranks read different samples); ``cp`` splits every
    sequence; ``dp_cp``, the ranks that hold the same weights, reduces the gradients (it
    is ``dp`` without context parallelism). ``tp_cp``: the ranks holding the parts of
    one sequence (``tp`` without context parallelism). ``pp_channels``: the pipeline's
    one-way groups (:mod:`~megapp.pipeline_parallel.channels`), where the layout has them
    (NCCL, or ``strict_p2p``). The expert layout's groups, for mixture-of-experts layers:
    ``ep`` (different experts), ``expt_tp`` (the shards of one expert), ``expt_dp`` (the
    replicas of one expert shard: its gradients are reduced there) and ``tp_ep_pp`` (one
    copy of every expert); without an expert layout ``ep`` is None and the others are
    their dense twins."""

    tp: comm.Group = None
    pp: comm.Group = None
    dp: comm.Group = None
    embedding: comm.Group = None
    mp: comm.Group = None
    cp: comm.Group = None
    dp_cp: comm.Group = None
    pp_channels: Channels | None = None
    tp_cp: comm.Group = None
    ep: comm.Group = None
    expt_tp: comm.Group = None
    expt_dp: comm.Group = None
    tp_ep_pp: comm.Group = None

    def __post_init__(self) -> None:
        if self.dp_cp is None:
            if comm.world_size(self.cp) > 1:
                raise ValueError("TrainGroups with a context-parallel group needs dp_cp too")
            self.dp_cp = self.dp
        if self.tp_cp is None:
            if comm.world_size(self.cp) > 1:
                raise ValueError("TrainGroups with a context-parallel group needs tp_cp too")
            self.tp_cp = self.tp
        if comm.world_size(self.ep) > 1 and self.expt_dp is None:
            raise ValueError("TrainGroups with an expert-parallel group needs expt_dp too")
        twins = {"expt_tp": self.tp, "expt_dp": self.dp_cp, "tp_ep_pp": self.mp}
        for name, twin in twins.items():
            if getattr(self, name) is None:
                setattr(self, name, twin)

    @classmethod
    def from_parallel_state(cls) -> TrainGroups:
        """The groups of the current layout (a rank in no embedding group, a middle pipeline
        stage, gets ``embedding=None``)."""
        state = _state()
        return cls(
            tp=state.groups["tp"],
            pp=state.groups["pp"],
            dp=state.groups["dp"],
            embedding=state.groups.get("embedding"),
            mp=state.groups["mp"],
            cp=state.groups.get("cp"),
            dp_cp=state.groups.get("dp_cp"),  # without cp: dp (__post_init__)
            pp_channels=state.channels,
            tp_cp=state.groups.get("tp_cp", state.groups["tp"]),
            ep=state.groups.get("ep"),
            expt_tp=state.groups["expt_tp"],
            expt_dp=state.groups["expt_dp"],
            tp_ep_pp=state.groups["tp_ep_pp"],
        )


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError(
            "model parallel groups are not initialized; call initialize_model_parallel()"
        )
    return _STATE


def get_grid() -> ProcessGrid:
    return _state().grid


def get_group(name: str) -> dist.ProcessGroup:
    """This rank's group of kind ``name`` (see :meth:`ProcessGrid.groups`)."""
    state = _state()
    if name not in state.groups:
        raise RuntimeError(f"rank {state.rank} is in no {name!r} group")
    return state.groups[name]


def get_group_ranks(name: str) -> list[int]:
    """Global ranks of this rank's group of kind ``name``."""
    get_group(name)
    return list(_state().ranks[name])


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return get_group("tp")


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return get_group("pp")


def get_data_parallel_group() -> dist.ProcessGroup:
    return get_group("dp")


def get_context_parallel_group() -> dist.ProcessGroup | None:
    """This rank's context-parallel group; None without context parallelism."""
    return _state().groups.get("cp")


def get_context_parallel_world_size() -> int:
    return get_grid().cp


def get_context_parallel_rank() -> int:
    state = _state()
    return state.grid.coords(state.rank)["cp"]


def get_data_parallel_group_with_cp() -> dist.ProcessGroup:
    """The ranks that hold the same weights (dp × cp): gradients are reduced over it."""
    state = _state()
    return state.groups.get("dp_cp", state.groups["dp"])


def get_model_parallel_group() -> dist.ProcessGroup:
    return get_group("mp")


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """The ranks that hold this rank's expert layers' other experts; None when ep is 1."""
    return _state().groups.get("ep")


def get_expert_model_parallel_world_size() -> int:
    return get_grid().ep


def get_expert_model_parallel_rank() -> int:
    state = _state()
    return state.grid.expert_coords(state.rank)["ep"]


def get_expert_tensor_parallel_group() -> dist.ProcessGroup:
    """The ranks that split each of this rank's experts' matrices."""
    return get_group("expt_tp")


def get_expert_tensor_parallel_world_size() -> int:
    return get_grid().etp


def get_expert_tensor_parallel_rank() -> int:
    state = _state()
    return state.grid.expert_coords(state.rank)["expt_tp"]


def get_expert_tensor_and_model_parallel_group() -> dist.ProcessGroup:
    """expt_tp × ep: every rank a token of this rank's expert layers may be sent to."""
    return get_group("tp_ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    grid = get_grid()
    return grid.etp * grid.ep


def get_expert_tensor_and_model_parallel_rank() -> int:
    return get_group_ranks("tp_ep").index(_state().rank)


def get_expert_tensor_model_pipeline_parallel_group() -> dist.ProcessGroup:
    """tp_ep × pp: the ranks that together hold one copy of every expert of the model."""
    return get_group("tp_ep_pp")


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """The ranks that hold the same experts: expert gradients are reduced over it."""
    return get_group("expt_dp")


def get_expert_data_parallel_world_size() -> int:
    return get_grid().edp


def get_expert_data_parallel_rank() -> int:
    state = _state()
    return state.grid.expert_coords(state.rank)["expt_dp"]


def get_embedding_group() -> dist.ProcessGroup:
    return get_group("embedding")


def get_position_embedding_group() -> dist.ProcessGroup:
    return get_group("position_embedding")


def get_tensor_model_parallel_world_size() -> int:
    return get_grid().tp


def get_pipeline_model_parallel_world_size() -> int:
    return get_grid().pp


def get_data_parallel_world_size() -> int:
    return get_grid().dp


def get_tensor_model_parallel_rank() -> int:
    state = _state()
    return state.grid.coords(state.rank)["tp"]


def get_pipeline_model_parallel_rank() -> int:
    state = _state()
    return state.grid.coords(state.rank)["pp"]


def get_data_parallel_rank() -> int:
    state = _state()
    return state.grid.coords(state.rank)["dp"]


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's tp group (broadcast source)."""
    return get_group_ranks("tp")[0]


def get_pipeline_model_parallel_next_rank() -> int:
    state = _state()
    return state.grid.next_pipeline_rank(state.rank)


def get_pipeline_model_parallel_prev_rank() -> int:
    state = _state()
    return state.grid.prev_pipeline_rank(state.rank)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return get_grid().vpp


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _state().virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """Select the model chunk the first/last-stage tests refer to."""
    state = _state()
    vpp = state.grid.vpp
    if vpp is None or not 0 <= rank < vpp:
        raise ValueError(f"virtual pipeline rank {rank} is outside [0, {vpp or 1})")
    state.virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first pipeline stage (and, with virtual stages, its first chunk)."""
    state = _state()
    if not ignore_virtual and state.virtual_pipeline_rank not in (None, 0):
        return False
    return state.grid.is_first_stage(state.rank)


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last pipeline stage (and, with virtual stages, its last chunk)."""
    state = _state()
    vpp = state.grid.vpp
    if not ignore_virtual and vpp is not None and state.virtual_pipeline_rank != vpp - 1:
        return False
    return state.grid.is_last_stage(state.rank)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Print the rank layout of a TP × CP × DP × PP grid."
    )
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1, dest="tp")
    parser.add_argument("--cp", "--context-parallel-size", type=int, default=1, dest="cp")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1, dest="pp")
    parser.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", type=int, dest="vpp")
    parser.add_argument("--ep", "--expert-model-parallel-size", type=int, default=1, dest="ep")
    parser.add_argument("--etp", "--expert-tensor-parallel-size", type=int, dest="etp")
    parser.add_argument("--order", default="tp-cp-dp-pp")
    args = parser.parse_args(argv)
    try:
        grid = ProcessGrid(
            args.world_size,
            args.tp,
            args.pp,
            args.vpp,
            args.order,
            context_parallel_size=args.cp,
            expert_model_parallel_size=args.ep,
            expert_tensor_parallel_size=args.etp,
        )
    except ValueError as err:
        parser.error(str(err))
    print(grid.describe())


if __name__ == "__main__":
    main()
