"""The layout and pipeline flags of ``pretrain_gpt.py`` (Megatron's distributed flags)."""

from __future__ import annotations

from dataclasses import dataclass

from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS
from megapp.training.flag_groups import ArgumentsError, arg, require_positive


@dataclass(frozen=True)
class ParallelArgs:
    """How the ranks are laid out (Megatron's distributed flags)."""

    tensor_model_parallel_size: int = arg(1, "ranks that split every layer")
    pipeline_model_parallel_size: int = arg(1, "pipeline stages")
    context_parallel_size: int = arg(
        1, "ranks that split every sequence (attention is the one place they talk)"
    )
    cp_comm_type: str = arg(
        "p2p",
        "how attention reaches the other context-parallel ranks' keys and values: p2p (a "
        "ring, overlapped), all_gather (gathered once per layer), a2a (Ulysses: trades the "
        "sequence for heads)",
        choices=("p2p", "all_gather", "a2a"),
    )
    expert_model_parallel_size: int = arg(
        1, "ranks that split the experts of mixture-of-experts layers (needs --num-experts)"
    )
    expert_tensor_parallel_size: int | None = arg(
        None,
        "ranks that split each expert's matrices; default --tensor-model-parallel-size",
        kind=int,
    )
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, "layers per virtual stage; interleaves the pipeline schedule", kind=int
    )
    num_virtual_stages_per_pipeline_rank: int | None = arg(
        None,
        "model chunks per pipeline rank: virtual stages asked for by count (the way that "
        "works with --decoder-first/last-pipeline-num-layers)",
        kind=int,
    )
    decoder_first_pipeline_num_layers: int | None = arg(
        None,
        "layers on the first pipeline rank (split evenly over its chunks); the ranks without "
        "a count split the rest evenly",
        kind=int,
    )
    decoder_last_pipeline_num_layers: int | None = arg(
        None, "layers on the last pipeline rank, as --decoder-first-pipeline-num-layers", kind=int
    )
    account_for_embedding_in_pipeline_split: bool = arg(
        False,
        "count the embedding as a layer where the layers split over the virtual stages: the "
        "first holds one transformer layer fewer (none with one layer per virtual stage)",
    )
    account_for_loss_in_pipeline_split: bool = arg(
        False,
        "count the output layer and the loss as a layer: the last virtual stage holds "
        "one transformer layer fewer",
    )
    pipeline_schedule: str | None = arg(
        None,
        "default 1f1b, interleaved-1f1b with virtual stages; zb-v and dualpipev place two "
        "chunks per rank in a V (no virtual-stage flag needed); auto times one zb-h1 "
        "iteration and searches; pipedream and pipedream-2bw never flush and step each "
        "stage on its own (a different update rule)",
        kind=str,
        choices=(*SCHEDULE_KINDS, "auto"),
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
    tp_comm_overlap: bool = arg(
        False,
        "with --sequence-parallel: run each linear layer's all-gather or reduce-scatter "
        "against its matmul, cut into pieces (Megatron-Core's flag; it runs Transformer "
        "Engine's userbuffers, megapp its own ring)",
    )
    use_distributed_optimizer: bool = arg(
        False, "shard optimizer states over dp (ZeRO-1): Megatron's name for --zero-stage 1"
    )
    zero_stage: int = arg(
        0,
        "ZeRO stage: 1 shards optimizer states over dp (as --use-distributed-optimizer), "
        "2 also the gradients, 3 also the weights (gathered per layer)",
        choices=(0, 1, 2, 3),
    )
    ddp_bucket_size: int = arg(40_000_000, "elements per data-parallel gradient bucket")
    overlap_grad_reduce: bool = arg(
        True,
        "reduce each data-parallel gradient bucket as soon as the last microbatch's backward "
        "fills it; --no-overlap-grad-reduce reduces them all after that backward, as "
        "Megatron-LM's --DDP-impl local did (ZeRO 2 and 3 reduce every microbatch's "
        "gradients inside its backward either way)",
    )
    distributed_backend: str | None = arg(
        None, "default: nccl when CUDA is available, else gloo", choices=("nccl", "gloo")
    )
    strict_p2p: bool = arg(
        False,
        "gloo: run the pipeline's messages under NCCL's point-to-point rules (a "
        "communicator's operations one at a time in posting order, a send done once its "
        "receive runs), so a schedule that would deadlock on GPUs deadlocks here too",
    )
    distributed_timeout_minutes: float = arg(
        10.0, "how long a collective waits for a dead or stuck rank before the job fails"
    )

    def __post_init__(self) -> None:
        require_positive(
            self,
            (
                "num_layers_per_virtual_pipeline_stage",
                "num_virtual_stages_per_pipeline_rank",
                "microbatch_group_size_per_virtual_pipeline_stage",
                "ddp_bucket_size",
                "pipeline_flush_interval",
                "expert_model_parallel_size",
                "expert_tensor_parallel_size",
            ),
        )
        by_layers = self.num_layers_per_virtual_pipeline_stage is not None
        if by_layers and self.num_virtual_stages_per_pipeline_rank is not None:
            raise ArgumentsError(
                "--num-layers-per-virtual-pipeline-stage and "
                "--num-virtual-stages-per-pipeline-rank both ask for virtual stages; give one"
            )
        uneven = (self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)
        counted = self.account_for_embedding_in_pipeline_split
        counted = counted or self.account_for_loss_in_pipeline_split
        if counted and uneven != (None, None):
            raise ArgumentsError(
                "--decoder-first/last-pipeline-num-layers and "
                "--account-for-embedding/loss-in-pipeline-split both size the end stages; "
                "give one"
            )
        if by_layers and uneven != (None, None):
            raise ArgumentsError(
                "--num-layers-per-virtual-pipeline-stage assumes even stages; with "
                "--decoder-first/last-pipeline-num-layers give "
                "--num-virtual-stages-per-pipeline-rank instead"
            )
        if self.use_distributed_optimizer and self.zero_stage == 0:
            # translated here, once: everything after reads the stage alone
            object.__setattr__(self, "zero_stage", 1)
        if not self.distributed_timeout_minutes > 0:
            raise ArgumentsError(
                f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}"
            )
