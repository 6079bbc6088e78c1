"""Model presets for the planner: the ``pretrain_gpt.py`` model flags of published models.

A :class:`ModelPreset` holds the flags that give a model its shape (``--num-layers``,
``--hidden-size``, ``--num-attention-heads``, the MLP width, attention groups, norm,
positions, biases, embedding tying, dtype, ``--seq-length``), the tokenizer's vocabulary
size (``pretrain_gpt.py`` takes the vocabulary from its tokenizer, not from a flag) and
the published parameter count. :data:`MODELS` names them; :func:`load_model` takes a
name or a text file of flags.

Shapes come from the models' own publications: GPT-2 (Radford et al. 2019), the GPT-3
shaped models of Narayanan et al. 2021 (Table 1, layouts in Megatron-LM's
``examples/sc21/run_table_1.sh``) and the 22B of Korthikanti et al. 2022 (Table 3), GPT-3
175B (Brown et al. 2020; Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh``),
the H100 weak-scaling models of Megatron-LM's README (``images/model_table.png``:
vocabulary 131072, sequence 4096, untied embeddings), Llama 2 (Touvron et al. 2023),
Llama 3 (Dubey et al. 2024) and the mixtures of experts Mixtral 8x7B (Jiang et al. 2024),
Qwen3-235B-A22B (Qwen team 2025, as Megatron-MoE-ModelZoo's
``model_configs/benchmarking/Qwen3-235B-A22B.yaml`` gives it) and DeepSeek-V3
(DeepSeek-AI 2024, arXiv:2412.19437), the last two approximated where megapp lacks a feature
(each preset's description says where).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

GPT2_VOCAB = 50257
"""GPT-2's BPE vocabulary (padded by ``--make-vocab-size-divisible-by`` × tp, e.g. to
51200 at tp 8: the "51,200" of the Megatron papers)."""
MCORE_VOCAB = 131072
LLAMA2_VOCAB = 32000
LLAMA3_VOCAB = 128256
QWEN3_VOCAB = 151936
DEEPSEEK_V3_VOCAB = 129280
BYTE_VOCAB = 257
"""megapp's byte tokenizer: 256 bytes and an end-of-document id."""


@dataclass(frozen=True)
class ModelPreset:
    """A model as ``pretrain_gpt.py`` flags. ``parameters``: the published parameter
    count (None where nothing was published), ``description``: one line naming the
    model and its source."""

    flags: tuple[str, ...]
    vocab_size: int
    description: str
    parameters: float | None = None

    def value(self, flag: str) -> str | None:
        """The value given to ``flag`` (``--seq-length``), or None without one."""
        for i, item in enumerate(self.flags):
            if item == flag and i + 1 < len(self.flags):
                return self.flags[i + 1]
            if item.startswith(flag + "="):
                return item.split("=", 1)[1]
        return None

    @property
    def num_layers(self) -> int:
        return int(self.value("--num-layers") or 0)

    @property
    def seq_length(self) -> int:
        return int(self.value("--seq-length") or 0)

    def with_seq_length(self, seq_length: int) -> ModelPreset:
        """The same model trained on ``seq_length`` tokens per sample (learned
        positions grow to cover it)."""
        flags = _set_flag(self.flags, "--seq-length", str(seq_length))
        positions = self.value("--max-position-embeddings")
        if positions is not None and int(positions) < seq_length:
            flags = _set_flag(flags, "--max-position-embeddings", str(seq_length))
        return replace(self, flags=flags)


