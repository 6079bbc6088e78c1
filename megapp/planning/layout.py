"""A parallel layout as a planner enumerates it, and the ``pretrain_gpt.py`` flags that run it.

A :class:`Layout` names one point of the space a researcher ablates: tensor, pipeline and
data-parallel sizes, chunks per pipeline rank, micro-batch size, schedule, sequence
parallelism, recompute and ZeRO stage. :func:`pretrain_config` turns a layout plus the
model's flags into the checked :class:`~megapp.training.config.PretrainConfig` that
``pretrain_gpt.py`` would build from the same flags, so whatever the planner predicts is
what the printed command runs, and a layout ``pretrain_gpt.py`` refuses is refused here
with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megapp.training.config import PretrainConfig

RECOMPUTE = (None, "selective", "full")
"""Recompute settings a layout takes: none, selective (attention's core), full (every
layer's input kept, the layer rerun in backward: Megatron's uniform method, one layer per
group)."""

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
    default (1F1B, interleaved with several chunks)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    schedule: str | None = None
    sequence_parallel: bool = False
    recompute: str | None = None
    zero_stage: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        """A short label, e.g. ``tp2.pp2.dp2.v1.mb1.1f1b.sp.selective.z1``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"v{self.vpp}"]
        parts += [f"mb{self.micro_batch_size}", self.schedule or "default"]
        parts += ["sp"] if self.sequence_parallel else []
        parts += [self.recompute or "norecompute", f"z{self.zero_stage}"]
        return ".".join(parts)

    def flags(self, num_layers: int) -> list[str]:
        """The ``pretrain_gpt.py`` flags of this layout for a model of ``num_layers``
        layers (the world size is torchrun's ``--nproc-per-node`` × nodes)."""
        out = [
            "--tensor-model-parallel-size",
            str(self.tp),
            "--pipeline-model-parallel-size",
            str(self.pp),
            "--micro-batch-size",
            str(self.micro_batch_size),
        ]
        if self.vpp > 1:
            per_stage = num_layers // (self.pp * self.vpp)
            if per_stage * self.pp * self.vpp != num_layers:
                raise ValueError(
                    f"{num_layers} layers do not split into {self.pp} pipeline ranks × "
                    f"{self.vpp} chunks"
                )
            out += ["--num-layers-per-virtual-pipeline-stage", str(per_stage)]
        if self.schedule == PIPEDREAM_VSYNC:
            out += ["--pipeline-schedule", "pipedream", "--vertical-sync"]
        elif self.schedule is not None:
            out += ["--pipeline-schedule", self.schedule]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
            out += ["--recompute-num-layers", "1"]
        if self.zero_stage:
            out += ["--zero-stage", str(self.zero_stage)]
        return out


def pretrain_config(
    layout: Layout, model_flags: Sequence[str], global_batch_size: int
) -> PretrainConfig:
    """The checked config ``pretrain_gpt.py`` builds for ``model_flags`` (``--num-layers``,
    ``--hidden-size``, ``--seq-length``, ...) under ``layout`` and ``global_batch_size``;
    raises :class:`~megapp.training.flag_groups.ArgumentsError` where it would refuse."""
    from megapp.training.arguments import config_from_flags

    num_layers = _num_layers(model_flags)
    argv = [*model_flags, *layout.flags(num_layers)]
    argv += ["--global-batch-size", str(global_batch_size)]
    for flag, value in _RUN_DEFAULTS:  # required by the parser, no bearing on the layout
        if not any(f == flag or f.startswith(flag + "=") for f in model_flags):
            argv += [flag, value]
    if not any(f.startswith(("--data-path", "--use-default-corpus")) for f in model_flags):
        argv.append("--use-default-corpus")
    return config_from_flags(argv, world_size=layout.world_size)


_RUN_DEFAULTS = (("--lr", "1e-4"), ("--train-iters", "1"))


def _num_layers(model_flags: Sequence[str]) -> int:
    flags = list(model_flags)
    for i, flag in enumerate(flags):
        if flag == "--num-layers" and i + 1 < len(flags):
            return int(flags[i + 1])
        if flag.startswith("--num-layers="):
            return int(flag.split("=", 1)[1])
    raise ValueError("the model's flags must give --num-layers")
