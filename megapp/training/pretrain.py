"""The pre-training loop: set up, resume, train, log, evaluate, save.

:func:`pretrain` is what ``pretrain_gpt.py`` calls with its model provider,
forward step and datasets provider (Megatron's shape). Per iteration it runs
:func:`~megapp.training.step.train_step`; every ``--log-interval`` the last
rank prints one line and writes one metrics record; every ``--eval-interval``
it evaluates on the validation split; every ``--save-interval`` and at the end
it saves a checkpoint. With ``--load`` it continues where the checkpoint
stopped: same weights, optimizer and scheduler state, RNG streams and data
position, so the losses continue exactly as in an uninterrupted run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.pipeline_parallel.p2p import TensorSpec
from megapp.pipeline_parallel.runner import ForwardStepFunc
from megapp.tensor_parallel.utils import pad_vocab_size
from megapp.training import checkpoints
from megapp.training.arguments import ArgumentsError
from megapp.training.checkpoints import TrainState, checkpoint_settings
from megapp.training.data_iterators import chunk_iterators, rank0_first
from megapp.training.evaluate import evaluate
from megapp.training.initialize import (
    ModelProvider,
    count_parameters,
    initialize_distributed,
    print_rank_0,
    setup_model_and_optimizer,
)
from megapp.training.metrics import (
    MetricsWriter,
    flops_per_iteration,
    format_eval_lines,
    format_train_line,
    peak_tflops,
    perplexity,
)
from megapp.training.step import TrainGroups, train_step

DatasetsProvider = Callable[[argparse.Namespace, Sequence[int]], tuple[Any, Any, Any]]
"""``(args, [train, valid, test] sample counts) -> (train, valid, test)`` datasets (or None)."""


def pipeline_tensor_shapes(args: argparse.Namespace) -> list[TensorSpec]:
    """What one pipeline stage sends the next, fixed for the whole run (Megatron's p2p shape):
    the hidden states ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) in the
    model's dtype. Declared, they spare every step a header exchange; a stage that sends
    anything else fails with a message naming both shapes."""
    seq = args.seq_length
    if args.sequence_parallel:
        seq //= args.tensor_model_parallel_size
    return [TensorSpec((seq, args.micro_batch_size, args.hidden_size), args.params_dtype)]


def _is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


@dataclass
class _Interval:
    """Sums over the iterations since the last log line."""

    iterations: int = 0
    advanced: int = 0  # iterations whose update was applied
    loss_sum: float = 0.0
    seconds: float = 0.0
    skipped: int = 0
    nan: int = 0


class Trainer:
    """The loop's state and its periodic duties (log, evaluate, save)."""

    def __init__(self, args, forward_step_func, chunks, optimizer, scheduler, groups, device):
        self.args, self.forward_step_func = args, forward_step_func
        self.chunks, self.optimizer, self.scheduler = chunks, optimizer, scheduler
        self.groups, self.device = groups, device
        self.state = TrainState()
        self.writer: MetricsWriter | None = None
        padded_vocab = pad_vocab_size(
            args.vocab_size, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
        )
        self.flops = flops_per_iteration(args, padded_vocab)
        self.peak = peak_tflops(device, args.params_dtype)
        self.valid_iterators = self.test_iterators = None
        self.tensor_shapes = pipeline_tensor_shapes(args)

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def train(self, train_iterators) -> bool:
        """Train to ``--train-iters``; True when ``--exit-interval`` stopped it early."""
        args, state, interval = self.args, self.state, _Interval()
        while state.iteration < args.train_iters:
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this iteration applies
            start = self._sync()
            result = train_step(
                self.forward_step_func,
                train_iterators,
                self.chunks,
                self.optimizer,
                num_microbatches=args.num_microbatches,
                groups=self.groups,
                lr_scheduler=self.scheduler,
                tensor_shapes=self.tensor_shapes,
            )
            interval.seconds += self._sync() - start
            state.iteration += 1
            state.consumed_train_samples += args.global_batch_size
            interval.iterations += 1
            interval.skipped += int(result.skipped)
            if not math.isfinite(result.loss):
                interval.nan += 1
            elif not result.skipped:
                interval.advanced += 1
                interval.loss_sum += result.loss
            if state.iteration % args.log_interval == 0:
                self.log(interval, lr, result.grad_norm)
                interval = _Interval()
            if args.eval_iters and state.iteration % args.eval_interval == 0:
                self.evaluate("valid", f"iteration {state.iteration}")
            saved = False
            if args.save_interval and state.iteration % args.save_interval == 0:
                self.save()
                saved = True
            if args.exit_interval and state.iteration % args.exit_interval == 0:
                if args.save and not saved:
                    self.save()
                print_rank_0(f" > exiting after iteration {state.iteration} (--exit-interval)")
                return True
        return False

    def log(self, interval: _Interval, lr: float, grad_norm: float) -> None:
        args = self.args
        seconds = interval.seconds / interval.iterations
        tflops = self.flops / seconds / args.world_size / 1e12
        scaler = self.optimizer.grad_scaler
        record = {
            "kind": "train",
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_train_samples,
            "elapsed_ms_per_iteration": 1000.0 * seconds,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "tokens_per_second_per_device": args.global_batch_size
            * args.seq_length
            / seconds
            / args.world_size,
            "learning_rate": lr,
            "global_batch_size": args.global_batch_size,
            "lm_loss": interval.loss_sum / interval.advanced if interval.advanced else None,
            "loss_scale": scaler.scale_value if scaler is not None else 1.0,
            "grad_norm": grad_norm,
            "skipped_iterations": interval.skipped,
            "nan_iterations": interval.nan,
        }
        if self.writer is not None:
            self.writer.write(record)
            print(format_train_line(record, args.train_iters), flush=True)

    def evaluate(self, split: str, where: str) -> None:
        iterators = self.valid_iterators if split == "valid" else self.test_iterators
        if iterators is None:
            return
        args = self.args
        loss = evaluate(
            self.forward_step_func,
            iterators,
            self.chunks,
            num_microbatches=args.num_microbatches,
            eval_iters=args.eval_iters,
            groups=self.groups,
            tensor_shapes=self.tensor_shapes,
        )
        if split == "valid":
            self.state.consumed_valid_samples += args.eval_iters * args.global_batch_size
        record = {
            "kind": "eval",
            "split": split,
            "where": where,
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_train_samples,
            "lm_loss": loss,
            "lm_loss_ppl": perplexity(loss),
        }
        if self.writer is not None:
            self.writer.write(record)
            print(format_eval_lines(record), flush=True)

    def save(self) -> None:
        path = checkpoints.save(
            self.args, self.state, self.chunks, self.optimizer, self.scheduler, self.groups
        )
        if self.writer is not None:
            record = {"kind": "checkpoint", "iteration": self.state.iteration, "path": str(path)}
            self.writer.write(record)