def _set_flag(flags: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(flags):
        if flags[i] == flag:
            i += 2
        elif flags[i].startswith(flag + "="):
            i += 1
        else:
            out.append(flags[i])
            i += 1
    return (*out, flag, value)


def _shape(layers: int, hidden: int, heads: int, seq: int) -> tuple[str, ...]:
    return (
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
        "--num-attention-heads",
        str(heads),
        "--seq-length",
        str(seq),
    )


def _gpt(layers: int, hidden: int, heads: int, seq: int, *extra: str) -> tuple[str, ...]:
    """GPT-2/GPT-3 architecture: LayerNorm, GeLU MLP of 4h, biases, learned positions,
    tied embeddings."""
    return (*_shape(layers, hidden, heads, seq), "--max-position-embeddings", str(seq), *extra)


def _llama(
    layers: int, hidden: int, heads: int, groups: int | None, ffn: int, seq: int, base: float
) -> tuple[str, ...]:
    """Llama architecture: RMSNorm, SwiGLU, rotary positions, no biases, untied output
    layer, no dropout; grouped-query attention with ``groups`` key/value heads."""
    gqa = ("--group-query-attention", "--num-query-groups", str(groups)) if groups else ()
    return (
        *_shape(layers, hidden, heads, seq),
        *gqa,
        "--ffn-hidden-size",
        str(ffn),
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        str(int(base)),
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--make-vocab-size-divisible-by",
        "128",
        "--bf16",
    )


_NARAYANAN = "Narayanan et al. 2021, Table 1 (shape from Megatron-LM examples/sc21/run_table_1.sh)"
_MCORE = "Megatron-LM README H100 weak scaling (images/model_table.png); untied, 4h MLP"


def _narayanan(size: str, layers: int, hidden: int, heads: int, billions: float) -> ModelPreset:
    return ModelPreset(
        _gpt(layers, hidden, heads, 2048, "--bf16"),
        GPT2_VOCAB,
        f"GPT-3 shaped {size}: {_NARAYANAN}",
        billions * 1e9,
    )


def _mcore(size: str, layers: int, hidden: int, heads: int, billions: float) -> ModelPreset:
    flags = _gpt(layers, hidden, heads, 4096, "--untie-embeddings-and-output-weights", "--bf16")
    return ModelPreset(flags, MCORE_VOCAB, f"GPT {size}: {_MCORE}", billions * 1e9)


MODELS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        _shape(4, 128, 4, 128),
        BYTE_VOCAB,
        "the CPU demo's 4-layer, 128-wide GPT on byte tokens (examples/pretrain_gpt_cpu_demo.sh)",
    ),
    "gpt2": ModelPreset(
        _gpt(12, 768, 12, 1024, "--bf16"), GPT2_VOCAB, "GPT-2 small (Radford et al. 2019)", 124e6
    ),
    "gpt2-xl": ModelPreset(
        _gpt(48, 1600, 25, 1024, "--bf16"), GPT2_VOCAB, "GPT-2 XL (Radford et al. 2019)", 1.5e9
    ),
    "gpt3-1.7b": _narayanan("1.7B", 24, 2304, 24, 1.7),
    "gpt3-3.6b": _narayanan("3.6B", 30, 3072, 32, 3.6),
    "gpt3-7.5b": _narayanan("7.5B", 36, 4096, 32, 7.5),
    "gpt3-18b": _narayanan("18B", 40, 6144, 48, 18.4),
    "gpt3-39b": _narayanan("39B", 48, 8192, 64, 39.1),
    "gpt3-76b": _narayanan("76B", 60, 10240, 80, 76.1),
    "gpt3-145b": _narayanan("145B", 80, 12288, 96, 145.6),
    "gpt3-22b": ModelPreset(
        _gpt(48, 6144, 64, 2048, "--bf16"),
        GPT2_VOCAB,
        "GPT-3 shaped 22B (Korthikanti et al. 2022, arXiv:2205.05198, Table 3)",
        22e9,
    ),
    "gpt3-175b": ModelPreset(
        _gpt(96, 12288, 96, 2048, "--bf16"),
        GPT2_VOCAB,
        "GPT-3 175B (Brown et al. 2020; Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh)",
        175e9,
    ),
    "gpt3-310b": _narayanan("310B", 96, 16384, 128, 310.1),
    "gpt3-530b": _narayanan("530B (MT-NLG's shape)", 105, 20480, 128, 529.6),
    "gpt3-1t": _narayanan("1T", 128, 25600, 160, 1008.0),
    "mcore-1.7b": _mcore("1.7B", 24, 2048, 16, 1.7),
    "mcore-7.1b": _mcore("7.1B", 30, 4096, 32, 7.1),
    "mcore-16b": _mcore("16B", 32, 6144, 48, 16),
    "mcore-32b": _mcore("32B", 48, 7168, 56, 32),
    "mcore-70b": _mcore("70B", 84, 8192, 64, 70),
    "mcore-119b": _mcore("119B", 92, 10240, 80, 119),
    "mcore-177b": _mcore("177B", 96, 12288, 96, 177),
    "mcore-314b": _mcore("314B", 96, 16384, 128, 314),
    "mcore-462b": _mcore("462B", 112, 18432, 144, 462),
    "llama2-7b": ModelPreset(
        _llama(32, 4096, 32, None, 11008, 4096, 1e4),
        LLAMA2_VOCAB,
        "Llama 2 7B (Touvron et al. 2023)",
        6.74e9,
    ),
    "llama2-13b": ModelPreset(
        _llama(40, 5120, 40, None, 13824, 4096, 1e4),
        LLAMA2_VOCAB,
        "Llama 2 13B (Touvron et al. 2023)",
        13.0e9,
    ),
    "llama2-70b": ModelPreset(
        _llama(80, 8192, 64, 8, 28672, 4096, 1e4),
        LLAMA2_VOCAB,
        "Llama 2 70B, 8 key/value heads (Touvron et al. 2023)",
        70e9,
    ),
    "llama3-8b": ModelPreset(
        _llama(32, 4096, 32, 8, 14336, 8192, 5e5),
        LLAMA3_VOCAB,
        "Llama 3 8B (Dubey et al. 2024, Table 3)",
        8e9,
    ),
    "llama3-70b": ModelPreset(
        _llama(80, 8192, 64, 8, 28672, 8192, 5e5),
        LLAMA3_VOCAB,
        "Llama 3 70B (Dubey et al. 2024, Table 3)",
        70e9,
    ),
    "llama3.1-405b": ModelPreset(
        (
            *_llama(126, 16384, 128, 8, 53248, 8192, 5e5),
            "--use-rope-scaling",
            "--rope-scaling-factor",
            "8",
        ),
        LLAMA3_VOCAB,
        "Llama 3.1 405B (Dubey et al. 2024, Table 3)",
        405e9,
    ),
    "mixtral-8x7b": ModelPreset(
        (
            *_llama(32, 4096, 32, 8, 14336, 4096, 1e6),
            "--num-experts",
            "8",
            "--moe-router-topk",
            "2",
        ),
        LLAMA2_VOCAB,
        "Mixtral 8x7B: 8 experts, 2 per token, in every layer (Jiang et al. 2024)",
        46.7e9,
    ),
    "qwen3-235b-a22b": ModelPreset(
        (
            *_llama(94, 4096, 64, 4, 12288, 4096, 1e6),
            *("--kv-channels", "128"),
            *("--num-experts", "128", "--moe-router-topk", "8"),
            *("--moe-ffn-hidden-size", "1536"),
        ),
        QWEN3_VOCAB,
        "Qwen3-235B-A22B: 128 experts of width 1536, 8 per token, in every layer; 64 heads "
        "of 128 with 4 key/value groups (Qwen team 2025); without the per-head query/key "
        "RMSNorm, which megapp does not have (2 × 128 weights a layer)",
        235e9,
    ),
    "deepseek-v3": ModelPreset(
        (
            *_llama(61, 7168, 96, 48, 18432, 4096, 1e4),
            *("--kv-channels", "128"),
            *("--num-experts", "256", "--moe-router-topk", "8"),
            *("--moe-ffn-hidden-size", "2048"),
            *("--moe-shared-expert-intermediate-size", "2048"),
        ),
        DEEPSEEK_V3_VOCAB,
        "DeepSeek-V3: 256 routed experts of width 2048, 8 per token, and one shared expert "
        "(DeepSeek-AI 2024, arXiv:2412.19437). Approximated: multi-head latent attention "
        "as 96 heads of 128 in 48 key/value groups, the stand-in whose forward FLOPs per "
        "token at 4096 tokens (projections and s×s scores) are MLA's within 3%; the first "
        "three layers, dense (width 18432) in the model, as mixture-of-experts layers like "
        "the other 58: the same FLOPs per token (18432 = 9 × 2048 active), 3 × 255 experts' "
        "weights more; no multi-token-prediction module",
        671e9,
    ),
}


