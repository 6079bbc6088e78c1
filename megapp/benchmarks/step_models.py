"""The single-GPU training steps whose time the planner predicts from a calibrated profile
(the step stage of :mod:`megapp.benchmarks.gpu_check`): GPT-3-style models (GeLU,
LayerNorm, learned positions), Llama-style ones (SwiGLU, RMSNorm, RoPE, grouped queries,
no biases) and Llama-style ones whose MLPs are routed experts; bf16, no dropout. Each
entry is the model's ``pretrain_gpt.py`` flags on top of :data:`STEP_COMMON`; which were
held out, and at which commit, is said beside it and in ``docs/img/h200_steps.json``."""

from __future__ import annotations

STEP_COMMON = ["--seq-length", "2048", "--max-position-embeddings", "2048", "--bf16"]
STEP_COMMON += ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "14"]
STEP_COMMON += ["--micro-batch-size", "4", "--global-batch-size", "16", "--profile-iteration", "12"]


def gpt(layers: int, hidden: int, heads: int, *extra: str) -> list[str]:
    """A GPT-3-style model's flags."""
    shape = ["--num-layers", str(layers), "--hidden-size", str(hidden)]
    return [*shape, "--num-attention-heads", str(heads), *extra]


def llama_style(
    layers: int, hidden: int, heads: int, groups: int, ffn: int, *extra: str
) -> list[str]:
    """A Llama-style model's flags: SwiGLU of width ``ffn``, RMSNorm, RoPE, ``groups``
    key/value groups, no biases, untied embeddings."""
    return gpt(
        layers, hidden, heads,
        "--num-query-groups", str(groups), "--ffn-hidden-size", str(ffn), "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", *extra,
    )  # fmt: skip


def moe(experts: int, topk: int, *extra: str) -> list[str]:
    """A Llama-style model of 8 layers (hidden 4096, 32 heads of 128 in 4 key/value groups)
    whose every MLP is ``experts`` SwiGLU experts of width 1536, ``topk`` per token."""
    routed = ["--num-experts", str(experts), "--moe-router-topk", str(topk)]
    return llama_style(
        8, 4096, 32, 4, 12288, "--kv-channels", "128", *routed,
        "--moe-ffn-hidden-size", "1536", *extra,
    )  # fmt: skip


SEQ_4096 = ["--seq-length", "4096", "--max-position-embeddings", "4096"]
SEQ_1024 = ["--seq-length", "1024", "--max-position-embeddings", "1024"]
BATCH_8_32 = ["--micro-batch-size", "8", "--global-batch-size", "32"]

STEP_MODELS = {
    "gpt 1.2B": gpt(24, 2048, 16),
    # held out: no calibration or model change was made after looking at this one's step
    "gpt 1.3B s4096": gpt(
        16, 2560, 20, *SEQ_4096, "--micro-batch-size", "1", "--global-batch-size", "8"
    ),
    "llama-style 1.0B": llama_style(16, 2048, 32, 8, 8192),
    # chosen, and the operation model committed, before their first run (e8e9afb); the
    # attention fit and the matmul grid changed after they were seen
    "gpt 0.7B h1536 b8": gpt(24, 1536, 12, "--micro-batch-size", "8", "--global-batch-size", "16"),
    "llama-style 1.1B s4096 gqa4": llama_style(
        16, 2560, 20, 4, 6912, *SEQ_4096, "--micro-batch-size", "2", "--global-batch-size", "8"
    ),
    # held out: chosen, and the model and calibration committed, before its first run
    "gpt 1.6B h3072 b2": gpt(14, 3072, 24, "--micro-batch-size", "2", "--global-batch-size", "8"),
    # held out: chosen, and the operation model committed, before their first run (the
    # calibration is measured in the same run)
    "gpt 2.1B h2560 b2": gpt(26, 2560, 20, "--micro-batch-size", "2", "--global-batch-size", "8"),
    "llama-style 0.8B gqa4": llama_style(16, 2048, 16, 4, 5632),
    "gpt 1.0B d64 s1024 b8": gpt(20, 2048, 32, *SEQ_1024, *BATCH_8_32),
    # held out: chosen, and the operation model committed, before its first run; full
    # heads with RoPE, whose attention output merges as a view (no relayout copy)
    "gpt 1.2B rope": gpt(24, 2048, 16, "--position-embedding-type", "rope"),
    # held out: chosen, and the operation model committed, before their first run; every
    # layer's MLP routed to experts of Qwen3-235B-A22B's shape (hidden 4096, width 1536),
    # as many experts and rows each as one rank of its expert-parallel runs holds: 16 of
    # 512 rows (ep 8 at tp 4), 4 of 4096 rows (ep 32 at tp 2)
    "moe 16 experts 512 rows": moe(16, 2, "--micro-batch-size", "2", "--global-batch-size", "8"),
    "moe 4 experts 4096 rows": moe(4, 2),
}
STEP_QUICK = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4"]
STEP_QUICK += ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4"]
STEP_QUICK += ["--train-iters", "6"]


def argv_flags(name: str, model: list[str]) -> list[str]:
    """The step's whole flags: :data:`STEP_COMMON` and the model's (the quick one's alone)."""
    return [*(STEP_COMMON if name != "quick" else []), *model]


__all__ = ["STEP_COMMON", "STEP_MODELS", "STEP_QUICK", "argv_flags", "gpt", "llama_style", "moe"]
