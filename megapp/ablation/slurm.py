"""A sweep as a SLURM job array: one array job per point, each a multi-node torchrun.

The first indices are the single-process references (one node, one process each: the
flushed schedules', then PipeDream-2BW's when the sweep has such points); every other index
runs its layout on ``nnodes`` nodes of ``nproc`` processes, one torchrun per node through
``srun`` meeting at the first node (c10d rendezvous), as examples/pretrain_gpt_slurm.sbatch
does.
Each writes ``runs/<name>/metrics.jsonl`` and ``log.txt`` under the sweep directory;
``tools/ablate.py ... --collect`` turns them into records once the array is done.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from pathlib import Path

from megapp.ablation.points import Point, SweepSpec
from megapp.training.launch import PRETRAIN_SCRIPT, REPOSITORY

HEADER = """#!/usr/bin/env bash
# Ablation sweep: {count} array jobs, one per layout ({references}).
# Written by: {command}
# Submit from anywhere:   sbatch {script}
# Then collect records:   {collect}
# Replace the <...> placeholders with your cluster's values.
#SBATCH --job-name=megapp-ablation
#SBATCH --array=0-{last}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={nproc}
#SBATCH --exclusive
#SBATCH --time={time}
#SBATCH --partition=<partition>
#SBATCH --account=<account>
#SBATCH --output={out}/logs/%x-%A_%a.out
set -euo pipefail
cd {root}
"""

BODY = """
# One torchrun per node; the first node of the allocation hosts the rendezvous.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${{MASTER_PORT:-29500}}
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}
RUN_DIR={out}/runs/$NAME
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/metrics.jsonl"
srun --kill-on-bad-exit=1 --nodes "$NNODES" --ntasks "$NNODES" --ntasks-per-node 1 \\
    torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \\
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
    --rdzv-id "megapp-ablation-$SLURM_ARRAY_JOB_ID-$SLURM_ARRAY_TASK_ID" \\
    {pretrain} "${{FLAGS[@]}}" \\
    --metrics-path "$RUN_DIR/metrics.jsonl"{profile} \\
    > "$RUN_DIR/log.txt" 2>&1
"""


def slurm_time(seconds: float) -> str:
    """``HH:MM:SS`` of a SLURM time limit, rounded up to the minute."""
    minutes = max(1, math.ceil(seconds / 60))
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def slurm_script(
    spec: SweepSpec,
    references: Sequence[Point],
    points: Sequence[Point],
    out_dir: Path,
    command: str,
    collect: str,
) -> str:
    """The array job of ``references`` (the single-process runs, the flushed one first)
    then ``points`` for ``spec`` writing under ``out_dir``; ``command`` made it and
    ``collect`` gathers its records."""
    out = shlex.quote(str(Path(out_dir).resolve()))
    count = len(references)
    first = "index 0" if count == 1 else f"indices 0-{count - 1}"
    points = [*references, *points]
    text = HEADER.format(
        count=len(points),
        references=f"{first}: the single-process reference{'s' if count > 1 else ''}",
        command=command,
        script=shlex.quote(str(Path(out_dir) / "sweep.sbatch")),
        collect=collect,
        last=len(points) - 1,
        nnodes=spec.nnodes,
        nproc=spec.nproc,
        time=slurm_time(spec.timeout_s),
        out=out,
        root=shlex.quote(str(REPOSITORY)),
    )
    text += '\ncase "$SLURM_ARRAY_TASK_ID" in\n'
    for index, point in enumerate(points):
        nnodes = spec.nnodes if point.world_size == spec.world_size else 1
        nproc = point.world_size // nnodes
        flags = " ".join(shlex.quote(f) for f in point.flags)
        text += f"  {index}) NAME={point.name} NNODES={nnodes} NPROC={nproc}\n"
        text += f"     FLAGS=({flags}) ;;\n"
    text += '  *) echo "no point $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;\nesac\n'
    profile = f" --profile-iteration {spec.profiled_iteration}"
    return text + BODY.format(out=out, pretrain=PRETRAIN_SCRIPT.name, profile=profile)
