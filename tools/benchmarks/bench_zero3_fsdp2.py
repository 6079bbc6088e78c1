"""ZeRO-3 two ways on the same GPT: megapp's own buffers against torch's FSDP2.

    python tools/benchmarks/bench_zero3_fsdp2.py --dp 2 --rounds 5

megapp: ``build_training_setup(zero_stage=3)`` (megapp's optimizer, gradient slices,
layer-wise gathers with prefetch). FSDP2: ``fully_shard`` on every transformer layer and
on the chunk over the data-parallel group, torch's AdamW (foreach) on the sharded
parameters, gradients accumulated over the microbatches. Both fp32, tp = pp = 1, the same
model, data and microbatches; rounds alternate between the two (``common.interleaved``)
so load that drifts falls on both. Reported per rank: median step time, bytes one rank
sends per step (ring model of the collectives issued over the data-parallel group), and
model-state bytes held after a step (weights, gradients, optimizer states: sums of the
storages actually allocated).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from zero_memory import forward_step, gpt_config, random_batches, sent_bytes

from megapp import parallel_state as ps
from megapp.benchmarks import common
from megapp.models.gpt import GPTModel
from megapp.testing import collective_count
from megapp.training import train_step
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.setup import build_training_setup


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _megapp(s: dict):
    ps.initialize_model_parallel(1, 1)
    setup = build_training_setup(
        gpt_config(s),
        OptimizerArgs(lr=1e-4, lr_decay_iters=100, lr_decay_style="constant", clip_grad=0.0),
        bucket_size=1_000_000,
        zero_stage=3,
    )
    (chunk,), m = setup.chunks, s["microbatches"]

    def step(batches) -> None:
        train_step(
            forward_step, [iter(batches)], setup.chunks, setup.optimizer,
            num_microbatches=m, groups=setup.groups,
        )  # fmt: skip

    def held() -> int:
        return (
            chunk.sharded_params.weight_bytes()
            + chunk.grad_bytes()
            + (setup.optimizer.state_bytes())
        )

    return step, held


def _fsdp2(s: dict):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPTModel(gpt_config(s), seed=1234)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    m = s["microbatches"]

    def step(batches) -> None:
        for tokens, labels in batches:
            (model(tokens, labels=labels).float().mean() / m).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    def held() -> int:
        params = [p.to_local() for p in model.parameters()]
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        states = [
            (t.to_local() if hasattr(t, "to_local") else t)
            for state in optimizer.state.values()
            for t in state.values()
            if t.dim() > 0
        ]
        return _bytes(params) + _bytes(grads) + _bytes(states)

    return step, held


def measure(settings: dict) -> dict:
    """Both implementations on this rank, rounds interleaved; per implementation the step
    times, bytes sent per step and model-state bytes after the last step."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(dist.get_rank())
    impls = {"megapp ZeRO-3": _megapp(settings), "FSDP2": _fsdp2(settings)}
    out = {name: {"times": [], "sent": 0.0} for name in impls}
    for step, _ in impls.values():
        step(random_batches(settings, generator))  # warm-up: optimizer states, first gathers

    def timed(name: str):
        def run() -> float:
            recorder = collective_count.Recorder()
            batches = random_batches(settings, generator)
            start = time.perf_counter()
            with collective_count.intercept(recorder):
                impls[name][0](batches)
            seconds = time.perf_counter() - start
            out[name]["sent"] = sent_bytes(recorder, dist.get_world_size())
            return seconds

        return run

    times = common.interleaved({name: timed(name) for name in impls}, settings["rounds"])
    for name, (_, held) in impls.items():
        out[name]["times"] = times[name]
        out[name]["held"] = held()
    return out


def main() -> None:
    args = parse_args()
    print(f"$ {common.command_line()}")
    print(f"machine: {common.machine()}; load {common.load_average()}")
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    with common.Ranks(args.dp, threads=1) as ranks:
        per_rank = ranks.run_all(measure, settings)
    rank0 = per_rank[0]
    base = statistics.median(rank0["megapp ZeRO-3"]["times"])
    rows = []
    for name, result in rank0.items():
        median = statistics.median(result["times"])
        rows.append(
            [
                name,
                f"{1e3 * median:.0f}",
                f"{median / base:.2f}",
                f"{result['sent'] / 2**20:.1f}",
                f"{result['held'] / 2**20:.2f}",
            ]
        )
    phi = sum(p.numel() for p in GPTModel(gpt_config(settings)).parameters())
    print(f"model: {phi:,} parameters, fp32; dp {args.dp}; {args.microbatches} microbatches")
    header = ["implementation", "step ms (median)", "vs megapp", "MiB sent/step",
              "model-state MiB held"]  # fmt: skip
    print(common.markdown_table(header, rows, "lrrrr"))
    if args.json:
        common.write_json(args.json, {"command": common.command_line(), "ranks": per_rank})


if __name__ == "__main__":
    main()
