"""Start a run from a Hugging Face model folder and give the result back as one.

``--load-hf DIR`` fills the model from ``DIR`` (each rank reading its slices) when no
checkpoint is resumed; the model flags must describe ``DIR/config.json``, and
``tools/convert_hf.py flags DIR`` prints them. ``--save-hf DIR`` writes the trained model
as a Hugging Face folder at the end (as ``--load-hf``'s type, or ``--hf-model-type``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megapp import parallel_state as ps
from megapp.models.gpt import GPTConfig
from megapp.training.flag_groups import ArgumentsError
from megapp.training.initialize import print_rank_0

# The fields that make a model what it is; the others (layout, dropout, recompute, dtype,
# initialization) are the run's own.
ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "activation",
    "add_bias_linear",
    "add_qkv_bias",
    "normalization",
    "layernorm_epsilon",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
    "vocab_size",
    "share_embeddings_and_output_weights",
)
# Llama 3.1's scaling constants, which megapp (like Megatron) has no flags for.
LLAMA31_SCALING = {
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position_embeddings": 8192,
}


def _hf():
    """megapp.models.hf_checkpoint, imported on first use: it pulls in
    torch.distributed.checkpoint (about half a second per process), which a run that
    neither reads nor writes a Hugging Face folder never needs."""
    from megapp.models import hf_checkpoint

    return hf_checkpoint


def pretrain_flags(model: GPTConfig) -> list[str]:
    """The ``pretrain_gpt.py`` model flags that build ``model`` (its vocabulary comes from
    the tokenizer, or from ``--load-hf``)."""
    flags = [
        *("--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size)),
        *("--ffn-hidden-size", str(model.ffn_hidden_size)),
        *("--num-attention-heads", str(model.num_attention_heads)),
        *("--kv-channels", str(model.kv_channels)),
    ]
    if model.num_query_groups != model.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    flags += {"swiglu": ["--swiglu"], "gelu_erf": ["--gelu-erf"]}.get(model.activation, [])
    if not model.add_bias_linear:
        flags.append("--disable-bias-linear")
    if model.add_qkv_bias:
        flags.append("--add-qkv-bias")
    flags += [
        "--normalization",
        model.normalization,
        "--norm-epsilon",
        repr(model.layernorm_epsilon),
    ]
    flags += ["--position-embedding-type", model.position_embedding_type]
    if model.position_embedding_type == "learned_absolute":
        flags += ["--max-position-embeddings", str(model.max_position_embeddings)]
    if model.position_embedding_type == "rope":
        flags += ["--rotary-base", repr(float(model.rotary_base))]
        if model.rotary_percent != 1.0:
            flags += ["--rotary-percent", repr(model.rotary_percent)]
    if model.rope_scaling_factor is not None:
        odd = {k: getattr(model, k) for k, v in LLAMA31_SCALING.items() if getattr(model, k) != v}
        if odd:
            raise ValueError(f"RoPE scaling with {odd} has no pretrain_gpt.py flags")
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(model.rope_scaling_factor)]
    if not model.share_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def model_type(directory: str) -> str:
    """The ``model_type`` of the model in ``directory``."""
    try:
        return str(_hf().read_hf_config(directory)["model_type"])
    except (OSError, KeyError, ValueError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error


def hf_vocab_size(directory: str) -> int:
    """The vocabulary rows of the model in ``directory``."""
    try:
        return int(_hf().read_hf_config(directory)["vocab_size"])
    except (OSError, KeyError, ValueError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error


def check_model_flags(config: Any, vocab_size: int) -> str:
    """Raise unless the run's model is the one in ``--load-hf``; returns its model_type."""
    directory = config.checkpoint.load_hf
    mine = config.gpt_config(vocab_size)
    try:
        theirs, model_type = _hf().hf_gpt_config(
            directory,
            **{
                f.name: getattr(mine, f.name)
                for f in dataclasses.fields(mine)
                if f.name not in ARCHITECTURE and f.name != "max_position_embeddings"
            },
        )
    except (OSError, ValueError, ImportError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error
    fields = list(ARCHITECTURE)
    if theirs.position_embedding_type == "learned_absolute":
        fields.append("max_position_embeddings")
    differ = [
        f"{f} {getattr(mine, f)!r} (the model: {getattr(theirs, f)!r})"
        for f in fields
        if getattr(mine, f) != getattr(theirs, f)
    ]
    if differ:
        try:
            hint = " ".join(pretrain_flags(theirs))
        except ValueError as error:
            hint = str(error)
        raise ArgumentsError(
            f"--load-hf {directory}: the model flags differ from its config.json in "
            f"{'; '.join(differ)}; its flags are: {hint}"
        )
    return model_type


def load(config: Any, setup: Any, model_type: str) -> None:
    """Fill the chunks from ``--load-hf`` and restart the optimizer's master weights there."""
    directory = config.checkpoint.load_hf
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    try:
        _hf().load_hf(setup.chunks, directory, model_type, tp_rank, tp)
    except (OSError, ValueError, KeyError, ImportError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error
    setup.optimizer.copy_masters_from_weights()
    print_rank_0(f" > loaded the {model_type} weights of {directory}")


def save(config: Any, setup: Any, model_type: str) -> None:
    """Write the model to ``--save-hf`` (collective; one data-parallel replica writes)."""
    directory = config.checkpoint.save_hf
    if ps.get_data_parallel_rank() == 0:
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        tokenizer_dir = config.checkpoint.load_hf or config.data.tokenizer_model
        _hf().save_hf(
            setup.chunks,
            directory,
            model_type,
            tp_rank,
            tp,
            ps.get_model_parallel_group(),
            tokenizer_dir=tokenizer_dir,
        )
    print_rank_0(f" > saved the model as a Hugging Face {model_type} folder in {directory}")
