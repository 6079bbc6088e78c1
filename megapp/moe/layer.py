"""The mixture-of-experts layer: router, dispatch, experts, combine, shared expert.

It stands where the dense :class:`~megapp.transformer.layer.ParallelMLP` stands, with the
same interface: input ``[s, b, h]``, returns ``(output [s, b, h], None)`` (the experts' biases
are added inside, so there is no bias left to fuse). Per token::

    out = Σ_{chosen e} p_e · expert_e(x)  (+ shared(x), gated or not)

Under expert parallelism (``ep_group`` of ``config.expert_model_parallel_size`` ranks) each
rank holds ``E / ep`` experts and routes its own tokens; the pairs travel to the experts'
ranks and back (:mod:`~megapp.moe.dispatch`). With expert tensor parallelism
(``etp_group``) each of those experts is split over the group's ranks, which hold different
tokens (:mod:`~megapp.moe.experts`). The router and the shared expert are
replicated like any dense weight. After a training forward, :attr:`MoELayer.losses` holds
this layer's auxiliary losses without their coefficients, and :func:`layer_losses` collects
them from every MoE layer of a model.
"""

from __future__ import annotations

import torch
from torch import nn

from megapp import comm
from megapp.comm import Group
from megapp.moe.config import MoEConfig
from megapp.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from megapp.moe.experts import GroupedExperts
from megapp.moe.hierarchical import HierarchicalDispatcher
from megapp.moe.router import Router
from megapp.moe.shared_experts import SharedExpert

__all__ = ["MoELayer", "layer_losses"]


class MoELayer(nn.Module):
    """A mixture-of-experts MLP over ``[s, b, h]`` tokens.

    Args:
        config: the layer's :class:`~megapp.moe.config.MoEConfig`.
        ep_group: the expert-parallel group (``None``: every expert on this rank).
        etp_group: the expert tensor-parallel group (``None``: whole experts).
        sequence_group: the ranks that hold the other parts of this rank's sequences
            (sequence or context parallelism; Megatron-Core's tp × cp group), over which the
            load-balancing loss counts tokens. ``None``: each rank's sequences are whole.
        layer_number: the layer's number in the model, for reporting its losses.

    ``aux_loss_scale``: the gradient the auxiliary losses receive in backward (1 by
    default; a training loop that scales its loss, or averages over microbatches, sets the
    same factor here).
    """

    def __init__(
        self,
        config: MoEConfig,
        ep_group: Group = None,
        etp_group: Group = None,
        sequence_group: Group = None,
        layer_number: int = 1,
    ):
        super().__init__()
        ep = comm.world_size(ep_group)
        if ep != config.expert_model_parallel_size:
            raise ValueError(
                f"config.expert_model_parallel_size is {config.expert_model_parallel_size} but "
                f"the expert-parallel group has {ep} ranks"
            )
        self.config, self.layer_number = config, layer_number
        self.ep_group, self.sequence_group = ep_group, sequence_group
        self.router = Router(config)
        self.experts = GroupedExperts(config, comm.rank(ep_group), etp_group)
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpert(config)
        else:
            self.shared_expert = None
        kind, experts = config.moe_token_dispatcher_type, config.num_moe_experts
        if kind == "hierarchical":
            node = config.moe_dispatch_node_size
            self.dispatcher = HierarchicalDispatcher(experts, ep_group, node)
        else:
            dispatcher = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
            self.dispatcher = dispatcher[kind](experts, ep_group)
        self.aux_loss_scale = 1.0
        self.losses: dict[str, torch.Tensor] = {}
        self.reset_loss_sums()

    @property
    def recompute_saved_inputs(self) -> bool:
        """Whether the experts rebuild their activations' outputs in backward (the layer
        turns it off where the whole layer is recomputed)."""
        return self.experts.recompute_saved_inputs

    @recompute_saved_inputs.setter
    def recompute_saved_inputs(self, value: bool) -> None:
        self.experts.recompute_saved_inputs = value
        if self.shared_expert is not None:
            self.shared_expert.recompute_saved_inputs = value

    def reset_loss_sums(self) -> None:
        """Start summing the losses of the training forwards again (a training step's
        microbatches); :meth:`mean_losses` is their mean."""
        self.loss_sums: dict[str, torch.Tensor] = {}
        self.loss_forwards = 0

    def mean_losses(self) -> dict[str, float]:
        """The mean of each loss over the training forwards since :meth:`reset_loss_sums`
        (a recomputed forward counts again, with the same values)."""
        n = self.loss_forwards
        return {name: float(total) / n for name, total in self.loss_sums.items()} if n else {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``x`` ``[s, b, h]`` -> ``(out [s, b, h], None)``."""
        h = self.config.hidden_size
        if x.dim() != 3 or x.shape[-1] != h:
            raise ValueError(f"MoELayer takes [s, b, {h}] tokens, got {tuple(x.shape)}")
        s, b, _ = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, b, self.sequence_group, self.aux_loss_scale)
        self.losses = routing.losses
        for name, value in routing.losses.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value.detach()
        self.loss_forwards += bool(routing.losses)
        dispatched = self.dispatcher.dispatch(tokens, routing)
        # the experts' output is combine's alone, which frees each buffer once it is used
        out = self.dispatcher.combine(
            self.experts(dispatched.rows, dispatched.tokens_per_expert), dispatched
        )
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(s, b, h), None


def layer_losses(model: nn.Module) -> dict[str, dict[int, float]]:
    """Every MoE layer's auxiliary losses of its last training forward, without
    coefficients: ``{"load_balancing_loss": {layer_number: value}, "z_loss": {...}}``."""
    report: dict[str, dict[int, float]] = {}
    for module in model.modules():
        if isinstance(module, MoELayer):
            for name, value in module.losses.items():
                report.setdefault(name, {})[module.layer_number] = float(value)
    return report
