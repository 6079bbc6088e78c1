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

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp.parallel_state import TrainGroups
from megapp.pipeline_parallel.compute import ForwardStepFunc
from megapp.pipeline_parallel.p2p import TensorSpec
from megapp.pipeline_parallel.weight_stash import WeightStash
from megapp.training import checkpoints, hf_start
from megapp.training.arguments import metrics_path
from megapp.training.async_step import run_length, train_run
from megapp.training.auto_schedule import choose_schedule
from megapp.training.checkpoints import TrainState
from megapp.training.config import PretrainConfig
from megapp.training.data_iterators import chunk_iterators, rank0_first
from megapp.training.evaluate import evaluate
from megapp.training.flag_groups import ArgumentsError
from megapp.training.initialize import (
    count_parameters,
    initialize_distributed,
    print_rank_0,
    start_up_timeout,
)
from megapp.training.iteration_profile import (
    MemoryIteration,
    RankProfile,
    TimedIteration,
    profile_record,
)
from megapp.training.live_memory import refusing_out_of_memory
from megapp.training.metrics import (
    MetricsWriter,
    format_eval_lines,
    format_train_line,
    peak_tflops,
    perplexity,
)
from megapp.training.setup import TrainingSetup, build_training_setup
from megapp.training.step import TrainStepResult, train_step

DatasetsProvider = Callable[[PretrainConfig, Sequence[int]], tuple[Any, Any, Any]]
"""``(config, [train, valid, test] sample counts) -> (train, valid, test)`` datasets (or None)."""
ModelProvider = Callable[[PretrainConfig, TrainGroups], list[nn.Module]]
"""``(config, groups) -> this rank's model chunks`` (chunk ``c`` is virtual stage
``c·pp + rank``)."""


def pipeline_tensor_shapes(config: PretrainConfig) -> list[TensorSpec]:
    """What one pipeline stage sends the next, fixed for the whole run (Megatron's p2p shape):
    the hidden states ``[s/cp, b, h]`` (``[s/(cp·tp), b, h]`` with sequence parallelism)
    in the model's dtype. Declared, they spare every step a header exchange; a stage that
    sends anything else fails with a message naming both shapes."""
    seq = config.model.seq_length // config.parallel.context_parallel_size
    if config.parallel.sequence_parallel:
        seq //= config.parallel.tensor_model_parallel_size
    shape = (seq, config.training.micro_batch_size, config.model.hidden_size)
    return [TensorSpec(shape, config.precision.params_dtype)]


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
    profiled: bool = False  # an iteration of it measured memory
    moe_sums: dict = field(default_factory=dict)  # auxiliary losses, summed per name


