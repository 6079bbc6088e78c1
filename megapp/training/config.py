"""``pretrain_gpt.py``'s settings as typed config: one dataclass per group of Megatron's flags.

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
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megapp.data.builder import parse_data_path, parse_split
from megapp.data.tokenizers import BYTE_TOKENIZER, TOKENIZER_TYPES
from megapp.pipeline_parallel.partition import nearest_multiples


class ArgumentsError(ValueError):
    """Settings that cannot work together; the message says what to change."""


def arg(default: Any, help: str = "", *, kind: type | None = None, **argparse: Any) -> Any:
    """A config field that is also a flag: its ``default``, ``help`` and flag options
    (``kind``: the value type when ``default`` is None; ``flag``, ``choices``, ``nargs``)."""
    return field(default=default, metadata={"help": help, "kind": kind, **argparse})


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _require_positive(group: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(group, name)
        if value is not None and value < 1:
            raise ArgumentsError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _require(group: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(group, name) is None:
            raise ArgumentsError(f"--{name.replace('_', '-')} is required")


@dataclass(frozen=True)
class ParallelArgs:
    """How the ranks are laid out (Megatron's distributed flags)."""

    tensor_model_parallel_size: int = arg(1, "ranks that split every layer")
    pipeline_model_parallel_size: int = arg(1, "pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, "layers per virtual stage; interleaves the pipeline schedule", kind=int
    )
    sequence_parallel: bool = arg(False, "split activations outside tp regions by sequence")
    use_distributed_optimizer: bool = arg(False, "shard optimizer states over dp (ZeRO-1)")
    ddp_bucket_size: int = arg(40_000_000, "elements per data-parallel gradient bucket")
    distributed_backend: str | None = arg(
        None, "default: nccl when CUDA is available, else gloo", choices=("nccl", "gloo")
    )
    distributed_timeout_minutes: float = arg(
        10.0, "how long a collective waits for a dead or stuck rank before the job fails"
    )

    def __post_init__(self) -> None:
        _require_positive(
            self,
            (
                "tensor_model_parallel_size",
                "pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage",
                "ddp_bucket_size",
            ),
        )
        if not self.distributed_timeout_minutes > 0:
            raise ArgumentsError(
                f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}"
            )


