"""How many megapp modules one plain training iteration walks through.

A 1F1B iteration on two pipeline ranks runs :meth:`Trainer.train` of
``pretrain_gpt.py``'s model, forward step and data loader under ``sys.setprofile``
and lists the megapp modules whose Python functions ran from entering the loop
until :meth:`~megapp.optimizer.optimizer.Optimizer.step` returned: the map that
docs/iteration.md draws. The limit holds for all of them together; they fall in two
parts, printed apart: the GPT model's own layers (``megapp.models``,
``megapp.transformer``, ``megapp.fusions``, ``megapp.tensor_parallel``, what the model
provider builds) and the iteration around it (loop, data, pipeline engine,
data-parallel gradients, optimizer). ``python tests/test_iteration_path.py`` prints
both.
"""

from __future__ import annotations

import functools
import importlib.util
import shlex
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from megapp.testing import get_world

ROOT = Path(__file__).resolve().parents[1]
FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 1 "
    "--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b --use-default-corpus "
    "--eval-iters 0"
)
VOCAB = 128
MODEL_PACKAGES = (
    "megapp.models.",
    "megapp.transformer.",
    "megapp.fusions.",
    "megapp.tensor_parallel.",
)
# A newcomer follows an iteration, the model's layers included, through this many files at most.
TOTAL_LIMIT = 25


class _Windows(torch.utils.data.Dataset):
    """Token windows of ``seq + 1`` ids, as the GPT dataset returns them."""

    def __init__(self, count: int, seq: int) -> None:
        rng = np.random.default_rng(0)
        self.tokens = rng.integers(1, VOCAB, size=(count, seq + 1), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"tokens": self.tokens[index]}


def load_script(name: str):
    """The script ``ROOT/<name>.py`` as a module, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced_iteration() -> list[str]:
    """Run one iteration on this rank; return the megapp modules it ran, in first-call order."""
    pretrain_gpt = load_script("pretrain_gpt")
    from megapp import parallel_state as ps
    from megapp.optimizer.optimizer import Optimizer
    from megapp.tensor_parallel.random import model_parallel_manual_seed
    from megapp.training.arguments import config_from_flags
    from megapp.training.data_iterators import chunk_iterators
    from megapp.training.pretrain import Trainer
    from megapp.training.setup import build_training_setup

    config = config_from_flags(shlex.split(FLAGS), world_size=2)
    ps.initialize_model_parallel(1, 2)
    model_parallel_manual_seed(config.training.seed)
    setup = build_training_setup(
        lambda groups: pretrain_gpt.model_provider(config, groups, vocab_size=VOCAB),
        config.optimizer,
        precision=config.precision,
        zero_stage=config.parallel.zero_stage,
    )
    step = functools.partial(
        pretrain_gpt.forward_step, eod=0, eod_mask_loss=False, reset_position_ids=False
    )
    trainer = Trainer(config, step, setup, torch.device("cpu"), 0.0)
    iterators = chunk_iterators(
        _Windows(64, config.model.seq_length),
        setup.chunks,
        consumed_samples=0,
        micro_batch_size=config.training.micro_batch_size,
        dp_rank=0,
        dp_size=1,
    )
    seen: dict[str, None] = {}
    done = [False]
    step_code = Optimizer.step.__code__

    def profile(frame, event, arg):
        if done[0] or event not in ("call", "return"):
            return
        name = frame.f_globals.get("__name__", "")
        if event == "call" and (name == "megapp" or name.startswith("megapp.")):
            seen.setdefault(name)
        if event == "return" and frame.f_code is step_code:
            done[0] = True

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        trainer.train(iterators)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert done[0], "the iteration never reached Optimizer.step"
    return list(seen)


def iteration_modules() -> list[list[str]]:
    """Per rank, the megapp modules of one plain 1F1B iteration on two pipeline stages."""
    return get_world(2).run(traced_iteration, timeout=120)


def split(modules: list[str]) -> tuple[list[str], list[str]]:
    """``modules`` as (the iteration's own, the model's)."""
    model = [m for m in modules if m.startswith(MODEL_PACKAGES)]
    return [m for m in modules if m not in model], model


def test_a_plain_1f1b_iteration_passes_through_few_modules():
    per_rank = iteration_modules()
    union = sorted({m for modules in per_rank for m in modules})
    own, model = split(union)
    assert len(union) <= TOTAL_LIMIT, (
        f"{len(union)} modules, {len(own)} of the iteration: {own}; "
        f"{len(model)} of the model: {model}"
    )
    # the loop, the engine, the gradients and the optimizer are all on the path
    for needed in ("training.pretrain", "pipeline_parallel.engine", "distributed.ddp"):
        assert f"megapp.{needed}" in own, needed
    # a 1F1B iteration walks through no split-backward or PipeDream bookkeeping
    for module in union:
        for other in ("deferred", "split_backward", "zero_bubble", "stash", "asynchronous"):
            assert other not in module, module


if __name__ == "__main__":
    ranks = iteration_modules()
    for rank, modules in enumerate(ranks):
        own, model = split(modules)
        print(f"rank {rank}: {len(own)} modules of the iteration, {len(model)} of the model")
        for module in own:
            print(f"  {module}")
        print("  the model's:")
        for module in model:
            print(f"  {module}")
    own, model = split(sorted({m for modules in ranks for m in modules}))
    total = len(own) + len(model)
    print(
        f"both ranks: {len(own)} modules of the iteration + {len(model)} of the model "
        f"= {total} (at most {TOTAL_LIMIT})"
    )