def load_model(name_or_path: str, vocab_size: int | None = None) -> ModelPreset:
    """The preset ``name_or_path`` names, or the model a text file of pretrain flags
    describes (``#`` starts a comment; ``--vocab-size N`` there, or ``vocab_size`` here,
    gives the tokenizer's vocabulary). ``vocab_size`` also overrides a preset's.
    Raises ValueError with a one-line message for an unknown name, a file without a
    vocabulary size, or flags ``pretrain_gpt.py`` would refuse."""
    if name_or_path in MODELS:
        preset = MODELS[name_or_path]
        return preset if vocab_size is None else replace(preset, vocab_size=vocab_size)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown model {name_or_path!r}: give a preset ({', '.join(MODELS)}) "
            "or a file of pretrain_gpt.py model flags"
        )
    flags = shlex.split(path.read_text(), comments=True)
    flags, from_file = _take_vocab_size(flags, path)
    vocab = vocab_size if vocab_size is not None else from_file
    if vocab is None:
        raise ValueError(f"{path}: no --vocab-size N among the flags and none given")
    preset = ModelPreset(tuple(flags), vocab, f"model flags from {path}")
    _check(preset, str(path))
    return preset


def _take_vocab_size(flags: list[str], path: Path) -> tuple[list[str], int | None]:
    rest, vocab, i = [], None, 0
    while i < len(flags):
        flag = flags[i]
        if flag == "--vocab-size" or flag.startswith("--vocab-size="):
            text = flag.split("=", 1)[1] if "=" in flag else (flags[i + 1 : i + 2] or [""])[0]
            i += 1 if "=" in flag else 2
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"{path}: --vocab-size needs a positive integer, got {text!r}")
            vocab = int(text)
        else:
            rest.append(flag)
            i += 1
    return rest, vocab


def _check(preset: ModelPreset, where: str) -> None:
    from megapp.planning.layout import Layout, pretrain_config
    from megapp.training.flag_groups import ArgumentsError

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):  # argparse prints usage before exiting
            pretrain_config(Layout(), preset.flags, global_batch_size=1)
    except (ArgumentsError, ValueError) as error:
        raise ValueError(f"{where}: {' '.join(str(error).split())}") from error
    except SystemExit as error:  # argparse: an unknown flag or a malformed value
        lines = stderr.getvalue().strip().splitlines() or ["invalid flags"]
        reason = re.sub(r"\s*\(see .* --help\)$", "", lines[-1].split("error: ", 1)[-1])
        raise ValueError(f"{where}: {reason}") from error


__all__ = ["MODELS", "ModelPreset", "load_model"]
