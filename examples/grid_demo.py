"""Lay out a DP × TP × PP grid on real processes and exercise every group.

    torchrun --nproc-per-node 8 examples/grid_demo.py --tp 2 --pp 2

Each group all-reduces its members' ranks and each pipeline passes a token
one stage forward; rank 0 prints the layout and what every group computed.
"""

import argparse
import os

import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.process_grid import GROUP_NAMES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1, dest="tp")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1, dest="pp")
    parser.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", type=int, dest="vpp")
    parser.add_argument("--order", default="tp-dp-pp")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else "cpu"
    )
    if backend == "nccl":
        torch.cuda.set_device(device)
    grid = ps.initialize_model_parallel(args.tp, args.pp, args.vpp, order=args.order)
    if rank == 0:
        print(grid.describe(), flush=True)

    # Every group sums its members' ranks; the result must match the grid's arithmetic.
    report = {}
    for name in GROUP_NAMES:
        members = grid.group_of(name, rank)
        if not members:
            continue
        total = torch.tensor([float(rank)], device=device)
        dist.all_reduce(total, group=ps.get_group(name))
        if total.item() != sum(members):
            raise RuntimeError(f"rank {rank}: {name} group {members} summed to {total.item()}")
        report[name] = members

    # One step along the pipeline ring: receive the previous stage's rank.
    received = torch.tensor([-1.0], device=device)
    if grid.pp > 1:
        ops = [
            dist.P2POp(
                dist.isend,
                torch.tensor([float(rank)], device=device),
                grid.next_pipeline_rank(rank),
            ),
            dist.P2POp(dist.irecv, received, grid.prev_pipeline_rank(rank)),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        assert received.item() == grid.prev_pipeline_rank(rank)

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (report, received.item()))
    if rank == 0:
        print(f"\nevery group all-reduced over exactly its members ({backend}):")
        for r, (groups, prev) in enumerate(reports):
            line = "  ".join(f"{n}={g}" for n, g in groups.items())
            hop = f"  received {int(prev)} from the previous stage" if prev >= 0 else ""
            print(f"  rank {r}: {line}{hop}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
