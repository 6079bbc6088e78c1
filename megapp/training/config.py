"""``pretrain_gpt.py``'s settings as typed config: one dataclass per group of Megatron's flags
(:mod:`megapp.training.flag_groups`), together in :class:`PretrainConfig`.

The dataclasses are the flags: :func:`~megapp.training.arguments.build_parser` makes one flag
per field (``--field-name``, or the field's own Megatron spelling), with its default and
help. :class:`PretrainConfig` holds one of each group, is built once from the parsed flags
(:meth:`PretrainConfig.from_flags`) and derives the data-parallel size, the microbatches
per iteration, the virtual pipeline size and the parameter dtype.

A rule is checked once, where it lives: a group checks its own flags; the layout, the model
shape, the layer split and the learning-rate schedule are checked by the objects that own
those rules (:class:`~megapp.process_grid.ProcessGrid`,
:class:`~megapp.transformer.TransformerConfig`, :mod:`~megapp.pipeline_parallel.partition`,
the schedule builders, :func:`~megapp.optimizer.lr_scheduler.check_schedule`), whose messages
name their fields; :func:`as_flags` rewrites those names as the flags that set them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from megapp.pipeline_parallel.partition import nearest_multiples
from megapp.pipeline_parallel.schedules import Schedule
from megapp.training.flag_groups import (
    ArgumentsError,
    CheckpointArgs,
    DataArgs,
    LoggingArgs,
    ModelArgs,
    OptimizerArgs,
    PrecisionArgs,
    TrainingArgs,
    flag_name,
)
from megapp.training.parallel_flags import ParallelArgs

GROUPS = {
    "parallel": ParallelArgs,
    "model": ModelArgs,
    "precision": PrecisionArgs,
    "optimizer": OptimizerArgs,
    "training": TrainingArgs,
    "data": DataArgs,
    "checkpoint": CheckpointArgs,
    "logging": LoggingArgs,
}

# Names the rules' owners use for what a flag sets, where the flag says it otherwise.
_OTHER_NAMES = {
    "world_size": "world size",
    "layernorm_epsilon": "--norm-epsilon",
    "max_lr": "--lr",
    "warmup_steps": "--lr-warmup-iters",
    "decay_steps": "--lr-decay-iters",
    "decay_style": "--lr-decay-style",
    "init_lr": "the initial learning rate",
    "activation": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "virtual_pipeline_model_parallel_size": "virtual pipeline size",
    "num_microbatches": "the number of microbatches",
    "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
    "num_moe_experts": "--num-experts",
}
_FLAGS = {
    f.name: flag_name(f) for group in GROUPS.values() for f in dataclasses.fields(group)
} | _OTHER_NAMES
_NAMES = re.compile(r"\b(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")\b")


def as_flags(message: str) -> str:
    """``message`` with every config field name replaced by the flag that sets it."""
    return _NAMES.sub(lambda m: _FLAGS[m.group(1)], message)


@dataclass(frozen=True)
class PretrainConfig:
    """Every setting of a pre-training run, checked together for ``world_size`` ranks.

    Derived once, here: ``data_parallel_size``, ``virtual_pipeline_model_parallel_size``
    (None without interleaving), ``num_microbatches``, the pipeline ``schedule`` and the
    defaults that depend on other flags (global batch = micro batch × dp, LR decay over
    the whole run).
    """

    parallel: ParallelArgs
    model: ModelArgs
    precision: PrecisionArgs
    optimizer: OptimizerArgs
    training: TrainingArgs
    data: DataArgs
    checkpoint: CheckpointArgs
    logging: LoggingArgs
    world_size: int
    data_parallel_size: int = field(init=False)
    virtual_pipeline_model_parallel_size: int | None = field(init=False)
    num_microbatches: int = field(init=False)
    schedule: Schedule = field(init=False)

    @classmethod
    def from_flags(cls, flags: dict[str, Any], world_size: int) -> PretrainConfig:
        """Build and check every group from ``flags`` (field name -> value, e.g.
        ``vars(namespace)``); raises :class:`ArgumentsError` naming the flags to change."""
        return cls(**cls.groups_from_flags(flags), world_size=world_size)

    @staticmethod
    def groups_from_flags(flags: dict[str, Any]) -> dict[str, Any]:
        """Every group built from ``flags`` and checked on its own, by group name (what
        :meth:`from_flags` checks together; a planner replaces a layout's fields in them)."""
        return {
            name: group(**{f.name: flags[f.name] for f in dataclasses.fields(group)})
            for name, group in GROUPS.items()
        }

    def __post_init__(self) -> None:
        try:
            self._derive()
        except ArgumentsError:
            raise
        except ValueError as error:  # a rule's owner, in its own field names
            raise ArgumentsError(as_flags(str(error))) from error

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # derived once, while the frozen config is built

    def _schedule_chunks(self, pp: int, vpp: int | None) -> tuple[str, int | None]:
        """The schedule's name and the model chunks per rank it runs: as the flags ask, or,
        where the flags ask none and the schedule runs only one count (two for a V), that
        count. Refuses a count the schedule cannot run, naming the flag that asked for it."""
        from megapp.pipeline_parallel.catalog import default_schedule, schedule_kind
        from megapp.training.auto_schedule import PROBE

        par, layers = self.parallel, self.model.num_layers
        name = par.pipeline_schedule or default_schedule(vpp or 1)
        if name == "auto":  # the first iteration times zb-h1; the search picks the rest
            name = PROBE
        kind = schedule_kind(name)
        asked = vpp
        if vpp is None and (kind.fixed_chunks or 1) > 1:
            if pp == 1:
                raise ArgumentsError(
                    f"--pipeline-schedule {name} {kind.chunks_text()} over the pipeline's "
                    "ranks: it needs --pipeline-model-parallel-size > 1"
                )
            vpp = kind.fixed_chunks  # the only count it runs: nothing to choose
            even = (par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers)
            if even == (None, None) and not self._counted() and layers % (pp * vpp):
                raise ArgumentsError(
                    f"--pipeline-schedule {name} {kind.chunks_text()}, so --num-layers "
                    f"({layers}) must split into {vpp} × --pipeline-model-parallel-size ({pp}) "
                    f"= {vpp * pp} virtual stages; use {nearest_multiples(layers, vpp * pp)} "
                    "layers, or uneven first and last stages "
                    "(--decoder-first/last-pipeline-num-layers)"
                )
        try:
            kind.check_chunks(vpp or 1)
        except ValueError:
            if asked is None:
                raise ArgumentsError(
                    f"--pipeline-schedule {name} {kind.chunks_text()}; give "
                    "--num-layers-per-virtual-pipeline-stage or "
                    "--num-virtual-stages-per-pipeline-rank"
                ) from None
            if par.num_layers_per_virtual_pipeline_stage is not None:
                flag = (
                    f"--num-layers-per-virtual-pipeline-stage "
                    f"{par.num_layers_per_virtual_pipeline_stage}"
                )
            else:
                flag = f"--num-virtual-stages-per-pipeline-rank {asked}"
            if kind.fixed_chunks is not None and kind.fixed_chunks > 1:
                fix = "leave the flag out: the schedule places its chunks itself"
            elif kind.asynchronous:
                fix = "drop the virtual stages"
            else:
                fix = f"use {default_schedule(asked)} for {asked}, or drop the virtual stages"
            raise ArgumentsError(
                f"--pipeline-schedule {name} {kind.chunks_text()}, but {flag} gives {asked}; {fix}"
            ) from None
        return name, vpp

    def _build_schedule(self, name: str, pp: int, vpp: int | None, gbs: int, mbs: int, dp: int):
        from megapp.pipeline_parallel.catalog import build_schedule, schedule_kind
        from megapp.pipeline_parallel.schedules import MicrobatchCountError

        par, kind = self.parallel, schedule_kind(name)
        if par.vertical_sync and not kind.vertical_sync:
            raise ArgumentsError(
                f"--vertical-sync applies to --pipeline-schedule pipedream, not {name}"
            )
        if kind.asynchronous:
            self._check_asynchronous(name, pp)
        try:
            return build_schedule(
                name,
                pp,
                self.num_microbatches,
                vpp or 1,
                group_size=par.microbatch_group_size_per_virtual_pipeline_stage,
                vertical_sync=par.vertical_sync,
            )
        except MicrobatchCountError as error:
            raise ArgumentsError(
                f"--global-batch-size {gbs} / (--micro-batch-size {mbs} × data-parallel "
                f"size {dp}) gives {self.num_microbatches} microbatches, which the "
                f"{name} schedule cannot run: {as_flags(str(error))}; change the global "
                "batch size or the schedule"
            ) from error
        except ValueError as error:  # not the batch size: say what the schedule refused
            raise ArgumentsError(
                f"the {name} schedule cannot run this layout: {as_flags(str(error))}"
            ) from error

    def _check_asynchronous(self, name: str, pp: int) -> None:
        """What PipeDream and 2BW, whose stages step on their own, cannot run with: the
        optimizer's rule (:func:`~megapp.optimizer.optimizer.check_per_stage_steps`), in
        flag names."""
        from megapp.optimizer.optimizer import check_per_stage_steps

        par = self.parallel
        if self.model.moe_router_enable_expert_bias:
            raise ArgumentsError(
                f"--pipeline-schedule {name} steps each stage on its own, between a "
                "microbatch's forward and backward: drop --moe-router-enable-expert-bias"
            )
        check_per_stage_steps(
            f"--pipeline-schedule {name}",
            pipeline_stages=pp,
            clip_grad=self.optimizer.clip_grad,
            tied_embedding=not self.model.untie_embeddings_and_output_weights,
            sharded=par.zero_stage > 0,
            loss_scaling=self.precision.fp16,
        )

    def _counted(self) -> int:
        """Layers the split counts besides the transformer layers: the embedding and the
        loss where ``--account-for-embedding/loss-in-pipeline-split`` count them."""
        par = self.parallel
        return par.account_for_embedding_in_pipeline_split + par.account_for_loss_in_pipeline_split

    def _derive(self) -> None:
        from megapp.optimizer.lr_scheduler import check_schedule
        from megapp.pipeline_parallel.partition import check_layer_split, virtual_stages
        from megapp.process_grid import ProcessGrid

        par, model, training = self.parallel, self.model, self.training
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        vpp = par.num_virtual_stages_per_pipeline_rank
        if par.num_layers_per_virtual_pipeline_stage is not None:
            lps = par.num_layers_per_virtual_pipeline_stage
            vpp = virtual_stages(model.num_layers, pp, lps, counted=self._counted()) or 1
        name, vpp = self._schedule_chunks(pp, vpp)
        vpp = vpp if vpp != 1 else None  # one chunk per rank: no virtual stages
        cp = par.context_parallel_size
        grid = ProcessGrid(
            self.world_size,
            tp,
            pp,
            vpp,
            context_parallel_size=cp,
            expert_model_parallel_size=par.expert_model_parallel_size,
            expert_tensor_parallel_size=par.expert_tensor_parallel_size,
        )
        self._check_sequence_split(cp, tp)
        self._check_experts()
        self._set("virtual_pipeline_model_parallel_size", vpp)
        self._set("data_parallel_size", grid.dp)
        check_layer_split(
            model.num_layers,
            pp,
            vpp,
            first=par.decoder_first_pipeline_num_layers,
            last=par.decoder_last_pipeline_num_layers,
            embedding=par.account_for_embedding_in_pipeline_split,
            loss=par.account_for_loss_in_pipeline_split,
        )
        # The model's own rules (sizes, heads, widths, recompute, positions, padding); the
        # vocabulary comes from the tokenizer later and no rule but its own depends on it.
        self.gpt_config(vocab_size=1)

        mbs, dp = training.micro_batch_size, grid.dp
        gbs = training.global_batch_size or mbs * dp
        if gbs % (mbs * dp):
            raise ArgumentsError(
                f"--global-batch-size ({gbs}) is not divisible by --micro-batch-size × "
                f"data-parallel size ({mbs} × {dp} = {mbs * dp}); use a global batch of "
                f"{nearest_multiples(gbs, mbs * dp)}, or change the micro batch size or the layout"
            )
        self._set("num_microbatches", gbs // (mbs * dp))
        self._set("training", dataclasses.replace(training, global_batch_size=gbs))
        self._set("schedule", self._build_schedule(name, pp, vpp, gbs, mbs, dp))

        profile = self.logging.profile_iteration
        if profile is not None and profile >= training.train_iters:
            raise ArgumentsError(
                f"--profile-iteration {profile} must be below --train-iters "
                f"({training.train_iters}): the iteration after it measures memory"
            )

        opt = self.optimizer
        decay = opt.lr_decay_iters if opt.lr_decay_iters is not None else training.train_iters
        self._set("optimizer", dataclasses.replace(opt, lr_decay_iters=decay))
        check_schedule(
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            warmup_steps=opt.lr_warmup_iters,
            decay_steps=decay,
            decay_style=opt.lr_decay_style,
        )

    def _check_experts(self) -> None:
        """Expert splits need experts, named by their flags (the model's and the layout's
        own rules are checked by their owners)."""
        par = self.parallel
        ep = par.expert_model_parallel_size
        if self.model.num_experts is None and (
            ep > 1 or par.expert_tensor_parallel_size is not None
        ):
            raise ArgumentsError(
                "--expert-model-parallel-size and --expert-tensor-parallel-size split "
                "experts: give --num-experts N"
            )

    def _check_sequence_split(self, cp: int, tp: int) -> None:
        """Each context-parallel rank holds two equal chunks of every sequence, and sequence
        parallelism splits a rank's tokens over tp on top."""
        from megapp.context_parallel.layout import check_sequence_length

        seq = self.model.seq_length
        check_sequence_length(seq, cp)
        if self.parallel.sequence_parallel and (seq // cp) % tp:
            raise ArgumentsError(
                f"--sequence-parallel splits each context-parallel rank's {seq // cp} tokens "
                f"over --tensor-model-parallel-size ({tp}), which does not divide them; use "
                f"a --seq-length that is a multiple of {cp * tp * (2 if cp > 1 else 1)}"
            )

    def gpt_config(self, vocab_size: int):
        """The model as a :class:`~megapp.models.GPTConfig` for a tokenizer of
        ``vocab_size`` ids: every model or layout flag named after a GPTConfig field passes
        its value as it is, Megatron's otherwise-spelled ones are translated by
        :attr:`ModelArgs.gpt_fields_spelled_otherwise`."""
        from megapp.models import GPTConfig

        names = {f.name for f in dataclasses.fields(GPTConfig)}
        fields = {
            f.name: getattr(group, f.name)
            for group in (self.model, self.parallel)
            for f in dataclasses.fields(group)
            if f.name in names
        }
        fields |= self.model.gpt_fields_spelled_otherwise
        return GPTConfig(
            **fields,
            params_dtype=self.precision.params_dtype,
            vocab_size=vocab_size,
            num_layers_in_first_pipeline_stage=self.parallel.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=self.parallel.decoder_last_pipeline_num_layers,
        )

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain JSON-able data, by group (checkpoints and metrics keep it)."""
        out: dict[str, Any] = {"world_size": self.world_size}
        for name in GROUPS:
            out[name] = dataclasses.asdict(getattr(self, name))
        out["derived"] = {
            "data_parallel_size": self.data_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "num_microbatches": self.num_microbatches,
            "params_dtype": str(self.precision.params_dtype),
        }
        return out


__all__ = ["GROUPS", "PretrainConfig", "as_flags"]
