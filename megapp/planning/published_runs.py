"""Published large-scale Megatron training runs: layout and achieved throughput, as data.

One :class:`PublishedRun` per measured configuration, each with the source its numbers
were read from. A field the source does not state is None (``recompute``,
``micro_batch_size``, ``peak_fraction``); a value derived from stated ones says so in
``derived``.
``model`` names a preset of :data:`megapp.planning.models.MODELS`. Runs the planner
cannot express are listed in :data:`NOT_EXPRESSED` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    """A published configuration. ``gpu``: the accelerator and its memory
    (``a100-80gb``), ``tflops_per_gpu``: achieved TFLOP/s per GPU, ``peak_fraction``: that
    throughput as a fraction of the GPU's peak where the source states it (MFU when
    recompute is not counted), ``step_time``: seconds per
    iteration where stated, ``cp``: context-parallel size, ``ep`` and ``etp``: for
    mixture-of-experts models the expert-parallel ranks and the ranks that split each
    expert (None: tp), ``cp_comm_type``: how its ranks
    exchanged keys and values (megapp's ``--cp-comm-type`` name) where stated,
    ``stage_layers``: the first and the last pipeline rank's layers where the source splits
    the layers unevenly, ``counts_embedding_and_loss``: the source counts the embedding and
    the loss as a layer each where the layers split over the virtual stages (Megatron's
    ``--account-for-embedding/loss-in-pipeline-split``), ``recompute``: "full",
    "selective", "none" or None (not stated),
    ``precision``: the matmul precision the throughput was measured in, ``dispatcher``:
    megapp's name of the mixture-of-experts token dispatcher the run used (DeepEP's
    node-deduplicated dispatch is ``hierarchical``), ``tp_comm_overlap``: the run overlapped
    its tensor-parallel collectives with the matmuls (Megatron-Core's
    ``--tp-comm-overlap``), ``counts_causal_half``: the source's FLOPs count causal
    attention's ``q·kᵀ`` and ``p·v`` over half the ``s × s`` square (Megatron-LM's
    ``num_floating_point_operations`` since 2025, Megatron-Bridge's), where megapp counts the
    whole square as Megatron-LM did before."""

    source: str
    model: str
    gpu: str
    gpus: int
    global_batch_size: int
    seq_length: int
    tp: int
    pp: int
    dp: int
    tflops_per_gpu: float
    cp: int = 1
    cp_comm_type: str | None = None
    ep: int = 1
    etp: int | None = None
    stage_layers: tuple[int, int] | None = None
    counts_embedding_and_loss: bool = False
    vpp: int = 1
    micro_batch_size: int | None = None
    recompute: str | None = None
    distributed_optimizer: bool | None = None
    precision: str = "bf16"
    peak_fraction: float | None = None
    step_time: float | None = None
    sequence_parallel: bool | None = None
    counts_recompute: bool | None = None
    dispatcher: str = "alltoall"
    tp_comm_overlap: bool = False
    counts_causal_half: bool = False
    derived: str = ""

    @property
    def name(self) -> str:
        """A short label: ``gpt3-145b on 1536 a100-80gb``."""
        return f"{self.model} on {self.gpus} {self.gpu}"


NARAYANAN_2021 = (
    "Narayanan et al. 2021 (arXiv:2104.04473) Table 1: throughput from Megatron-LM "
    "README images/cases_april2021.png, layout from examples/sc21/run_table_1.sh"
)
MCORE_H100 = (
    "Megatron-LM README, Training Speed and Scalability (images/model_table.png, commit "
    "f2e5db402c; Megatron-Core r0.8.0 by the figures' legend, whose "
    "num_floating_point_operations counts attention over the whole s × s square)"
)
KORTHIKANTI_2022 = (
    "Korthikanti et al. 2022 (arXiv:2205.05198): layouts from Table 3, iteration times "
    "from Table 5's present work (sequence parallelism with selective recompute); their "
    "model FLOPs utilization as Megatron-LM's README gives it (commit 2e90a342f5), "
    "measured at data-parallel size one"
)
MT_NLG = (
    "Smith et al. 2022 (arXiv:2201.11990) Sec. 2.4, as given in cli99/llm-analysis "
    "examples/megatron-turing-nlg (README.md, run_train.sh)"
)
LLAMA3 = (
    "Dubey et al. 2024 (arXiv:2407.21783) Table 4, the 405B pre-training layouts (also "
    "presented by Balaji at SC'24, listed at glennklockwood.com/garden/llama-3.1)"
)
LLAMA3_NO_CHECKPOINTING = (
    "no recompute: Sec. 3.3.2 states that with its pipeline's memory savings Llama 3 "
    "pre-trained on sequences of 8K tokens without activation checkpointing"
)
LLAMA3_STAGES = (
    "one layer fewer on the first and the last pipeline stage, the first model chunk "
    "holding only the embedding and the last only the output layer and the loss (Dubey et "
    "al. 2024, Sec. 3.3.2): one layer per chunk, so vpp = (126 + 2) / 16 = 8 with the "
    "embedding and the loss counted as layers"
)
NEMO_H100_FP8 = (
    "NeMo Framework performance summary, NeMo 2.0 on DGX-H100 "
    "(docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance_summary.html)"
)
BRIDGE_H100_FP8 = (
    "Megatron-Bridge docs/performance-summary.md, 25.11 NeMo container, DGX-H100 "
    "(NVIDIA-NeMo/Megatron-Bridge)"
)

MOE_ZOO_QWEN3 = (
    "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md, H100 table "
    "(github.com/yanring/Megatron-MoE-ModelZoo, commit e8650517d6; Megatron-Core, "
    "DeepEP or all-to-all dispatcher, BF16)"
)
BRIDGE_H100_2509 = (
    "Megatron-Bridge docs/performance-summary.md, 25.09 NeMo container, DGX-H100 "
    "(NVIDIA-NeMo/Megatron-Bridge commit fa0315ae2; FP8, layouts in "
    "scripts/performance/configs)"
)
QWEN3_STAGES = (
    "94 layers over {chunks} virtual stages, the embedding and the loss each counted as a "
    "layer (--account-for-embedding/loss-in-pipeline-split), leave the first and the last "
    "virtual stage one layer fewer"
)
DEEPSEEK_V3_STAGES = (
    "the recipe's --pipeline-model-parallel-layout 'Et|(tt|)*30mL' (the embedding and one "
    "layer, 30 chunks of two, the multi-token-prediction module and the loss) puts 7, "
    "8 on each of 6, then 6 layers on the pipeline ranks; megapp runs them as one chunk "
    "per rank"
)


MOE_DEV, MAIN = "moe_dev f3e6c5", "main 1e057005"  # the Qwen3 table's code versions


def _qwen3_zoo(
    tp: int,
    ep: int,
    pp: int,
    vpp: int,
    tflops: float,
    seconds: float,
    recompute: str,
    deepep: bool,
    code: str,
) -> PublishedRun:
    dp = 256 // (tp * pp)
    return PublishedRun(
        source=MOE_ZOO_QWEN3,
        model="qwen3-235b-a22b",
        gpu="h100-80gb",
        gpus=256,
        global_batch_size=2048,
        seq_length=4096,
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        etp=1,
        tflops_per_gpu=tflops,
        vpp=vpp,
        counts_embedding_and_loss=True,
        micro_batch_size=1,
        recompute="none",
        distributed_optimizer=True,
        sequence_parallel=True,
        step_time=seconds,
        counts_recompute=False,
        dispatcher="hierarchical" if deepep else "alltoall",
        counts_causal_half=True,
        derived=(
            "causal attention counted at half the square: the stated seconds times the "
            "stated TFLOP/s give 1.236e18 FLOPs a step, megapp's count with half the "
            "square 1.244e18 (with the whole 1.403e18); "
            f"dispatcher {'DeepEP' if deepep else 'all-to-all'} and code {code} as the "
            "table states them; "
            "etp 1, the distributed optimizer and sequence "
            "parallelism from model_configs/benchmarking/Qwen3-235B-A22B.yaml; recompute "
            f"'{recompute}' as the table states it: megapp's layers always rebuild the norms' "
            "and the activations' outputs in backward, which is what Megatron's "
            "--recompute-modules layernorm moe_act selects, so both run as megapp's "
            "recompute none; " + QWEN3_STAGES.format(chunks=pp * vpp)
        ),
    )


def _narayanan(
    model: str, tp: int, pp: int, gpus: int, gbs: int, mbs: int, vpp: int, tflops: float, peak: int
) -> PublishedRun:
    return PublishedRun(
        source=NARAYANAN_2021,
        model=model,
        gpu="a100-80gb",
        gpus=gpus,
        global_batch_size=gbs,
        seq_length=2048,
        tp=tp,
        pp=pp,
        dp=gpus // (tp * pp),
        tflops_per_gpu=tflops,
        vpp=vpp,
        micro_batch_size=mbs,
        recompute="full",
        distributed_optimizer=False,
        precision="fp16",
        peak_fraction=peak / 100,
        sequence_parallel=False,
        counts_recompute=True,
        derived=(
            "dp = GPUs / (tp × pp); vpp = layers / (pp × layers per virtual stage); "
            "recompute FLOPs counted, as in MT-NLG below (same group and year), since "
            "52% of peak with full recompute would otherwise exceed the 42.1% MFU "
            "Korthikanti et al. 2022 (arXiv:2205.05198, abstract) give for 530B with it"
        ),
    )


def _mcore(model: str, tp: int, pp: int, gpus: int, gbs: int, tflops: float, mfu: int):
    return PublishedRun(
        source=MCORE_H100,
        model=model,
        gpu="h100-80gb",
        gpus=gpus,
        global_batch_size=gbs,
        seq_length=4096,
        tp=tp,
        pp=pp,
        dp=48,
        tflops_per_gpu=tflops,
        distributed_optimizer=True,
        peak_fraction=mfu / 100,
        sequence_parallel=tp > 1,
        tp_comm_overlap=tp > 1,
        counts_recompute=False,
        derived="distributed optimizer from --overlap-param-gather, sequence parallelism "
        "with tp > 1 from --tp-comm-overlap (Megatron requires both for them)",
    )


def _korthikanti(model: str, pp: int, gbs: int, seconds: float, mfu: float) -> PublishedRun:
    return PublishedRun(
        source=KORTHIKANTI_2022,
        model=model,
        gpu="a100-80gb",
        gpus=8 * pp,
        global_batch_size=gbs,
        seq_length=2048,
        tp=8,
        pp=pp,
        dp=1,
        tflops_per_gpu=round(mfu * 3.12, 1),
        step_time=seconds,
        recompute="selective",
        distributed_optimizer=False,
        peak_fraction=mfu / 100,
        sequence_parallel=True,
        counts_recompute=False,
        derived=(
            "TFLOP/s = MFU × 312; A100 80GB as on Selene for MT-NLG (same group and "
            "year); no interleaving, as Table 3 gives none; micro-batch size not stated"
        ),
    )


def _mt_nlg(dp: int, tflops: float, seconds: float) -> PublishedRun:
    return PublishedRun(
        source=MT_NLG,
        model="gpt3-530b",
        gpu="a100-80gb",
        gpus=8 * 35 * dp,
        global_batch_size=1920,
        seq_length=2048,
        tp=8,
        pp=35,
        dp=dp,
        tflops_per_gpu=tflops,
        step_time=seconds,
        recompute="full",
        sequence_parallel=False,
        counts_recompute=True,
        derived=(
            "A100 80GB: the paper's Selene, 560 DGX A100 nodes of eight 80 GB A100s; "
            "dp = GPUs / (tp × pp); recompute and its FLOPs counted: only a rerun forward "
            "makes 1920 × 2048 tokens take the stated seconds at the stated TFLOP/s; no "
            "sequence parallelism: it was published later (arXiv:2205.05198)"
        ),
    )


RUNS: tuple[PublishedRun, ...] = (
    _narayanan("gpt3-1.7b", 1, 1, 32, 512, 16, 1, 137, 44),
    _narayanan("gpt3-3.6b", 2, 1, 64, 512, 16, 1, 138, 44),
    _narayanan("gpt3-7.5b", 4, 1, 128, 512, 16, 1, 142, 46),
    _narayanan("gpt3-18b", 8, 1, 256, 1024, 8, 1, 135, 43),
    _narayanan("gpt3-39b", 8, 2, 512, 1536, 4, 1, 138, 44),
    _narayanan("gpt3-76b", 8, 4, 1024, 1792, 2, 3, 140, 45),
    _narayanan("gpt3-145b", 8, 8, 1536, 2304, 2, 2, 148, 47),
    _narayanan("gpt3-310b", 8, 16, 1920, 2160, 1, 2, 155, 50),
    _narayanan("gpt3-530b", 8, 35, 2520, 2520, 1, 3, 163, 52),
    _narayanan("gpt3-1t", 8, 64, 3072, 3072, 1, 1, 163, 52),
    _mcore("mcore-1.7b", 1, 1, 48, 192, 408.8, 41),
    _mcore("mcore-7.1b", 2, 1, 96, 192, 465.9, 47),
    _mcore("mcore-16b", 4, 1, 192, 192, 489.1, 49),
    _mcore("mcore-32b", 8, 1, 384, 192, 459.6, 46),
    _mcore("mcore-70b", 8, 2, 768, 384, 419.7, 42),
    _mcore("mcore-119b", 8, 4, 1536, 768, 420.5, 43),
    _mcore("mcore-177b", 8, 6, 2304, 1152, 432.8, 44),
    _mcore("mcore-314b", 8, 8, 3072, 1536, 474.4, 48),
    _mcore("mcore-462b", 8, 16, 6144, 3072, 459.9, 47),
    _korthikanti("gpt3-22b", 1, 4, 1.10, 41.5),
    _korthikanti("gpt3-175b", 8, 64, 13.75, 51.4),
    _korthikanti("gpt3-530b", 35, 280, 37.83, 56.0),
    _korthikanti("gpt3-1t", 64, 512, 71.49, 56.3),
    _mt_nlg(8, 126, 60.1),
    _mt_nlg(10, 121, 50.2),
    _mt_nlg(12, 113, 44.4),
    PublishedRun(
        source=LLAMA3,
        model="llama3.1-405b",
        gpu="h100-80gb",
        gpus=8192,
        global_batch_size=2048,
        seq_length=8192,
        tp=8,
        pp=16,
        dp=64,
        tflops_per_gpu=430,
        vpp=8,
        counts_embedding_and_loss=True,
        recompute="none",
        derived=(
            "batch = 16M tokens / 8192; dp = GPUs / (tp × cp × pp); "
            f"{LLAMA3_NO_CHECKPOINTING}; {LLAMA3_STAGES}"
        ),
    ),
    PublishedRun(
        source=LLAMA3,
        model="llama3.1-405b",
        gpu="h100-80gb",
        gpus=16384,
        global_batch_size=2048,
        seq_length=8192,
        tp=8,
        pp=16,
        dp=128,
        tflops_per_gpu=400,
        vpp=8,
        counts_embedding_and_loss=True,
        recompute="none",
        derived=(
            "batch = 16M tokens / 8192; dp = GPUs / (tp × cp × pp); "
            f"{LLAMA3_NO_CHECKPOINTING}; {LLAMA3_STAGES}"
        ),
    ),
    PublishedRun(
        source=LLAMA3,
        model="llama3.1-405b",
        gpu="h100-80gb",
        gpus=16384,
        global_batch_size=128,
        seq_length=131072,
        tp=8,
        pp=16,
        dp=8,
        cp=16,
        cp_comm_type="all_gather",
        vpp=8,
        counts_embedding_and_loss=True,
        tflops_per_gpu=380,
        derived=(
            "sequence: the 128K long-context stage; batch = 16M tokens / 131072; "
            "dp = GPUs / (tp × cp × pp) = 8, where Table 4 prints dp 4, which with its tp, "
            "cp and pp would make 8192 GPUs and, at its 16 sequences per replica, 8M "
            "tokens a batch; all-gathered keys and values (Dubey et al. 2024, "
            f"Sec. 3.3.2); {LLAMA3_STAGES}"
        ),
    ),
    PublishedRun(
        source=NEMO_H100_FP8,
        model="gpt3-175b",
        gpu="h100-80gb",
        gpus=512,
        global_batch_size=2048,
        seq_length=2048,
        tp=4,
        pp=8,
        dp=16,
        tflops_per_gpu=932,
        vpp=6,
        micro_batch_size=2,
        precision="fp8",
        counts_recompute=False,
        derived="dp = GPUs / (tp × pp)",
    ),
    PublishedRun(
        source=BRIDGE_H100_FP8,
        model="llama3-70b",
        counts_causal_half=True,
        gpu="h100-80gb",
        gpus=64,
        global_batch_size=128,
        seq_length=8192,
        tp=4,
        pp=8,
        dp=2,
        tflops_per_gpu=719,
        vpp=5,
        micro_batch_size=1,
        precision="fp8",
        counts_recompute=False,
        derived="dp = GPUs / (tp × pp)",
    ),
    _qwen3_zoo(2, 32, 8, 4, 245, 19.7, recompute="norm, act", deepep=True, code=MOE_DEV),
    _qwen3_zoo(2, 8, 32, 3, 200, 24.2, recompute="norm, act", deepep=False, code=MAIN),
    _qwen3_zoo(4, 8, 8, 4, 167, 29.0, recompute="none", deepep=True, code=MAIN),
    PublishedRun(
        source=BRIDGE_H100_FP8,
        model="qwen3-235b-a22b",
        counts_causal_half=True,
        gpu="h100-80gb",
        gpus=256,
        global_batch_size=2048,
        seq_length=4096,
        tp=2,
        pp=8,
        dp=16,
        ep=32,
        etp=1,
        tflops_per_gpu=233,
        vpp=4,
        counts_embedding_and_loss=True,
        micro_batch_size=1,
        precision="fp8",
        counts_recompute=False,
        derived=(
            "dropless, experts force-balanced; 1575 tokens/s per GPU; dp = GPUs / (tp × pp); "
            "etp 1 as the 25.09 recipe sets it; " + QWEN3_STAGES.format(chunks=32)
        ),
    ),
    PublishedRun(
        source=BRIDGE_H100_2509,
        model="deepseek-v3",
        counts_causal_half=True,
        gpu="h100-80gb",
        gpus=1024,
        global_batch_size=8192,
        seq_length=4096,
        tp=2,
        pp=8,
        dp=64,
        ep=64,
        etp=1,
        tflops_per_gpu=338,
        stage_layers=(7, 6),
        micro_batch_size=1,
        precision="fp8",
        counts_recompute=False,
        derived=(
            "dropless, experts force-balanced; 1297 tokens/s per GPU; 338 with per-tensor "
            "FP8 scaling (330 with DeepSeek's 128×128 blocks); published vpp 4; "
            "dp = GPUs / (tp × pp); etp 1 from scripts/performance/configs/deepseek/"
            f"deepseek_v3_llm_pretrain.yaml; {DEEPSEEK_V3_STAGES}"
        ),
    ),
)

STACKS: dict[str, str] = {
    NARAYANAN_2021: "Megatron-LM of 2021",
    KORTHIKANTI_2022: "Megatron-LM of 2022",
    MCORE_H100: "Megatron-Core r0.8.0",
    MT_NLG: "DeepSpeed's pipeline engine with Megatron's layers",
    LLAMA3: "Meta's own",
    NEMO_H100_FP8: "NeMo 2.0",
    BRIDGE_H100_FP8: "Megatron-Bridge",
    BRIDGE_H100_2509: "Megatron-Bridge",
    MOE_ZOO_QWEN3: "Megatron-Core, moe_dev and main",
}
"""The software each source's runs ran on, as the source names it: the model sees the
layout and the hardware, not this."""


def source_label(source: str) -> str:
    """A source's authors and year, or its document, without the details in parentheses:
    ``Korthikanti et al. 2022``."""
    return source.split(" (")[0]


NOT_EXPRESSED: tuple[tuple[str, str], ...] = (
    (
        f"Qwen3-235B-A22B on 256 H100, tp 2 × ep 8 × dp 128 with FSDP, micro-batch 4, full "
        f"recompute, 276 TFLOP/s BF16 ({MOE_ZOO_QWEN3})",
        "fully sharded weights and gradients: a published run here states only whether "
        "the optimizer states were sharded (the distributed optimizer, ZeRO-1)",
    ),
    (
        f"Qwen3-235B-A22B on 256 H100, tp 2 × ep 32 × pp 8 × vpp 4 with the 1F1B all-to-all "
        f"overlap, 276 TFLOP/s BF16 ({MOE_ZOO_QWEN3})",
        "the layout is the 245 TFLOP/s run's; megapp has no all-to-all hidden behind another "
        "microbatch's compute, so it would predict the same",
    ),
    (
        f"Qwen3-235B-A22B on 256 H100 with token dropping, 178 TFLOP/s ({BRIDGE_H100_2509})",
        "dropped tokens under a capacity factor are not priced",
    ),
    (
        "Mixtral 8x7B, 468 TFLOP/s BF16 on H100 (Megatron-LM "
        "megatron/core/transformer/moe/README.md before commit 0888a06d26)",
        "the figure names no layout; the README's reference layouts (MCore v0.8) name no "
        "throughput",
    ),
)
"""Published mixture-of-experts runs left out of :data:`RUNS`: what the source gives, and
why megapp cannot predict it as published."""

__all__ = ["NOT_EXPRESSED", "RUNS", "STACKS", "PublishedRun", "source_label"]
