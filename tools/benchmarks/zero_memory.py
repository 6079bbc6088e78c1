"""Model-state memory per rank under ZeRO stages 0 to 3, measured against the formula,
with the step time and the bytes each rank sends.

    python tools/benchmarks/zero_memory.py --dp 1 2 4 --stages 0 1 2 3 --dtype bf16

For each (dp, stage) a GPT of a few million parameters (tp = pp = 1) trains a few steps on
a spawned gloo world; on every rank the tool sums the storages actually allocated:
weights (the flat parameter buffer, or ZeRO-3's slices and whatever is gathered),
gradients (``main_grad`` buffer, or ZeRO-2's slices), optimizer states (AdamW moments and
fp32 masters), all after a step. The formula, for Φ parameters and data-parallel size N,
with megapp's fp32 gradients:

    weights  w·Φ, or w·Φ/N at stage 3 (w = 2 for bf16/fp16, 4 for fp32)
    grads    4Φ, or 4Φ/N at stage 2
    states   (8 + m)Φ, or /N from stage 1 (m = 4 for fp32 masters of a 16-bit model, else 0)

Buckets are padded to a multiple of N; that padding is the measured excess. Time: the median
step time over the timed steps (no sleeps: real CPU compute and gloo communication), and
the bytes one rank sends per step (ring model of each collective it issued).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megapp import parallel_state as ps
from megapp.benchmarks import common
from megapp.models.gpt import GPTConfig
from megapp.planning import model_state
from megapp.testing import collective_count
from megapp.training import train_step
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.setup import build_training_setup

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4, help="per rank per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warmup)")
    parser.add_argument("--bucket-size", type=int, default=1_000_000)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def forward_step(iterator, chunk, inputs):
    """One microbatch of (tokens, labels): its mean per-token loss."""
    tokens, labels = next(iterator)
    loss = chunk(input_ids=tokens, labels=labels)
    return loss, lambda per_token: per_token.float().mean()


def gpt_config(settings: dict, dtype: torch.dtype = torch.float32) -> GPTConfig:
    """The measured GPT (tp = pp = 1, no dropout) of the tool's size settings."""
    return GPTConfig(
        num_layers=settings["layers"],
        hidden_size=settings["hidden"],
        num_attention_heads=8,
        vocab_size=settings["vocab"],
        max_position_embeddings=settings["seq"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
    )


def random_batches(settings: dict, generator: torch.Generator) -> list:
    """One step's microbatches of 2 random sequences, as (tokens, labels)."""
    m, seq = settings["microbatches"], settings["seq"]
    data = torch.randint(0, settings["vocab"], (m, 2, seq + 1), generator=generator)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def sent_bytes(recorder: collective_count.Recorder, world: int) -> float:
    """Bytes one rank sent in the recorded collectives over a group of ``world`` ranks."""
    return sum(
        collective_count.wire_bytes(op.kind, op.payload, op.world)
        for op in recorder.ops
        if op.world == world and op.kind in ("AR", "AG", "RS")
    )


def measure(settings: dict) -> dict:
    """One rank's bytes and timings for one (dp, stage)."""
    dp = settings["dp"]
    ps.initialize_model_parallel(1, 1)
    config = gpt_config(settings, DTYPES[settings["dtype"]])
    setup = build_training_setup(
        config,
        OptimizerArgs(lr=1e-4, lr_decay_iters=100, lr_decay_style="constant"),
        bucket_size=settings["bucket_size"],
        zero_stage=settings["stage"],
    )
    (chunk,), optimizer = setup.chunks, setup.optimizer
    g = torch.Generator().manual_seed(ps.get_data_parallel_rank())

    def step() -> None:
        train_step(
            forward_step,
            [iter(random_batches(settings, g))],
            setup.chunks,
            optimizer,
            num_microbatches=settings["microbatches"],
            groups=setup.groups,
        )

    step()  # creates the AdamW states
    recorder = collective_count.Recorder()
    times = []
    for _ in range(settings["steps"]):
        start = time.perf_counter()
        with collective_count.intercept(recorder):
            step()
        times.append(time.perf_counter() - start)
    phi = sum(p.numel() for p in chunk.buffer.params)
    sent = sent_bytes(recorder, dp)
    data = chunk.buffer.param_data
    weights = (
        chunk.sharded_params.weight_bytes()
        if chunk.sharded_params is not None
        else data.numel() * data.element_size()
    )
    return {
        "phi": phi,
        "phi_layers": sum(p.numel() for p in chunk.module.decoder.layers.parameters()),
        "padded": chunk.buffer.buckets[-1].end,
        "weights": weights,
        "grads": chunk.grad_bytes(),
        "states": optimizer.state_bytes(),
        "step_s": statistics.median(times),
        "sent_bytes_per_step": sent / settings["steps"],
    }


def formula(phi: int, dp: int, stage: int, dtype: str) -> dict:
    """The planner's model state (:func:`megapp.planning.model_state`) of ``phi`` parameters."""
    state = model_state(phi, DTYPES[dtype], dp, stage)
    return {"weights": state.weights, "grads": state.grads, "states": state.optimizer}


def main() -> None:
    args = parse_args()
    print(f"$ {common.command_line()}")
    print(f"machine: {common.machine()}; load {common.load_average()}")
    rows, results = [], []
    for dp in args.dp:
        with common.Ranks(dp, threads=1) as ranks:
            for stage in args.stages:
                settings = dict(vars(args), dp=dp, stage=stage)
                settings.pop("json"), settings.pop("stages")
                per_rank = (
                    ranks.run_all(measure, settings)
                    if ranks.world
                    else [ranks.run(measure, settings)]
                )
                ours = per_rank[0]
                expected = formula(ours["phi"], dp, stage, args.dtype)
                measured_total = sum(ours[k] for k in expected)
                expected_total = sum(expected.values())
                excess = 100 * (measured_total - expected_total) / expected_total
                rows.append(
                    [
                        str(dp),
                        str(stage),
                        *(f"{ours[k] / 2**20:.2f} / {expected[k] / 2**20:.2f}" for k in expected),
                        f"{excess:+.2f}%",
                        f"{(ours['padded'] - ours['phi'])}",
                        f"{1e3 * ours['step_s']:.0f}",
                        f"{ours['sent_bytes_per_step'] / 2**20:.1f}",
                    ]
                )
                results.append({"dp": dp, "stage": stage, "ranks": per_rank, "formula": expected})
    print(
        f"model: {results[0]['ranks'][0]['phi']:,} parameters, {args.dtype}; MiB measured / formula"
    )
    header = ["dp", "stage", "weights", "grads", "optimizer states", "total vs formula",
              "padding elements", "step ms", "MiB sent/step"]  # fmt: skip
    print(common.markdown_table(header, rows))
    if args.json:
        common.write_json(args.json, {"command": common.command_line(), "results": results})


if __name__ == "__main__":
    main()
