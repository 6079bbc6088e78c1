"""A parallel layout as a planner enumerates it, and the ``pretrain_gpt.py`` flags that run it.

A :class:`Layout` names one point of the space a researcher ablates: tensor, context,
pipeline and data-parallel sizes (with the context-parallel ranks' communication), expert
parallelism for mixture-of-experts models, chunks
per pipeline rank, micro-batch size, schedule, sequence parallelism, recompute and ZeRO
stage. :func:`pretrain_config` turns a layout plus the
model's flags into the checked :class:`~megapp.training.config.PretrainConfig` that
``pretrain_gpt.py`` would build from the same flags, so whatever the planner predicts is
what the printed command runs, and a layout ``pretrain_gpt.py`` refuses is refused here
with the same message. The model's flags are parsed once; a layout is applied to the
typed groups (:func:`apply_layout`), and :meth:`Layout.flags` prints the same settings as
``pretrain_gpt.py`` flags.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megapp.context_parallel.attention import COMM_TYPES
from megapp.training.config import GROUPS, PretrainConfig
from megapp.training.flag_groups import flag_name

RECOMPUTE = (None, "selective", "full")
"""Recompute settings a layout takes: none, selective (attention's core), full (every
layer's input kept, the layer rerun in backward: Megatron's uniform method, one layer per
group)."""

CP_COMM_TYPES = tuple(COMM_TYPES)
"""How the context-parallel ranks reach each other's keys and values (``--cp-comm-type``):
a ring, an all-gather, all-to-alls (docs/context_parallel.md)."""

PIPEDREAM_VSYNC = "pipedream-vsync"
"""The schedule of a layout that runs ``--pipeline-schedule pipedream --vertical-sync``
(every stage runs a microbatch on the weights version the first stage used); the name the
built schedule carries."""


@dataclass(frozen=True)
class Layout:
    """One parallel layout. ``vpp``: model chunks per pipeline rank (2 for the V-shaped
    schedules, >= 2 for interleaving). ``schedule``: a name of
    :data:`~megapp.pipeline_parallel.catalog.SCHEDULES` (flushed) or
    :data:`~megapp.pipeline_parallel.catalog.ASYNC_SCHEDULES` (PipeDream, PipeDream-2BW),
    :data:`PIPEDREAM_VSYNC` for PipeDream with vertical sync, or None for Megatron's
    default (1F1B, interleaved with several chunks). ``cp``: context-parallel ranks, which
    split every sequence; ``cp_comm_type``: one of :data:`CP_COMM_TYPES` (it changes
    nothing while cp is 1). ``ep``: ranks that split the experts of a mixture-of-experts
    layer; ``etp``: ranks that split each expert's matrices (None: tp); both need a model
    with ``--num-experts`` beyond their defaults. ``embedding_in_split``,
    ``loss_in_split``: the embedding, the loss count as a layer where the layers split over
    the virtual stages (``--account-for-embedding/loss-in-pipeline-split``: the first, the
    last virtual stage holds one transformer layer fewer). ``tp_comm_overlap``: with
    sequence parallelism, each linear layer's collective runs against its matmul
    (``--tp-comm-overlap``)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    schedule: str | None = None
    sequence_parallel: bool = False
    recompute: str | None = None
    zero_stage: int = 0
    cp: int = 1
    cp_comm_type: str = "p2p"
    ep: int = 1
    etp: int | None = None
    embedding_in_split: bool = False
    loss_in_split: bool = False
    tp_comm_overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "micro_batch_size", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap overlaps sequence parallelism's collectives")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}"
            )
        if self.etp is not None and self.etp < 1:
            raise ValueError(f"etp must be >= 1 or None, got {self.etp}")

    @property
    def expert_tp(self) -> int:
        """Ranks that split each expert's matrices: ``etp``, or tp when it is None."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Copies of each expert (the ranks that reduce its gradients): world / (etp·ep·pp)."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def counted(self) -> int:
        """Layers the pipeline split counts besides the transformer layers (0, 1 or 2)."""
        return self.embedding_in_split + self.loss_in_split

    @property
    def name(self) -> str:
        """A short label, e.g. ``tp2.pp2.dp2.v1.mb1.1f1b.sp.selective.z1``; with context
        parallelism its size and communication follow tp: ``tp2.cp4-p2p.pp2...``; with
        expert parallelism ep (and etp where it is not tp) follows them: ``tp2.ep8.etp1...``;
        with the embedding (e) and the loss (l) counted in the split, ``v8+el``; with
        ``--tp-comm-overlap``, ``sp.tpo``."""
        parts = [f"tp{self.tp}"]
        parts += [f"cp{self.cp}-{self.cp_comm_type}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp is not None else []
        split = "e" * self.embedding_in_split + "l" * self.loss_in_split
        parts += [f"pp{self.pp}", f"dp{self.dp}", f"v{self.vpp}" + (f"+{split}" if split else "")]
        parts += [f"mb{self.micro_batch_size}", self.schedule or "default"]
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["tpo"] if self.tp_comm_overlap else []
        parts += [self.recompute or "norecompute", f"z{self.zero_stage}"]
        return ".".join(parts)

    def settings(self, num_layers: int) -> list[tuple[str, str, Any]]:
        """What this layout sets in a :class:`~megapp.training.config.PretrainConfig` for
        a model of ``num_layers`` layers: ``(group, field, value)`` in flag order, and
        nothing where it keeps the model's own setting (the world size is torchrun's)."""
        out: list[tuple[str, str, Any]] = [
            ("parallel", "tensor_model_parallel_size", self.tp),
            ("parallel", "pipeline_model_parallel_size", self.pp),
            ("training", "micro_batch_size", self.micro_batch_size),
        ]
        if self.cp > 1:
            out.append(("parallel", "context_parallel_size", self.cp))
            out.append(("parallel", "cp_comm_type", self.cp_comm_type))
        if self.ep > 1:
            out.append(("parallel", "expert_model_parallel_size", self.ep))
        if self.etp is not None:
            out.append(("parallel", "expert_tensor_parallel_size", self.etp))
        if self.embedding_in_split:
            out.append(("parallel", "account_for_embedding_in_pipeline_split", True))
        if self.loss_in_split:
            out.append(("parallel", "account_for_loss_in_pipeline_split", True))
        if self.vpp > 1:
            counted = num_layers + self.counted
            per_stage = counted // (self.pp * self.vpp)
            if per_stage * self.pp * self.vpp != counted:
                raise ValueError(
                    f"{num_layers} layers{f' + {self.counted}' if self.counted else ''} do not "
                    f"split into {self.pp} pipeline ranks × {self.vpp} chunks"
                )
            out.append(("parallel", "num_layers_per_virtual_pipeline_stage", per_stage))
        if self.schedule == PIPEDREAM_VSYNC:
            out.append(("parallel", "pipeline_schedule", "pipedream"))
            out.append(("parallel", "vertical_sync", True))
        elif self.schedule is not None:
            out.append(("parallel", "pipeline_schedule", self.schedule))
        if self.sequence_parallel:
            out.append(("parallel", "sequence_parallel", True))
        if self.tp_comm_overlap:
            out.append(("parallel", "tp_comm_overlap", True))
        if self.recompute == "selective":
            out.append(("model", "recompute_granularity", "selective"))
        elif self.recompute == "full":
            out.append(("model", "recompute_granularity", "full"))
            out.append(("model", "recompute_method", "uniform"))
            out.append(("model", "recompute_num_layers", 1))
        if self.zero_stage:
            out.append(("parallel", "zero_stage", self.zero_stage))
        return out

    def flags(self, num_layers: int) -> list[str]:
        """The ``pretrain_gpt.py`` flags of this layout for a model of ``num_layers``
        layers: :meth:`settings` as flags."""
        out = []
        for group, name, value in self.settings(num_layers):
            flag = flag_name(_FIELDS[group][name])
            out += [flag] if value is True else [flag, str(value)]
        return out


def apply_layout(
    base: PretrainConfig | dict[str, Any], layout: Layout, global_batch_size: int
) -> PretrainConfig:
    """The checked config of ``base`` (a config, or its groups by name) under ``layout``
    and ``global_batch_size``: the groups with the layout's :meth:`~Layout.settings`
    replaced, then checked as :class:`~megapp.training.config.PretrainConfig` checks
    every config; raises :class:`~megapp.training.flag_groups.ArgumentsError` where
    ``pretrain_gpt.py`` would refuse the same flags."""
    groups = base if isinstance(base, dict) else {name: getattr(base, name) for name in GROUPS}
    num_layers = groups["model"].num_layers
    changes: dict[str, dict[str, Any]] = {"training": {"global_batch_size": global_batch_size}}
    for group, name, value in layout.settings(num_layers):
        changes.setdefault(group, {})[name] = value
    groups = dict(groups)
    for name, fields in changes.items():
        groups[name] = dataclasses.replace(groups[name], **fields)
    return PretrainConfig(**groups, world_size=layout.world_size)


def pretrain_config(
    layout: Layout, model_flags: Sequence[str], global_batch_size: int
) -> PretrainConfig:
    """The checked config ``pretrain_gpt.py`` builds for ``model_flags`` (``--num-layers``,
    ``--hidden-size``, ``--seq-length``, ...) under ``layout`` and ``global_batch_size``;
    raises :class:`~megapp.training.flag_groups.ArgumentsError` where it would refuse."""
    return apply_layout(_model_groups(tuple(model_flags)), layout, global_batch_size)


@functools.lru_cache(maxsize=32)
def _model_groups(model_flags: tuple[str, ...]) -> dict[str, Any]:
    """The config groups ``pretrain_gpt.py`` parses from ``model_flags`` (each checked on
    its own) with what it needs besides: a learning rate, an iteration count and, without
    data flags, the built-in corpus. Parsed once per model; treat the groups as frozen."""
    from megapp.training.arguments import build_parser

    argv = list(model_flags)
    for flag, value in _RUN_DEFAULTS:
        if not any(f == flag or f.startswith(flag + "=") for f in model_flags):
            argv += [flag, value]
    if not any(f.startswith(("--data-path", "--use-default-corpus")) for f in model_flags):
        argv.append("--use-default-corpus")
    return PretrainConfig.groups_from_flags(vars(build_parser().parse_args(argv)))


# required by the parser, no bearing on the layout (which sets the micro-batch size itself)
_RUN_DEFAULTS = (("--lr", "1e-4"), ("--train-iters", "1"), ("--micro-batch-size", "1"))
_FIELDS = {name: {f.name: f for f in dataclasses.fields(group)} for name, group in GROUPS.items()}
