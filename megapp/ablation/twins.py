"""The dense twin of a mixture-of-experts model: the same model with dense MLPs as wide as
the expert work each token does, so that the sweep can say what its experts cost.

A token in a mixture-of-experts MLP runs through ``k`` experts of width ``E`` (top-k
routing, ``--moe-router-topk``, ``--moe-ffn-hidden-size``) and the shared expert of width
``S`` where there is one: an active width ``A = k·E + S``. The twin drops every expert
flag and sets ``--ffn-hidden-size``. With every layer a mixture-of-experts layer
(``--moe-layer-freq 1``), or where the model's dense layers are already ``A`` wide, the
twin's MLPs are ``A`` wide and each layer does the work of its counterpart. Otherwise
``pretrain_gpt.py`` cannot give the two kinds of layer different widths (one
``--ffn-hidden-size`` serves every dense MLP), and the twin's MLPs all take the mean active
width over the layers: the same MLP work per token in all, not layer by layer. Either way
the router's small product (``h × experts`` per token) has no counterpart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from megapp.training.config import GROUPS
from megapp.training.flag_groups import ModelArgs, flag_name

EXPERT_FIELDS = ("num_experts", "expert_model_parallel_size", "expert_tensor_parallel_size")
"""The fields that give a model experts or split them, besides every ``moe_*`` field."""


def expert_flags() -> dict[str, bool]:
    """Every ``pretrain_gpt.py`` flag about experts, and whether it takes a value (a
    switch such as ``--moe-shared-expert-gate`` takes none)."""
    out = {}
    for group in GROUPS.values():
        for f in fields(group):
            if f.name in EXPERT_FIELDS or f.name.startswith("moe_"):
                out[flag_name(f)] = not isinstance(f.default, bool)
    return out


def without_flags(flags: Sequence[str], drop: dict[str, bool]) -> tuple[str, ...]:
    """``flags`` without those named in ``drop`` (``--flag value``, ``--flag=value`` or a
    switch, as ``drop[flag]`` says whether it takes a value)."""
    out: list[str] = []
    skip = False
    for flag in flags:
        if skip:
            skip = False
        elif flag in drop:
            skip = drop[flag]
        elif flag.split("=", 1)[0] not in drop:
            out.append(flag)
    return tuple(out)


@dataclass(frozen=True)
class DenseTwin:
    """The dense model of the same active size as a mixture-of-experts model.

    ``num_layers`` layers, ``moe_layers`` of them mixture-of-experts layers, each token
    going through ``topk`` experts of width ``expert_width`` and the shared expert of
    ``shared_width`` (0: none); the other layers' MLPs are ``dense_width`` wide."""

    num_layers: int
    moe_layers: int
    topk: int
    expert_width: int
    shared_width: int
    dense_width: int

    @property
    def active_width(self) -> int:
        """The width of the expert MLP work one token does in a mixture-of-experts layer."""
        return self.topk * self.expert_width + self.shared_width

    @property
    def exact(self) -> bool:
        """Whether every layer of the twin is as wide as its counterpart's active MLP."""
        return self.moe_layers == self.num_layers or self.dense_width == self.active_width

    @property
    def ffn_hidden_size(self) -> int:
        """The twin's MLP width: the active width, or the mean over all layers (rounded)."""
        if self.exact:
            return self.active_width
        dense_layers = self.num_layers - self.moe_layers
        total = self.moe_layers * self.active_width + dense_layers * self.dense_width
        return round(total / self.num_layers)

    def model_flags(self, flags: Sequence[str]) -> tuple[str, ...]:
        """``flags`` (the mixture-of-experts model's) without any expert flag, with the
        twin's ``--ffn-hidden-size``."""
        drop = {**expert_flags(), "--ffn-hidden-size": True}
        return (*without_flags(flags, drop), "--ffn-hidden-size", str(self.ffn_hidden_size))

    def description(self) -> str:
        """What the twin is, in one sentence, with its numbers."""
        shared = f" + the shared expert's {self.shared_width}" if self.shared_width else ""
        active = (
            f"top-{self.topk} × the expert width {self.expert_width}{shared} = {self.active_width}"
        )
        if self.moe_layers == self.num_layers:
            how = f"every MLP {active} wide, the expert work of one token in each layer"
        elif self.exact:
            how = (
                f"its {self.moe_layers} mixture-of-experts MLPs replaced by dense ones {active} "
                f"wide, as wide as its other {self.num_layers - self.moe_layers} layers' MLPs"
            )
        else:
            how = (
                f"every MLP {self.ffn_hidden_size} wide, the mean over its {self.num_layers} "
                f"layers of the {self.moe_layers} mixture-of-experts layers' active width "
                f"({active}) and the dense layers' {self.dense_width}: the same MLP work per "
                "token in all, not layer by layer, as pretrain_gpt.py has one "
                "--ffn-hidden-size for every dense MLP"
            )
        return f"the same model, without experts, with {how}"


def dense_twin(model: ModelArgs) -> DenseTwin:
    """The dense twin of ``model``; ValueError for a model without experts."""
    if model.num_experts is None:
        raise ValueError("a dense model has no dense twin: give --num-experts N")
    return DenseTwin(
        num_layers=model.num_layers,
        moe_layers=len(range(0, model.num_layers, model.moe_layer_freq)),
        topk=model.moe_router_topk,
        expert_width=model.moe_ffn_hidden_size or model.ffn,
        shared_width=model.moe_shared_expert_intermediate_size or 0,
        dense_width=model.ffn,
    )
