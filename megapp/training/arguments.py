"""Command-line settings of ``pretrain_gpt.py``, with Megatron-LM's flag names.

:func:`build_parser` declares the flags; :func:`validate_args` (in
:mod:`megapp.training.validation`) checks them against each other and the world
size before anything starts and derives the rest. Every failure is an
:class:`ArgumentsError` whose message names the flags to change.
:func:`parse_args` does both and, launched from the command line, turns an
error into ``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from megapp.data.tokenizers import BYTE_TOKENIZER, TOKENIZER_TYPES
from megapp.training.validation import ArgumentsError, validate_args

__all__ = [
    "ArgumentsError",
    "build_parser",
    "exit_after_failure",
    "exit_with_error",
    "parse_args",
    "validate_args",
    "world_size_from_env",
]


# How long a process other than its node's first waits before reporting an error itself.
ERROR_GRACE_S = 10.0


def exit_with_error(prog: str, error: Exception) -> NoReturn:
    """Print ``prog: error: <error>`` to stderr and exit with status 2, once per node.

    torchrun stops every process of a node as soon as one of them exits, so the node's
    other processes wait (up to ``ERROR_GRACE_S``) for its first one, which reaches the
    same error, prints it and exits, which ends them. Only a process still running after
    the grace (its first process failed otherwise, or is slow to start) prints the error
    itself, so no message is lost to a process that exited first.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        time.sleep(ERROR_GRACE_S)
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


def exit_after_failure(prog: str, error: Exception) -> NoReturn:
    """Print ``prog: error: <error>`` and leave at once with status 1.

    For a failed collective: each rank says what it waited on, and the process groups are
    not torn down, since that would wait on the failed peer again.
    """
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are printed like every other setting's: once per node, one line."""

    def error(self, message: str) -> NoReturn:
        exit_with_error(self.prog, ArgumentsError(f"{message} (see {self.prog} --help)"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=os.path.basename(sys.argv[0]) or "pretrain_gpt.py",
        description="Pre-train a GPT with data, tensor and pipeline parallelism.",
        allow_abbrev=False,
    )
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per virtual stage; interleaves the pipeline schedule",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=40_000_000,
        help="elements per data-parallel gradient bucket",
    )
    g.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl when CUDA is available, else gloo",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="how long a collective waits for a dead or stuck rank before the job fails",
    )

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="default 4 × hidden size (8/3 × hidden size, rounded to 64, with --swiglu)",
    )
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value heads (implies --group-query-attention)",
    )
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument(
        "--max-position-embeddings", type=int, default=None, help="default: --seq-length"
    )
    g.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=("learned_absolute", "rope", "none"),
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--attention-backend", default="sdpa", choices=("sdpa", "fused_softmax"))
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"))
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"))
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="a constant fp16 loss scale; default: dynamic scaling",
    )
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = parser.add_argument_group("optimization")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default: micro batch size × data-parallel size",
    )
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=("constant", "linear", "cosine"))
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)

    g = parser.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="PREFIX, or weight/prefix pairs: 30 A_text_document 70 B_text_document",
    )
    g.add_argument(
        "--use-default-corpus",
        action="store_true",
        help="train on the built-in corpus (this Python's standard-library sources)",
    )
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument(
        "--data-cache-path", default=None, help="where index caches and the default corpus go"
    )
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--tokenizer-type", default=BYTE_TOKENIZER, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)

    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="with --load: the iteration to resume from (default: the latest)",
    )
    g.add_argument(
        "--no-load-optim",
        action="store_true",
        help="with --load: load the model only (fresh optimizer state and schedule)",
    )
    g.add_argument(
        "--no-load-rng",
        action="store_true",
        help="with --load: keep this run's random seeds instead of the saved generators",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="with --load: continue the learning-rate schedule saved in the checkpoint",
    )
    g.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="with --load: use this run's learning-rate flags instead of the saved schedule",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving, with --save) when the iteration is a multiple",
    )

    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100, help="0 turns evaluation off")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--metrics-path",
        default=None,
        help="JSON-lines metrics file (default: metrics.jsonl in --save, else "
        "in the working directory); appended to",
    )
    return parser


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when launched as a plain script)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_args(
    argv: Sequence[str] | None = None, world_size: int | None = None
) -> argparse.Namespace:
    """Parse and validate; on an invalid setting print ``error: ...`` and exit with status 2.

    A failed launch reports once per node (see :func:`exit_with_error`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return validate_args(args, world_size_from_env() if world_size is None else world_size)
    except ArgumentsError as error:
        exit_with_error(parser.prog, error)
