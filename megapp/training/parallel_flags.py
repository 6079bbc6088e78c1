"""The layout and pipeline flags of ``pretrain_gpt.py`` (Megatron's distributed flags)."""

from __future__ import annotations

from dataclasses import dataclass

from megapp.pipeline_parallel.catalog import ASYNC_SCHEDULES, SCHEDULES
from megapp.training.flag_groups import ArgumentsError, arg, require_positive


@dataclass(frozen=True)
class ParallelArgs:
    """How the ranks are laid out (Megatron's distributed flags)."""

    tensor_model_parallel_size: int = arg(1, "ranks that split every layer")
    pipeline_model_parallel_size: int = arg(1, "pipeline stages")
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, "layers per virtual stage; interleaves the pipeline schedule", kind=int
    )
    pipeline_schedule: str | None = arg(
        None,
        "default 1f1b, interleaved-1f1b with virtual stages; zb-v and dualpipev place two "
        "chunks per rank in a V; auto times one zb-h1 iteration and searches; pipedream and "
        "pipedream-2bw never flush and step each stage on its own (a different update rule)",
        kind=str,
        choices=(*SCHEDULES, *ASYNC_SCHEDULES, "auto"),
    )
    vertical_sync: bool = arg(
        False, "pipedream: every stage runs a microbatch on the weights the first stage used"
    )
    pipeline_flush_interval: int = arg(
        8,
        "pipedream, pipedream-2bw: iterations run between two flushes of the pipeline "
        "(fewer before an evaluation, a checkpoint, an exit or a profiled iteration)",
    )
    microbatch_group_size_per_virtual_pipeline_stage: int | None = arg(
        None, "interleaved-1f1b: microbatches per group (default: from --pp up)", kind=int
    )
    sequence_parallel: bool = arg(False, "split activations outside tp regions by sequence")
    use_distributed_optimizer: bool = arg(False, "shard optimizer states over dp (ZeRO-1)")
    zero_stage: int = arg(
        0,
        "ZeRO stage: 1 shards optimizer states over dp (as --use-distributed-optimizer), "
        "2 also the gradients, 3 also the weights (gathered per layer)",
        choices=(0, 1, 2, 3),
    )
    ddp_bucket_size: int = arg(40_000_000, "elements per data-parallel gradient bucket")
    distributed_backend: str | None = arg(
        None, "default: nccl when CUDA is available, else gloo", choices=("nccl", "gloo")
    )
    distributed_timeout_minutes: float = arg(
        10.0, "how long a collective waits for a dead or stuck rank before the job fails"
    )

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "num_layers_per_virtual_pipeline_stage",
                "microbatch_group_size_per_virtual_pipeline_stage",
                "ddp_bucket_size",
                "pipeline_flush_interval",
            ),
        )
        if not self.distributed_timeout_minutes > 0:
            raise ArgumentsError(
                f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}"
            )
