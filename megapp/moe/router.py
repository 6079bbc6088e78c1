"""The router: a linear layer to one logit per expert, and the choice of ``k`` experts.

Score functions (``moe_router_score_function``, ``moe_router_pre_softmax``,
``moe_router_norm_topk_prob``), for logits ``z`` ``[T, E]``:

- softmax, Megatron-Core's default: the top ``k`` logits, then a softmax over those ``k``;
- softmax with ``pre_softmax``: a softmax over all ``E``, then the top ``k`` probabilities,
  used as they are (Megatron-Core; Qwen2-MoE with ``norm_topk_prob`` off) or divided by their
  sum (``norm_topk_prob``: Mixtral's "softmax, top k, renormalize", equal to the default in
  exact arithmetic);
- sigmoid (DeepSeek-V3): ``σ(z)`` per expert; the top ``k`` of ``σ(z) + bias`` are chosen, where
  ``bias`` is the auxiliary-loss-free balancing bias (zero unless enabled) that never enters
  the weights; the chosen ``σ(z)`` are divided by their sum when ``k > 1``.

The weights are then multiplied by ``moe_router_topk_scaling_factor`` if set, and pairs past
an expert's capacity are dropped (:mod:`~megapp.moe.capacity`). With
``moe_router_force_load_balancing`` (for benchmarks) random normal logits replace the router's
before all of this (:func:`random_logits`). Logits and scores are
computed in float32 (float64 stays float64) whatever the parameters' dtype. The auxiliary
losses (:mod:`~megapp.moe.aux_losses`) are attached while training with gradients on, as
Megatron-Core does: the z-loss to the logits, the load-balancing loss to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megapp import comm
from megapp.comm import Group
from megapp.moe import aux_losses
from megapp.moe.capacity import expert_capacity, kept_pairs
from megapp.moe.config import MoEConfig
from megapp.tensor_parallel.random import get_rng_tracker

__all__ = ["Router", "Routing", "choose_experts", "random_logits", "scores_for_aux_loss"]


@dataclass
class Routing:
    """The router's decision for ``T`` tokens choosing ``k`` of ``E`` experts.

    ``probs`` ``[T, k]``: the weight of each chosen expert in the token's output (0 where the
    pair was dropped); ``experts`` ``[T, k]``: their ids; ``kept`` ``[T, k]`` bool, or None
    when nothing can be dropped; ``logits`` ``[T, E]``; ``losses``: the auxiliary losses of
    this forward without their coefficients (detached, for reporting).
    """

    probs: torch.Tensor
    experts: torch.Tensor
    kept: torch.Tensor | None
    logits: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)


def choose_experts(
    logits: torch.Tensor, config: MoEConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, experts)``, both ``[T, k]``, from logits ``[T, E]`` by the configured score
    function (see the module docstring); no capacity."""
    k = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            probs, experts = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
            if config.moe_router_norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
        else:
            top, experts = torch.topk(logits, k, dim=-1)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        chooser = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
        experts = torch.topk(chooser, k, dim=-1).indices
        probs = scores.gather(1, experts)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor is not None:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs, experts


class _RandomLogits(torch.autograd.Function):
    """Random normal values in place of the logits; their gradient passes through unchanged
    (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork():
            return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def random_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits``' shape filled from the standard normal, drawn from the tracker's
    tensor-parallel stream (different on every tensor-parallel rank and pipeline stage, and
    replayed by a recomputed forward); backward hands the gradient to ``logits`` as it is.
    Every expert is then chosen equally often in expectation: what benchmarks of balanced
    experts route by (Megatron-Core's ``--moe-router-force-load-balancing``)."""
    return _RandomLogits.apply(logits)


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Scores over all experts ``[T, E]`` that the load-balancing loss averages: the softmax,
    or the sigmoid scores divided by their sum."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