class Trainer:
    """The loop's state and its periodic duties (log, evaluate, save)."""

    def __init__(
        self,
        config: PretrainConfig,
        forward_step_func: ForwardStepFunc,
        setup: TrainingSetup,
        device: torch.device,
        flops_per_iteration: float,
    ):
        self.config, self.forward_step_func = config, forward_step_func
        self.setup, self.device, self.flops = setup, device, flops_per_iteration
        self.state = TrainState()
        self.writer: MetricsWriter | None = None
        self.peak = peak_tflops(device, config.precision.params_dtype)
        self.valid_iterators = self.test_iterators = None
        self.tensor_shapes = pipeline_tensor_shapes(config)
        self.schedule = config.schedule
        self.searching = config.parallel.pipeline_schedule == "auto"  # times the first
        # the weight versions an asynchronous schedule keeps between its runs
        self.stash = WeightStash() if self.schedule.asynchronous else None

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def train(self, train_iterators) -> bool:
        """Train to ``--train-iters``; True when ``--exit-interval`` stopped it early."""
        config, state, interval = self.config, self.state, _Interval()
        training, logging, ckpt = config.training, config.logging, config.checkpoint
        while state.iteration < training.train_iters:
            with self._profiling(state.iteration + 1) as measuring:
                start = self._sync()
                results = self._run(train_iterators, measuring)
                seconds = (self._sync() - start) / len(results)
            self._after_profiling(measuring, results[0][0].events, state.iteration + 1)
            for result, lr in results:
                interval.seconds += seconds
                interval.profiled |= isinstance(measuring, MemoryIteration)
                if self.searching:
                    self.schedule, line = choose_schedule(self.schedule, result.events, seconds)
                    self.searching = False
                    print_rank_0(line)
                state.iteration += 1
                state.consumed_train_samples += training.global_batch_size
                interval.iterations += 1
                interval.skipped += int(result.skipped)
                if not math.isfinite(result.loss):
                    interval.nan += 1
                elif not result.skipped:
                    interval.advanced += 1
                    interval.loss_sum += result.loss
                    for name, value in result.moe_losses.items():
                        interval.moe_sums[name] = interval.moe_sums.get(name, 0.0) + value
                if state.iteration % logging.log_interval == 0:
                    self.log(interval, lr, result.grad_norm)
                    interval = _Interval()
            if logging.eval_iters and state.iteration % logging.eval_interval == 0:
                self.evaluate("valid", f"iteration {state.iteration}")
            saved = False
            if ckpt.save_interval and state.iteration % ckpt.save_interval == 0:
                self.save()
                saved = True
            if training.exit_interval and state.iteration % training.exit_interval == 0:
                if ckpt.save and not saved:
                    self.save()
                print_rank_0(f" > exiting after iteration {state.iteration} (--exit-interval)")
                return True
        return False

    def _run(self, train_iterators, measuring) -> list[tuple[TrainStepResult, float]]:
        """The next iteration, or with an asynchronous schedule the next run of them
        (:mod:`~megapp.training.async_step`): each one's result and learning rate."""
        config, setup = self.config, self.setup
        record = self.searching or isinstance(measuring, TimedIteration)
        if not self.schedule.asynchronous:
            lr = setup.optimizer.param_groups[0]["lr"]  # the rate this iteration applies
            result = train_step(
                self.forward_step_func,
                train_iterators,
                setup.chunks,
                setup.optimizer,
                num_microbatches=config.num_microbatches,
                groups=setup.groups,
                schedule=self.schedule,
                lr_scheduler=setup.scheduler,
                tensor_shapes=self.tensor_shapes,
                record=record,
            )
            return [(result, lr)]
        return train_run(
            self.forward_step_func,
            train_iterators,
            setup.chunks,
            setup.optimizer,
            schedule=self.schedule,
            iterations=run_length(config, self.state.iteration),
            groups=setup.groups,
            stash=self.stash,
            lr_scheduler=setup.scheduler,
            tensor_shapes=self.tensor_shapes,
            record=record,
        )

    def _profiling(self, iteration: int):
        """What measures ``iteration`` for ``--profile-iteration``: its timeline, or the
        next one's memory, or nothing."""
        target = self.config.logging.profile_iteration
        if target is None or iteration not in (target, target + 1):
            return contextlib.nullcontext()
        if iteration == target:
            groups = self.setup.groups
            self.profile = RankProfile(
                dist.get_rank() if dist.is_initialized() else 0,
                tp=comm.rank(groups.tp),
                pp=comm.rank(groups.pp),
                dp=comm.rank(groups.dp),
            )
            return TimedIteration(self.profile)
        resized = [s for chunk in self.setup.chunks for s in chunk.resized_storages()]
        return MemoryIteration(self.profile, resized)

    def _after_profiling(self, measuring, events, iteration: int) -> None:
        if isinstance(measuring, TimedIteration):
            measuring.keep_events(events)
        if not isinstance(measuring, MemoryIteration):
            return
        world = dist.group.WORLD if dist.is_initialized() else None
        profiles = comm.all_gather_object(self.profile, world)
        if self.writer is not None:
            self.writer.write(profile_record(iteration - 1, profiles))

    def log(self, interval: _Interval, lr: float, grad_norm: float) -> None:
        config = self.config
        seconds = interval.seconds / interval.iterations
        tflops = self.flops / seconds / config.world_size / 1e12
        scaler = self.setup.optimizer.grad_scaler
        tokens = config.training.global_batch_size * config.model.seq_length
        record = {
            "kind": "train",
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_train_samples,
            "elapsed_ms_per_iteration": 1000.0 * seconds,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "tokens_per_second_per_device": tokens / seconds / config.world_size,
            "learning_rate": lr,
            "global_batch_size": config.training.global_batch_size,
            "lm_loss": interval.loss_sum / interval.advanced if interval.advanced else None,
            "loss_scale": scaler.scale_value if scaler is not None else 1.0,
            "grad_norm": grad_norm,
            "skipped_iterations": interval.skipped,
            "nan_iterations": interval.nan,
        }
        if interval.profiled:  # its per-operator memory bookkeeping slowed it down
            record["profiled"] = True
        # a mixture-of-experts model's auxiliary losses, as Megatron prints them
        moe = {name: value / interval.advanced for name, value in interval.moe_sums.items()}
        record.update(moe)
        if self.writer is not None:
            self.writer.write(record)
            line = format_train_line(record, config.training.train_iters)
            line += "".join(f" {name}: {value:.6E} |" for name, value in moe.items())
            print(line, flush=True)

    def evaluate(self, split: str, where: str) -> None:
        iterators = self.valid_iterators if split == "valid" else self.test_iterators
        if iterators is None:
            return
        config = self.config
        loss = evaluate(
            self.forward_step_func,
            iterators,
            self.setup.chunks,
            num_microbatches=config.num_microbatches,
            eval_iters=config.logging.eval_iters,
            groups=self.setup.groups,
            schedule=self.schedule,
            tensor_shapes=self.tensor_shapes,
        )
        if split == "valid":
            self.state.consumed_valid_samples += (
                config.logging.eval_iters * config.training.global_batch_size
            )
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
        path = checkpoints.save(self.config, self.state, self.setup)
        if self.writer is not None:
            record = {"kind": "checkpoint", "iteration": self.state.iteration, "path": str(path)}
            self.writer.write(record)