def pretrain(
    args: argparse.Namespace,
    datasets_provider: DatasetsProvider,
    model_provider: ModelProvider,
    forward_step_func: ForwardStepFunc,
) -> TrainState:
    """Train as ``args`` say (validated by :func:`~megapp.training.validation.validate_args`,
    plus ``args.vocab_size``, the tokenizer's). Starts torch.distributed and the layout
    (:func:`~megapp.training.initialize.initialize_distributed`); the caller tears them
    down. Returns the final state.
    """
    started = time.perf_counter()
    device = initialize_distributed(args)
    groups = TrainGroups.from_parallel_state()
    chunks, optimizer, scheduler = setup_model_and_optimizer(args, model_provider, groups, device)
    params = count_parameters(chunks, groups)
    print_rank_0(
        f" > model: {params:,} parameters in {len(chunks)} chunk(s) per rank; layout "
        f"tp {args.tensor_model_parallel_size} × pp {args.pipeline_model_parallel_size} × dp "
        f"{args.data_parallel_size}"
        + (
            f", {args.virtual_pipeline_model_parallel_size} virtual stages per rank"
            if args.virtual_pipeline_model_parallel_size
            else ""
        )
        + f"; {args.num_microbatches} microbatches of {args.micro_batch_size} per iteration"
    )
    trainer = Trainer(args, forward_step_func, chunks, optimizer, scheduler, groups, device)
    if args.load:
        trainer.state = checkpoints.load(args, chunks, optimizer, scheduler, groups)
    state = trainer.state

    gbs = args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    num_samples = [
        args.train_iters * gbs,
        max(1, evaluations * args.eval_iters) * gbs,
        max(1, args.eval_iters) * gbs,
    ]
    train_ds, valid_ds, test_ds = rank0_first(lambda: datasets_provider(args, num_samples))
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    loader = dict(
        micro_batch_size=args.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=args.num_workers,
    )
    train_iterators = None
    if state.iteration < args.train_iters:
        if train_ds is None:
            raise ArgumentsError(f"--split {args.split!r} leaves no documents for training")
        train_iterators = chunk_iterators(
            train_ds, chunks, consumed_samples=state.consumed_train_samples, **loader
        )
    if args.eval_iters:
        trainer.valid_iterators = chunk_iterators(
            valid_ds,
            chunks,
            consumed_samples=state.consumed_valid_samples,
            cyclic=True,
            **loader,
        )
        trainer.test_iterators = chunk_iterators(
            test_ds, chunks, consumed_samples=0, cyclic=True, **loader
        )

    if _is_last_rank():
        path = args.metrics_path or os.path.join(args.save or ".", "metrics.jsonl")
        trainer.writer = MetricsWriter(path, args.tensorboard_dir)
        trainer.writer.write(
            {"kind": "run", "iteration": state.iteration, "args": checkpoint_settings(args)}
        )
    print_rank_0(
        f" > setup took {time.perf_counter() - started:.1f} s; training from iteration "
        f"{state.iteration} to {args.train_iters}"
    )
    try:
        start_iteration = state.iteration
        exited = trainer.train(train_iterators)
        if not exited:
            if args.eval_iters:
                trainer.evaluate("valid", "the end of training for val data")
                trainer.evaluate("test", "the end of training for test data")
            saved_last = args.save_interval and state.iteration % args.save_interval == 0
            if args.save and state.iteration > start_iteration and not saved_last:
                trainer.save()
    finally:
        if trainer.writer is not None:
            trainer.writer.close()
    return state