class Router(nn.Module):
    """Top-k router over ``config.num_moe_experts`` experts.

    ``weight`` ``[E, h]`` (built whole from the default generator, the same under any
    layout). The buffer ``local_tokens_per_expert`` ``[E]`` (float32, not saved) counts the
    pairs routed by training forwards since the last :meth:`take_tokens_per_expert` (the
    expert bias and the logged expert load read it); with ``moe_router_enable_expert_bias``
    it also keeps ``expert_bias`` ``[E]`` (float32, saved).
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        weight = torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32)
        nn.init.normal_(weight, mean=0.0, std=config.init_method_std)
        self.weight = nn.Parameter(weight.to(config.params_dtype))
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(config.num_moe_experts), persistent=False
        )
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts))
        else:
            self.expert_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` logits of tokens ``x`` ``[T, h]``, in float32 or wider."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def forward(
        self,
        x: torch.Tensor,
        batch: int = 1,
        sequence_group: Group = None,
        loss_scale: float = 1.0,
    ) -> Routing:
        """Route tokens ``x`` ``[T, h]`` (an ``[s, b, h]`` input flattened; ``batch`` = ``b``,
        which the sequence-level loss needs). ``sequence_group``: the ranks holding the other
        parts of the same sequences (Megatron-Core's tp × cp group), over which the losses
        count tokens. ``loss_scale``: the gradient the auxiliary losses receive."""
        config = self.config
        logits = self.logits(x)
        if config.moe_router_force_load_balancing:
            logits = random_logits(logits)
        losses: dict[str, torch.Tensor] = {}
        with_losses = self.training and torch.is_grad_enabled()
        if with_losses and config.moe_z_loss_coeff:
            # each rank averages over its share of the tokens: divide as Megatron-Core does
            coeff = config.moe_z_loss_coeff / comm.world_size(sequence_group)
            loss = aux_losses.z_loss(logits, coeff)
            logits = aux_losses.attach(logits, loss, loss_scale)
            losses["z_loss"] = loss.detach() / coeff
        probs, experts = choose_experts(logits, config, self.expert_bias)
        kept = None
        if config.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(
                x.shape[0],
                config.num_moe_experts,
                config.moe_router_topk,
                config.moe_expert_capacity_factor,
            )
            kept = kept_pairs(
                probs, experts, config.num_moe_experts, capacity, config.moe_token_drop_policy
            )
            probs = probs * kept
        if with_losses and config.moe_aux_loss_coeff > 0:
            probs = self._attach_balancing_loss(
                probs, logits, batch, sequence_group, loss_scale, losses
            )
        if with_losses:
            routed = experts if kept is None else experts[kept]
            self.local_tokens_per_expert += torch.bincount(
                routed.reshape(-1), minlength=config.num_moe_experts
            ).to(self.local_tokens_per_expert.dtype)
        return Routing(probs, experts, kept, logits, losses)

    def _attach_balancing_loss(
        self,
        probs: torch.Tensor,
        logits: torch.Tensor,
        batch: int,
        group: Group,
        scale: float,
        losses: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        config = self.config
        kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
        if kind == "none":
            return probs
        k = config.moe_router_topk
        scores = scores_for_aux_loss(logits, config.moe_router_score_function)
        # the top k of the scores, before any expert bias or drop, as Megatron-Core counts
        top = torch.topk(scores, k, dim=-1).indices
        chosen = torch.zeros_like(scores).scatter(1, top, 1.0)
        if kind == "aux_loss":
            loss = aux_losses.load_balancing_loss(scores, chosen, k, coeff, group)
            losses["load_balancing_loss"] = loss.detach() / coeff
        else:
            loss = aux_losses.sequence_load_balancing_loss(scores, chosen, batch, k, coeff, group)
            losses["seq_load_balancing_loss"] = loss.detach() / coeff
        return aux_losses.attach(probs, loss, scale)

    @torch.no_grad()
    def update_expert_bias(self, group: Group = None) -> None:
        """Move ``expert_bias`` by the pairs routed since the last call, summed over
        ``group`` (the ranks that route different tokens to the same experts, e.g. data
        parallel), then start counting again. Every rank of ``group`` must call it."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs moe_router_enable_expert_bias")
        counts = self.take_tokens_per_expert()
        if comm.world_size(group) > 1:
            comm.all_reduce(counts, group)
        self.step_expert_bias(counts)

    @torch.no_grad()
    def take_tokens_per_expert(self) -> torch.Tensor:
        """The pairs routed to each expert ``[E]`` since the last call (a copy), and start
        counting again."""
        counts = self.local_tokens_per_expert.clone()
        self.local_tokens_per_expert.zero_()
        return counts

    @torch.no_grad()
    def step_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Move ``expert_bias`` by ``tokens_per_expert`` ``[E]`` (this router's counts summed
        already over every rank that routes tokens with it)."""
        rate = self.config.moe_router_bias_update_rate
        update = aux_losses.expert_bias_update(self.expert_bias, tokens_per_expert, rate)
        self.expert_bias.copy_(update)
