"""Pre-train a GPT with data, tensor and pipeline parallelism.

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 \\
        --global-batch-size 32 --lr 1e-3 --train-iters 100 --use-default-corpus

The same command runs on CPU (gloo) and on GPUs (NCCL, one rank per GPU). This
file holds the GPT-specific parts, Megatron's way: the model provider, the
forward step with its loss, and the datasets provider; the loop itself is
:func:`megapp.training.pretrain.pretrain`. See docs/pretrain.md for the flags.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.comm import CollectiveError
from megapp.data import (
    IndexedDataset,
    build_default_corpus,
    build_tokenizer,
    build_train_valid_test_datasets,
    check_token_ids,
    get_batch,
    parse_data_path,
)
from megapp.models import GPTConfig, GPTModel, build_gpt_chunks
from megapp.training.arguments import (
    ArgumentsError,
    exit_after_failure,
    exit_with_error,
    parse_args,
)
from megapp.training.pretrain import pretrain
from megapp.training.step import TrainGroups


def model_provider(args: argparse.Namespace, groups: TrainGroups) -> list[GPTModel]:
    """This rank's GPT chunks for the current (virtual) pipeline position."""
    try:
        config = _gpt_config(args)
    except ValueError as error:
        raise ArgumentsError(f"model settings: {error}") from error
    return build_gpt_chunks(
        config,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=args.pipeline_model_parallel_size,
        vpp_size=args.virtual_pipeline_model_parallel_size,
        tp_group=groups.tp,
        seed=args.seed,
    )


def _gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        activation="swiglu" if args.swiglu else "gelu",
        add_bias_linear=not args.disable_bias_linear,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        attention_backend=args.attention_backend,
        init_method_std=args.init_method_std,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=args.params_dtype,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        max_position_embeddings=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> torch.Tensor:
    """The microbatch's mean loss over the tokens the mask keeps."""
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)


def forward_step(
    data_iterator, model, inputs, *, eod: int, eod_mask_loss: bool, reset_position_ids: bool
):
    """One microbatch through one chunk: ``(output, loss_func)``.

    The first stage reads tokens and positions, the last labels and the loss mask;
    a middle stage takes the previous stage's hidden states from ``inputs``. The
    keyword settings come from the arguments (bind them with functools.partial).
    """
    chunk = model.module
    batch = None
    if chunk.pre_process or chunk.post_process:
        device = next(chunk.parameters()).device
        batch = get_batch(next(data_iterator), eod, eod_mask_loss, reset_position_ids)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    labels = {"labels": batch["labels"]} if chunk.post_process else {}
    if chunk.pre_process:
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], **labels)
    else:
        output = model(hidden_states=inputs[0], **labels)
    if not chunk.post_process:
        return output, None
    return output, functools.partial(loss_func, batch["loss_mask"])


def default_corpus_prefix(args: argparse.Namespace) -> str:
    root = args.data_cache_path or os.path.join(os.path.expanduser("~"), ".cache", "megapp")
    return os.path.join(root, "default_corpus", f"stdlib_{args.tokenizer_type}")


def datasets_provider(args: argparse.Namespace, num_samples, *, tokenizer):
    """Train, valid and test GPT datasets from ``--data-path`` or the default corpus
    (tokenized with ``tokenizer``)."""
    if args.use_default_corpus:
        data_path = [build_default_corpus(default_corpus_prefix(args), tokenizer)]
        if dist.get_rank() == 0:
            print(f" > default corpus: {data_path[0]}.bin/.idx", flush=True)
    else:
        data_path = args.data_path
        for prefix in parse_data_path(data_path)[0]:
            if not IndexedDataset.exists(prefix):
                raise ArgumentsError(
                    f"--data-path {prefix}: {prefix}.bin / {prefix}.idx not found; write them "
                    "with tools/preprocess_data.py or train on --use-default-corpus"
                )
    try:
        check_token_ids(parse_data_path(data_path)[0], tokenizer.vocab_size, args.data_cache_path)
        return build_train_valid_test_datasets(
            data_path,
            args.split,
            num_samples,
            args.seq_length,
            args.seed,
            cache_dir=args.data_cache_path,
        )
    except (ValueError, OSError) as error:
        raise ArgumentsError(f"--data-path: {error}") from error


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        try:
            tokenizer = build_tokenizer(
                args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model
            )
        except (ValueError, OSError) as error:
            raise ArgumentsError(f"--tokenizer-type {args.tokenizer_type}: {error}") from error
        args.vocab_size = tokenizer.vocab_size
        pretrain(
            args,
            functools.partial(datasets_provider, tokenizer=tokenizer),
            model_provider,
            functools.partial(
                forward_step,
                eod=tokenizer.eod,
                eod_mask_loss=args.eod_mask_loss,
                reset_position_ids=args.reset_position_ids,
            ),
        )
    except ArgumentsError as error:
        exit_with_error(os.path.basename(sys.argv[0]), error)
    except CollectiveError as error:
        exit_after_failure(os.path.basename(sys.argv[0]), error)
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