@dataclass(frozen=True)
class ModelArgs:
    """The GPT's shape and behaviour (Megatron's network-size, regularization and recompute
    flags); :meth:`PretrainConfig.gpt_config` turns it into a GPTConfig."""

    num_layers: int | None = arg(None, "transformer layers", kind=int)
    hidden_size: int | None = arg(None, "width of the residual stream", kind=int)
    ffn_hidden_size: int | None = arg(
        None, "default 4 × hidden size (8/3 × hidden size, rounded to 64, with --swiglu)", kind=int
    )
    num_attention_heads: int | None = arg(None, "query heads", kind=int)
    kv_channels: int | None = arg(None, "width of one head; default hidden / heads", kind=int)
    group_query_attention: bool = arg(False, "grouped-query attention (needs the groups)")
    num_query_groups: int | None = arg(
        None, "key/value heads (implies --group-query-attention)", kind=int
    )
    seq_length: int | None = arg(None, "tokens per sample", kind=int)
    max_position_embeddings: int | None = arg(None, "default: --seq-length", kind=int)
    position_embedding_type: str = arg(
        "learned_absolute", "", choices=("learned_absolute", "rope", "none")
    )
    rotary_base: int = arg(10000, "base of the rotary frequencies")
    normalization: str = arg("LayerNorm", "", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "epsilon of the normalization layers")
    swiglu: bool = arg(False, "SwiGLU MLP instead of GeLU")
    disable_bias_linear: bool = arg(False, "no biases in the linear layers")
    untie_embeddings_and_output_weights: bool = arg(False, "a separate output layer")
    hidden_dropout: float = arg(0.1, "dropout before each residual add")
    attention_dropout: float = arg(0.1, "dropout on the attention probabilities")
    attention_backend: str = arg("sdpa", "", choices=("sdpa", "fused_softmax"))
    init_method_std: float = arg(0.02, "std of the normal weight initialization")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this × tp")
    recompute_granularity: str | None = arg(None, "", choices=("full", "selective"))
    recompute_method: str | None = arg(None, "", choices=("uniform", "block"))
    recompute_num_layers: int | None = arg(None, "layers per recomputed group", kind=int)

    def __post_init__(self) -> None:
        _require(self, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
        _require_positive(
            self,
            (
                "num_layers",
                "hidden_size",
                "ffn_hidden_size",
                "num_attention_heads",
                "kv_channels",
                "num_query_groups",
                "seq_length",
                "max_position_embeddings",
                "make_vocab_size_divisible_by",
            ),
        )
        if self.group_query_attention and self.num_query_groups is None:
            raise ArgumentsError(
                "--group-query-attention needs --num-query-groups N (the key/value heads)"
            )
        if self.seq_length > self.positions:
            raise ArgumentsError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.positions}); raise --max-position-embeddings or shorten the sequences"
            )

    @property
    def positions(self) -> int:
        """Longest sequence the learned positions cover (default: the sequence length)."""
        return self.max_position_embeddings or self.seq_length

    @property
    def ffn(self) -> int:
        """The MLP width: given, or 4h (8h/3 rounded down to 64 for SwiGLU, which keeps its
        parameter count near the 4h GeLU MLP's)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return (8 * self.hidden_size // 3) // 64 * 64 or 8 * self.hidden_size // 3
        return 4 * self.hidden_size


@dataclass(frozen=True)
class PrecisionArgs:
    """Parameter dtype and fp16 loss scaling (Megatron's mixed-precision flags)."""

    bf16: bool = arg(False, "bf16 parameters and activations")
    fp16: bool = arg(False, "fp16 parameters and activations, with loss scaling")
    loss_scale: float | None = arg(None, "a constant fp16 loss scale; default: dynamic", kind=float)
    initial_loss_scale: float = arg(2.0**32, "first dynamic loss scale")
    min_loss_scale: float = arg(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = arg(1000, "clean steps before the scale grows")
    hysteresis: int = arg(2, "overflows tolerated before the scale shrinks")

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ArgumentsError("--bf16 and --fp16 are both set; choose one")
        if self.loss_scale is not None and not self.fp16:
            raise ArgumentsError(
                "--loss-scale only applies with --fp16 (bf16 and fp32 need no loss scaling)"
            )

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass(frozen=True)
class OptimizerArgs:
    """AdamW and its learning-rate schedule (Megatron's learning-rate and regularization
    flags)."""

    lr: float | None = arg(None, "peak learning rate", kind=float)
    min_lr: float = arg(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = arg("linear", "", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = arg(0, "iterations of linear warmup")
    lr_decay_iters: int | None = arg(None, "default: --train-iters", kind=int)
    weight_decay: float = arg(0.01, "decoupled weight decay")
    adam_beta1: float = arg(0.9, "")
    adam_beta2: float = arg(0.999, "")
    adam_eps: float = arg(1e-8, "")
    clip_grad: float = arg(1.0, "clip the global gradient norm to this; 0 turns it off")

    def __post_init__(self) -> None:
        _require(self, ("lr",))
        if self.clip_grad < 0:
            raise ArgumentsError(
                f"--clip-grad must be >= 0 (0 turns clipping off), got {self.clip_grad}"
            )


@dataclass(frozen=True)
class TrainingArgs:
    """Batch and length of the run (Megatron's training flags)."""

    micro_batch_size: int | None = arg(None, "samples per microbatch", kind=int)
    global_batch_size: int | None = arg(
        None, "default: micro batch size × data-parallel size", kind=int
    )
    train_iters: int | None = arg(None, "iterations to train", kind=int)
    seed: int = arg(1234, "seed of the weights and every random stream")
    exit_interval: int | None = arg(
        None, "stop (after saving, with --save) when the iteration is a multiple", kind=int
    )

    def __post_init__(self) -> None:
        _require(self, ("micro_batch_size", "train_iters"))
        _require_positive(
            self, ("micro_batch_size", "global_batch_size", "train_iters", "exit_interval")
        )


@dataclass(frozen=True)
class DataArgs:
    """Where the tokens come from (Megatron's data and tokenizer flags)."""

    data_path: list[str] | None = arg(
        None, "PREFIX, or weight/prefix pairs: 30 A_text_document 70 B_text_document", nargs="*"
    )
    use_default_corpus: bool = arg(False, "train on this Python's standard-library sources")
    split: str = arg("969, 30, 1", "train/valid/test weights")
    data_cache_path: str | None = arg(
        None, "where index caches and the default corpus go", kind=str
    )
    num_workers: int = arg(0, "data-loading worker processes")
    eod_mask_loss: bool = arg(False, "leave end-of-document tokens out of the loss")
    reset_position_ids: bool = arg(False, "restart positions after every end of document")
    tokenizer_type: str = arg(BYTE_TOKENIZER, "", choices=TOKENIZER_TYPES)
    vocab_file: str | None = arg(None, "GPT-2 BPE vocab.json", kind=str)
    merge_file: str | None = arg(None, "GPT-2 BPE merges.txt", kind=str)
    tokenizer_model: str | None = arg(None, "a local Hugging Face tokenizer directory", kind=str)

    def __post_init__(self) -> None:
        if self.data_path is not None and len(self.data_path) == 0:
            raise ArgumentsError("--data-path needs a path prefix (or weight/prefix pairs)")
        if self.data_path is None and not self.use_default_corpus:
            raise ArgumentsError(
                "no training data: give --data-path PREFIX (tools/preprocess_data.py writes "
                "PREFIX.bin/.idx) or --use-default-corpus"
            )
        if self.data_path is not None and self.use_default_corpus:
            raise ArgumentsError("--data-path and --use-default-corpus are both set; choose one")
        try:
            if self.data_path is not None:
                parse_data_path(self.data_path)
        except ValueError as error:
            raise ArgumentsError(str(error)) from error
        try:
            parse_split(self.split)
        except ValueError as error:
            raise ArgumentsError(f"--split: {error}") from error
        if self.num_workers < 0:
            raise ArgumentsError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.tokenizer_type == "GPT2BPETokenizer" and not (self.vocab_file and self.merge_file):
            raise ArgumentsError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
            )
        if self.tokenizer_type == "HuggingFaceTokenizer" and not self.tokenizer_model:
            raise ArgumentsError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR"
            )
        for name in ("vocab_file", "merge_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ArgumentsError(f"--{name.replace('_', '-')} {path}: no such file")


@dataclass(frozen=True)
class CheckpointArgs:
    """Saving and resuming (Megatron's checkpointing flags)."""

    save: str | None = arg(None, "checkpoint directory to write", kind=str)
    load: str | None = arg(None, "checkpoint directory to resume from", kind=str)
    save_interval: int | None = arg(None, "iterations between checkpoints", kind=int)
    ckpt_step: int | None = arg(
        None, "with --load: the iteration to resume from (default: the latest)", kind=int
    )
    no_load_optim: bool = arg(
        False, "with --load: load the model only (fresh optimizer state and schedule)"
    )
    no_load_rng: bool = arg(
        False, "with --load: keep this run's random seeds instead of the saved generators"
    )
    use_checkpoint_opt_param_scheduler: bool = arg(
        False,
        "with --load: continue the learning-rate schedule saved in the checkpoint",
        flag="--use-checkpoint-opt_param-scheduler",
    )
    override_opt_param_scheduler: bool = arg(
        False,
        "with --load: use this run's learning-rate flags instead of the saved schedule",
        flag="--override-opt_param-scheduler",
    )

    def __post_init__(self) -> None:
        _require_positive(self, ("save_interval",))
        if self.ckpt_step is not None and self.load is None:
            raise ArgumentsError(
                "--ckpt-step needs --load DIR (the checkpoints to pick the iteration from)"
            )
        if self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler:
            raise ArgumentsError(
                "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are "
                "both set; choose one"
            )
        if self.save_interval is not None and self.save is None:
            raise ArgumentsError(
                "--save-interval needs --save DIR (where to write the checkpoints)"
            )

    @property
    def scheduler_settings(self) -> str:
        """Whose learning-rate schedule a resumed run follows (``LRScheduler.load_state_dict``)."""
        if self.use_checkpoint_opt_param_scheduler:
            return "checkpoint"
        return "current" if self.override_opt_param_scheduler else "match"


@dataclass(frozen=True)
class LoggingArgs:
    """What the run reports and when (Megatron's logging and validation flags)."""

    log_interval: int = arg(100, "iterations per log line")
    eval_interval: int = arg(1000, "iterations between evaluations")
    eval_iters: int = arg(100, "iterations per evaluation; 0 turns evaluation off")
    tensorboard_dir: str | None = arg(None, "also log to TensorBoard here", kind=str)
    metrics_path: str | None = arg(
        None,
        "JSON-lines metrics file (default: metrics.jsonl in --save, else in the working "
        "directory); appended to",
        kind=str,
    )

    def __post_init__(self) -> None:
        _require_positive(self, ("log_interval", "eval_interval"))
        if self.eval_iters < 0:
            raise ArgumentsError(
                f"--eval-iters must be >= 0 (0 turns evaluation off), got {self.eval_iters}"
            )
        if self.tensorboard_dir is not None:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ArgumentsError(
                    "--tensorboard-dir needs the tensorboard package (pip install tensorboard); "
                    "drop the flag to log to the metrics file only"
                ) from None


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
    (None without interleaving), ``num_microbatches`` and the defaults that depend on other
    flags (global batch = micro batch × dp, LR decay over the whole run).
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

    @classmethod
    def from_flags(cls, flags: dict[str, Any], world_size: int) -> PretrainConfig:
        """Build and check every group from ``flags`` (field name -> value, e.g.
        ``vars(namespace)``); raises :class:`ArgumentsError` naming the flags to change."""
        groups = {
            name: group(**{f.name: flags[f.name] for f in dataclasses.fields(group)})
            for name, group in GROUPS.items()
        }
        return cls(**groups, world_size=world_size)

    def __post_init__(self) -> None:
        try:
            self._derive()
        except ArgumentsError:
            raise
        except ValueError as error:  # a rule's owner, in its own field names
            raise ArgumentsError(as_flags(str(error))) from error

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # derived once, while the frozen config is built

    def _derive(self) -> None:
        from megapp.optimizer.lr_scheduler import check_schedule
        from megapp.pipeline_parallel.partition import check_layer_split, virtual_stages
        from megapp.pipeline_parallel.schedules import build_schedule
        from megapp.process_grid import ProcessGrid

        par, model, training = self.parallel, self.model, self.training
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        vpp = None
        if par.num_layers_per_virtual_pipeline_stage is not None:
            vpp = virtual_stages(model.num_layers, pp, par.num_layers_per_virtual_pipeline_stage)
        grid = ProcessGrid(self.world_size, tp, pp, vpp)
        self._set("virtual_pipeline_model_parallel_size", vpp)
        self._set("data_parallel_size", grid.dp)
        check_layer_split(model.num_layers, pp, vpp)
        self.transformer_config()  # the model's own rules (heads, widths, recompute, ...)

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
        if vpp is not None:
            try:
                build_schedule("interleaved-1f1b", pp, self.num_microbatches, vpp)
            except ValueError as error:
                raise ArgumentsError(
                    f"--global-batch-size {gbs} / (--micro-batch-size {mbs} × data-parallel "
                    f"size {dp}) gives {self.num_microbatches} microbatches, which the "
                    f"interleaved schedule cannot run: {as_flags(str(error))}; use a global "
                    f"batch of {nearest_multiples(gbs, mbs * dp * pp)}"
                ) from error

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

    def transformer_config(self):
        """The model's shape and behaviour as a TransformerConfig (checked there)."""
        from megapp.transformer.config import TransformerConfig

        return TransformerConfig(**self._transformer_fields())

    def gpt_config(self, vocab_size: int):
        """The model as a :class:`~megapp.models.GPTConfig` for a tokenizer of
        ``vocab_size`` ids."""
        from megapp.models import GPTConfig

        model = self.model
        return GPTConfig(
            **self._transformer_fields(),
            vocab_size=vocab_size,
            make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
            max_position_embeddings=model.positions,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        )

    def _transformer_fields(self) -> dict[str, Any]:
        model = self.model
        return dict(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            ffn_hidden_size=model.ffn,
            num_attention_heads=model.num_attention_heads,
            num_query_groups=model.num_query_groups,
            kv_channels=model.kv_channels,
            hidden_dropout=model.hidden_dropout,
            attention_dropout=model.attention_dropout,
            activation="swiglu" if model.swiglu else "gelu",
            add_bias_linear=not model.disable_bias_linear,
            normalization=model.normalization,
            layernorm_epsilon=model.norm_epsilon,
            position_embedding_type=model.position_embedding_type,
            rotary_base=model.rotary_base,
            attention_backend=model.attention_backend,
            init_method_std=model.init_method_std,
            recompute_granularity=model.recompute_granularity,
            recompute_method=model.recompute_method,
            recompute_num_layers=model.recompute_num_layers,
            tensor_model_parallel_size=self.parallel.tensor_model_parallel_size,
            sequence_parallel=self.parallel.sequence_parallel,
            params_dtype=self.precision.params_dtype,
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
