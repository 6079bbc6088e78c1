"""Validation of ``pretrain_gpt.py``'s settings (:func:`validate_args`).

Checks the flags :func:`~megapp.training.arguments.build_parser` declares against each other
and the world size before anything starts, and derives the rest (data-parallel size,
microbatches per iteration, virtual pipeline size, parameter dtype). Every failure is an
:class:`ArgumentsError` whose message names the flags to change.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch

from megapp.data.builder import parse_data_path, parse_split


class ArgumentsError(ValueError):
    """Settings that cannot work together; the message says what to change."""


def _fail(message: str) -> None:
    raise ArgumentsError(message)


def _multiple_hint(value: int, step: int) -> str:
    lower, upper = value // step * step, (value // step + 1) * step
    return f"{upper}" if lower == 0 else f"{lower} or {upper}"


def _check_positive(args: argparse.Namespace, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check ``args`` for ``world_size`` ranks and fill in the derived settings, in place.

    Adds ``world_size``, ``data_parallel_size``, ``num_microbatches``,
    ``virtual_pipeline_model_parallel_size`` (None without interleaving) and
    ``params_dtype``; fills ``global_batch_size``, ``max_position_embeddings``,
    ``ffn_hidden_size``, ``num_query_groups`` and ``lr_decay_iters`` when left out.
    """
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, flag) is None:
            _fail(f"--{flag.replace('_', '-')} is required")
    for flag in ("micro_batch_size", "train_iters", "lr"):
        if getattr(args, flag) is None:
            _fail(f"--{flag.replace('_', '-')} is required")
    _check_positive(
        args,
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "kv_channels",
            "num_query_groups",
            "seq_length",
            "max_position_embeddings",
            "micro_batch_size",
            "global_batch_size",
            "train_iters",
            "log_interval",
            "eval_interval",
            "save_interval",
            "exit_interval",
            "make_vocab_size_divisible_by",
            "ddp_bucket_size",
        ),
    )
    if not args.distributed_timeout_minutes > 0:
        _fail(f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    if world_size < 1:
        _fail(f"world size must be >= 1, got {world_size}")
    args.world_size = world_size

    # Layout: world = tp × pp × dp.
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        _fail(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size × "
            f"--pipeline-model-parallel-size ({tp} × {pp} = {tp * pp}); launch a multiple of "
            f"{tp * pp} processes or change the two sizes"
        )
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
    if args.sequence_parallel and tp == 1:
        _fail("--sequence-parallel needs --tensor-model-parallel-size > 1; drop one or the other")

    # Layers over (virtual) pipeline stages.
    layers = args.num_layers
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            _fail(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size "
                ">= 2; drop it or use more pipeline stages"
            )
        if layers % (pp * per_stage):
            _fail(
                f"--num-layers ({layers}) is not divisible by --pipeline-model-parallel-size × "
                f"--num-layers-per-virtual-pipeline-stage ({pp} × {per_stage} = "
                f"{pp * per_stage}); use {_multiple_hint(layers, pp * per_stage)} layers or "
                "change the two sizes"
            )
        vpp = layers // (pp * per_stage)
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    elif layers % pp:
        _fail(
            f"--num-layers ({layers}) is not divisible by --pipeline-model-parallel-size ({pp}); "
            f"use {_multiple_hint(layers, pp)} layers or another pipeline size"
        )

    # Batch: global = micro × dp × microbatches.
    mbs = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    if gbs % (mbs * dp):
        _fail(
            f"--global-batch-size ({gbs}) is not divisible by --micro-batch-size × data-parallel "
            f"size ({mbs} × {dp} = {mbs * dp}); use a global batch of "
            f"{_multiple_hint(gbs, mbs * dp)}, or change the micro batch size or the layout"
        )
    args.num_microbatches = gbs // (mbs * dp)
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp:
        m = args.num_microbatches
        _fail(
            f"the interleaved pipeline schedule needs the number of microbatches ({m} = "
            f"global {gbs} / (micro {mbs} × dp {dp})) to be a multiple of "
            f"--pipeline-model-parallel-size ({pp}); use a global batch of "
            f"{_multiple_hint(gbs, mbs * dp * pp)}"
        )

    # Attention heads and widths against tp.
    heads = args.num_attention_heads
    if args.num_query_groups is not None:
        args.group_query_attention = True
    elif args.group_query_attention:
        _fail("--group-query-attention needs --num-query-groups N (the key/value heads)")
    else:
        args.num_query_groups = heads
    if heads % tp:
        _fail(
            f"--num-attention-heads ({heads}) is not divisible by --tensor-model-parallel-size "
            f"({tp}); choose a tensor-parallel size that divides the heads"
        )
    if heads % args.num_query_groups:
        _fail(
            f"--num-attention-heads ({heads}) is not a multiple of --num-query-groups "
            f"({args.num_query_groups})"
        )
    if args.num_query_groups % tp:
        _fail(
            f"--num-query-groups ({args.num_query_groups}) is not divisible by "
            f"--tensor-model-parallel-size ({tp}); use more key/value heads or less tp"
        )
    if args.kv_channels is None and args.hidden_size % heads:
        _fail(
            f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads "
            f"({heads}); change one of them or give --kv-channels"
        )
    if args.ffn_hidden_size is None:
        if args.swiglu:  # keeps the MLP's parameter count near the 4h GeLU MLP's
            args.ffn_hidden_size = (
                8 * args.hidden_size // 3
            ) // 64 * 64 or 8 * args.hidden_size // 3
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.ffn_hidden_size % tp:
        _fail(
            f"--ffn-hidden-size ({args.ffn_hidden_size}) is not divisible by "
            f"--tensor-model-parallel-size ({tp}); give a multiple of {tp}"
        )

    # Sequence length and positions.
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        _fail(
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings}); raise --max-position-embeddings or shorten "
            "the sequences"
        )

    # Dropout and recompute.
    for flag in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, flag) < 1.0:
            _fail(f"--{flag.replace('_', '-')} must be in [0, 1), got {getattr(args, flag)}")
    if args.recompute_granularity == "full":
        if args.recompute_method is None or args.recompute_num_layers is None:
            _fail(
                "--recompute-granularity full needs --recompute-method uniform|block and "
                "--recompute-num-layers N"
            )
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        _fail(
            "--recompute-method and --recompute-num-layers only apply with "
            "--recompute-granularity full"
        )
    if args.recompute_num_layers is not None and args.recompute_num_layers < 1:
        _fail(f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")

    # Precision.
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are both set; choose one")
    if args.loss_scale is not None and not args.fp16:
        _fail("--loss-scale only applies with --fp16 (bf16 and fp32 need no loss scaling)")
    args.params_dtype = (
        torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    )

    # Learning rate schedule.
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        _fail(f"need 0 <= --min-lr <= --lr, got --min-lr {args.min_lr} and --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not 0 <= args.lr_warmup_iters <= args.lr_decay_iters:
        _fail(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be between 0 and "
            f"--lr-decay-iters ({args.lr_decay_iters})"
        )
    if args.clip_grad < 0:
        _fail(f"--clip-grad must be >= 0 (0 turns clipping off), got {args.clip_grad}")

    # Data.
    if args.data_path is not None and len(args.data_path) == 0:
        _fail("--data-path needs a path prefix (or weight/prefix pairs)")
    if args.data_path is None and not args.use_default_corpus:
        _fail(
            "no training data: give --data-path PREFIX (tools/preprocess_data.py writes "
            "PREFIX.bin/.idx) or --use-default-corpus"
        )
    if args.data_path is not None and args.use_default_corpus:
        _fail("--data-path and --use-default-corpus are both set; choose one")
    if args.data_path is not None:
        try:
            parse_data_path(args.data_path)
        except ValueError as error:
            _fail(str(error))
    try:
        parse_split(args.split)
    except ValueError as error:
        _fail(f"--split: {error}")
    if args.num_workers < 0:
        _fail(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.tokenizer_type == "GPT2BPETokenizer" and (not args.vocab_file or not args.merge_file):
        _fail("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        _fail("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
    for flag in ("vocab_file", "merge_file"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            _fail(f"--{flag.replace('_', '-')} {path}: no such file")

    # Evaluation, checkpoints, logging.
    if args.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0 (0 turns evaluation off), got {args.eval_iters}")
    if args.ckpt_step is not None and args.load is None:
        _fail("--ckpt-step needs --load DIR (the checkpoints to pick the iteration from)")
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        _fail(
            "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are both "
            "set; choose one"
        )
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save DIR (where to write the checkpoints)")
    if args.tensorboard_dir is not None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            _fail(
                "--tensorboard-dir needs the tensorboard package (pip install tensorboard); "
                "drop the flag to log to the metrics file only"
            )
    return args
