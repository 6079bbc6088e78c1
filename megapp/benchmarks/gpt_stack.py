"""The GPT that ``tools/benchmarks/bench_gpt.py`` trains, and the one place it builds the
training stack.

:func:`gpt_config` turns the benchmark's shape flags into a ``GPTConfig``; :func:`build_stack`
builds a rank's model chunks, wrapped in ``DistributedDataParallel``, and their ``Optimizer``
with ``megapp.training.build_training_setup``, as the training loop and the tests do (every
part of the benchmark that trains the full stack goes through it);
:func:`batch_of` and :func:`forward_step` feed ``train_step``; :func:`model_flops` counts an
iteration's model FLOPs with ``megapp.training.flops``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import torch

from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.models import GPTConfig
from megapp.optimizer import Optimizer
from megapp.training import TrainGroups, build_training_setup
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.flops import gpt_config_training_flops

SEED, LR, WD = 1234, 1e-4, 0.1


def gpt_config(
    args: argparse.Namespace, *, tp: int = 1, dtype: torch.dtype = torch.float32
) -> GPTConfig:
    """The benchmark's GPT (``--layers``, ``--hidden``, ``--heads``, ``--vocab``, ``--seq``)
    at tensor-parallel size ``tp``, dropout off so the plain model computes the same function."""
    return GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
    )


def model_flops(config: GPTConfig, sequences: int, seq: int) -> float:
    """Model FLOPs of one training step over ``sequences`` sequences of ``seq`` tokens."""
    return gpt_config_training_flops(config, seq, sequences * seq)


def build_stack(
    args: argparse.Namespace,
    *,
    layout: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    clip_grad: float | None = 1.0,
) -> tuple[list[DistributedDataParallel], Optimizer, TrainGroups]:
    """This rank's model chunks in DistributedDataParallel, their Optimizer and the groups
    ``train_step`` talks to.

    ``layout=False``: one process, one chunk, no process group. ``layout=True``: this rank's
    (virtual) pipeline chunks of the layout set by ``initialize_model_parallel``, tensor-
    parallel over its group, with gradient clipping over the model-parallel group.
    """
    tp = ps.get_tensor_model_parallel_world_size() if layout else 1
    setup = build_training_setup(  # the layout's, or one process's whole model
        gpt_config(args, tp=tp, dtype=dtype),
        OptimizerArgs(
            lr=LR,
            weight_decay=WD,
            clip_grad=clip_grad or 0.0,
            lr_decay_style="constant",
            lr_decay_iters=1,
        ),
        seed=SEED,
        device=device,
    )
    return setup.chunks, setup.optimizer, setup.groups


def batch_of(
    args: argparse.Namespace, step: int, sequences: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) ``[sequences, s]`` of iteration ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, args.vocab, (sequences, args.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def microbatches_of(
    tokens: torch.Tensor, labels: torch.Tensor, size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive (tokens, labels) microbatches of ``size`` sequences."""
    return [(tokens[i : i + size], labels[i : i + size]) for i in range(0, len(tokens), size)]


def forward_step(iterator: Iterator, chunk, inputs) -> tuple[torch.Tensor, Callable]:
    """The pipeline engine's step: the chunk's output and the mean per-token loss."""
    tokens, labels = next(iterator)
    model = chunk.module
    kwargs = {"labels": labels} if model.post_process else {}
    if model.pre_process:
        output = chunk(input_ids=tokens, **kwargs)
    else:
        output = chunk(hidden_states=inputs[0], **kwargs)
    return output, (lambda per_token: per_token.float().mean())


def shape(args: argparse.Namespace) -> dict:
    """The shape flags of a run, for its report."""
    keys = ("layers", "hidden", "heads", "seq", "vocab", "batch", "global_batch", "micro_batch")
    return {k: getattr(args, k) for k in keys}
