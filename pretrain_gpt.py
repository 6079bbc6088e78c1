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

import os
import sys

from megapp.launcher_watch import exit_with_launcher

if __name__ == "__main__":  # before torch's import, which takes seconds
    exit_with_launcher(os.path.basename(sys.argv[0]))

import functools

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.comm import CollectiveError, Group
from megapp.data import (
    IndexedDataset,
    build_default_corpus,
    build_tokenizer,
    build_train_valid_test_datasets,
    check_token_ids,
    parse_data_path,
)
from megapp.models import GPTModel, build_gpt_chunks
from megapp.parallel_state import TrainGroups
from megapp.training import hf_start
from megapp.training.arguments import (
    ArgumentsError,
    exit_after_failure,
    exit_with_error,
    parse_args,
)
from megapp.training.config import PretrainConfig
from megapp.training.data_iterators import get_batch, masked_token_mean, split_batch
from megapp.training.flops import gpt_config_training_flops
from megapp.training.initialize import check_memory
from megapp.training.pretrain import pretrain
from megapp.transformer.config import ExpertGroups


def model_provider(
    config: PretrainConfig, groups: TrainGroups, *, vocab_size: int
) -> list[GPTModel]:
    """This rank's GPT chunks for the current (virtual) pipeline position."""
    return build_gpt_chunks(
        config.gpt_config(vocab_size),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=config.parallel.pipeline_model_parallel_size,
        vpp_size=config.virtual_pipeline_model_parallel_size,
        tp_group=groups.tp,
        seed=config.training.seed,
        schedule=config.schedule,
        cp_group=groups.cp,
        expert_groups=ExpertGroups(groups.ep, groups.expt_tp, groups.tp_cp),
    )


def flops_per_iteration(config: PretrainConfig, vocab_size: int) -> float:
    """Model FLOPs of one iteration of the global batch (what the log's TFLOP/s counts)."""
    seq = config.model.seq_length
    tokens = seq * config.training.global_batch_size
    return gpt_config_training_flops(config.gpt_config(vocab_size), seq, tokens)


def loss_func(
    loss_mask: torch.Tensor, cp_group: Group, per_token_loss: torch.Tensor
) -> torch.Tensor:
    """The microbatch's mean loss over the tokens the mask keeps (under context
    parallelism, each rank's share of it scaled by cp: :func:`masked_token_mean`)."""
    return masked_token_mean(per_token_loss, loss_mask, cp_group)


def forward_step(
    data_iterator, model, inputs, *, eod: int, eod_mask_loss: bool, reset_position_ids: bool
):
    """One microbatch through one chunk: ``(output, loss_func)``.

    The first stage reads tokens and positions, the last labels and the loss mask;
    a middle stage takes the previous stage's hidden states from ``inputs``. Under
    context parallelism each rank keeps its slice of the sequence. The keyword settings
    come from the arguments (bind them with functools.partial).
    """
    chunk = model.module
    batch = None
    if chunk.pre_process or chunk.post_process:
        device = next(chunk.parameters()).device
        batch = get_batch(next(data_iterator), eod, eod_mask_loss, reset_position_ids)
        batch = split_batch(batch, chunk.cp_group)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    labels = {"labels": batch["labels"]} if chunk.post_process else {}
    if chunk.pre_process:
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], **labels)
    else:
        output = model(hidden_states=inputs[0], **labels)
    if not chunk.post_process:
        return output, None
    return output, functools.partial(loss_func, batch["loss_mask"], chunk.cp_group)


def default_corpus_prefix(config: PretrainConfig) -> str:
    data = config.data
    root = data.data_cache_path or os.path.join(os.path.expanduser("~"), ".cache", "megapp")
    return os.path.join(root, "default_corpus", f"stdlib_{data.tokenizer_type}")


def datasets_provider(config: PretrainConfig, num_samples, *, tokenizer):
    """Train, valid and test GPT datasets from ``--data-path`` or the default corpus
    (tokenized with ``tokenizer``)."""
    data = config.data
    if data.use_default_corpus:
        data_path = [build_default_corpus(default_corpus_prefix(config), tokenizer)]
        if dist.get_rank() == 0:
            print(f" > default corpus: {data_path[0]}.bin/.idx", flush=True)
    else:
        data_path = data.data_path
        for prefix in parse_data_path(data_path)[0]:
            if not IndexedDataset.exists(prefix):
                raise ArgumentsError(
                    f"--data-path {prefix}: {prefix}.bin / {prefix}.idx not found; write them "
                    "with tools/data/preprocess_data.py or train on --use-default-corpus"
                )
    # Evaluation reads the valid and test splits: rank 0 says when one of them is empty.
    on_rank_0 = not dist.is_initialized() or dist.get_rank() == 0
    warn = functools.partial(print, flush=True) if config.logging.eval_iters and on_rank_0 else None
    try:
        check_token_ids(parse_data_path(data_path)[0], tokenizer.vocab_size, data.data_cache_path)
        return build_train_valid_test_datasets(
            data_path,
            data.split,
            num_samples,
            config.model.seq_length,
            config.training.seed,
            cache_dir=data.data_cache_path,
            rules=data.data_rules,
            warn=warn,
        )
    except (ValueError, OSError) as error:
        raise ArgumentsError(f"--data-path: {error}") from error


def model_vocab_size(config: PretrainConfig, tokenizer_vocab: int) -> int:
    """The tokenizer's vocabulary, or ``--load-hf``'s rows (at least as many), whose model
    the flags must then describe."""
    directory = config.checkpoint.load_hf
    if directory is None:
        return tokenizer_vocab
    rows = hf_start.hf_vocab_size(directory)
    if rows < tokenizer_vocab:
        raise ArgumentsError(
            f"--load-hf {directory}: the model has {rows} vocabulary rows but the tokenizer "
            f"{tokenizer_vocab} ids; use the model's own tokenizer (--tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model {directory})"
        )
    hf_start.check_model_flags(config, rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    prog = os.path.basename(sys.argv[0])
    try:
        data = config.data
        try:
            tokenizer = build_tokenizer(
                data.tokenizer_type, data.vocab_file, data.merge_file, data.tokenizer_model
            )
        except (ValueError, OSError) as error:
            raise ArgumentsError(f"--tokenizer-type {data.tokenizer_type}: {error}") from error
        vocab_size = model_vocab_size(config, tokenizer.vocab_size)
        check_memory(config, vocab_size)
        pretrain(
            config,
            functools.partial(datasets_provider, tokenizer=tokenizer),
            functools.partial(model_provider, vocab_size=vocab_size),
            functools.partial(
                forward_step,
                eod=tokenizer.eod,
                eod_mask_loss=data.eod_mask_loss,
                reset_position_ids=data.reset_position_ids,
            ),
            flops_per_iteration=flops_per_iteration(config, vocab_size),
        )
    except ArgumentsError as error:
        exit_with_error(prog, error)
    except CollectiveError as error:
        exit_after_failure(prog, error)
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