def _describe_layout(config: PretrainConfig, setup: TrainingSetup) -> str:
    parallel = config.parallel
    vpp = config.virtual_pipeline_model_parallel_size
    params = count_parameters(setup.chunks, setup.groups)
    cp = parallel.context_parallel_size
    return (
        f" > model: {params:,} parameters in {len(setup.chunks)} chunk(s) per rank; layout "
        f"tp {parallel.tensor_model_parallel_size}"
        + (f" × cp {cp} ({parallel.cp_comm_type})" if cp > 1 else "")
        + f" × pp {parallel.pipeline_model_parallel_size} × dp {config.data_parallel_size}"
        + (f", {vpp} virtual stages per rank" if vpp else "")
        + f"; {config.num_microbatches} microbatches of {config.training.micro_batch_size} per "
        "iteration"
    )


def pretrain(
    config: PretrainConfig,
    datasets_provider: DatasetsProvider,
    model_provider: ModelProvider,
    forward_step_func: ForwardStepFunc,
    *,
    flops_per_iteration: float = 0.0,
) -> TrainState:
    """Train as ``config`` says. Starts torch.distributed and the layout
    (:func:`~megapp.training.initialize.initialize_distributed`); the caller tears them
    down. ``flops_per_iteration``: the model FLOPs of one iteration, for the log's TFLOP/s
    and MFU. Returns the final state.
    """
    started = time.perf_counter()
    device = initialize_distributed(config)
    with (
        start_up_timeout(config, "the other ranks to build the model"),
        refusing_out_of_memory(device, "building the model and its optimizer"),
    ):
        setup = build_training_setup(
            lambda groups: model_provider(config, groups),
            config.optimizer,
            precision=config.precision,
            bucket_size=config.parallel.ddp_bucket_size,
            zero_stage=config.parallel.zero_stage,
            overlap_grad_reduce=config.parallel.overlap_grad_reduce,
            device=device,
            per_stage_steps=config.schedule.asynchronous,
        )
        print_rank_0(_describe_layout(config, setup))  # counts parameters over the groups
    trainer = Trainer(config, forward_step_func, setup, device, flops_per_iteration)
    if config.checkpoint.load:
        trainer.state = checkpoints.load(config, setup)
    state = trainer.state
    ckpt = config.checkpoint
    hf_type = ckpt.hf_model_type
    if ckpt.load_hf:
        hf_type = hf_type or hf_start.model_type(ckpt.load_hf)
        if state.iteration == 0:  # nothing resumed: start from the Hugging Face weights
            hf_start.load(config, setup, hf_type)
    hf_start.prepare(config)  # the model's Hugging Face config travels with its checkpoints

    training, logging = config.training, config.logging
    gbs = training.global_batch_size
    evaluations = training.train_iters // logging.eval_interval + 1
    num_samples = [
        training.train_iters * gbs,
        max(1, evaluations * logging.eval_iters) * gbs,
        max(1, logging.eval_iters) * gbs,
    ]
    with start_up_timeout(config, "the datasets (rank 0 builds their indexes first)"):
        train_ds, valid_ds, test_ds = rank0_first(lambda: datasets_provider(config, num_samples))
    loader = dict(
        micro_batch_size=training.micro_batch_size,
        dp_rank=comm.rank(setup.groups.dp),
        dp_size=comm.world_size(setup.groups.dp),
        num_workers=config.data.num_workers,
    )
    chunks = setup.chunks
    train_iterators = None
    if state.iteration < training.train_iters:
        if train_ds is None:
            raise ArgumentsError(f"--split {config.data.split!r} leaves no documents for training")
        train_iterators = chunk_iterators(
            train_ds, chunks, consumed_samples=state.consumed_train_samples, **loader
        )
    if logging.eval_iters:
        trainer.valid_iterators = chunk_iterators(
            valid_ds, chunks, consumed_samples=state.consumed_valid_samples, cyclic=True, **loader
        )
        trainer.test_iterators = chunk_iterators(
            test_ds, chunks, consumed_samples=0, cyclic=True, **loader
        )

    if _is_last_rank():
        trainer.writer = MetricsWriter(metrics_path(config), logging.tensorboard_dir)
        trainer.writer.write(
            {"kind": "run", "iteration": state.iteration, "config": config.to_dict()}
        )
    print_rank_0(
        f" > setup took {time.perf_counter() - started:.1f} s; training from iteration "
        f"{state.iteration} to {training.train_iters}"
    )
    try:
        start_iteration = state.iteration
        exited = trainer.train(train_iterators)
        if not exited:
            if logging.eval_iters:
                trainer.evaluate("valid", "the end of training for val data")
                trainer.evaluate("test", "the end of training for test data")
            save_interval = config.checkpoint.save_interval
            saved_last = save_interval and state.iteration % save_interval == 0
            if config.checkpoint.save and state.iteration > start_iteration and not saved_last:
                trainer.save()
            if ckpt.save_hf:
                hf_start.save(config, setup, hf_type)
    finally:
        if trainer.writer is not None:
            trainer.writer.close()
    return state
