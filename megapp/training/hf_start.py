"""Start a run from a Hugging Face model folder and give the result back as one.

``--load-hf DIR`` fills the model from ``DIR`` (each rank reading its slices) when no
checkpoint is resumed; the model flags must describe ``DIR/config.json``, and
``tools/checkpoint/convert_hf.py flags DIR`` prints them. ``--save-hf DIR`` writes the trained model
as a Hugging Face folder at the end (as ``--load-hf``'s type, or ``--hf-model-type``).
The imported ``config.json`` travels with the run's checkpoints (:func:`prepare`), so
that every export of the model writes it back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from megapp import comm
from megapp.models.gpt import GPTConfig
from megapp.models.hf_config import model_differences
from megapp.training.flag_groups import ArgumentsError
from megapp.training.initialize import print_rank_0

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
    if model.num_moe_experts is not None:
        flags += _moe_flags(model)
    # the model's own dropout, not pretrain_gpt.py's default of 0.1
    flags += ["--hidden-dropout", repr(float(model.hidden_dropout))]
    flags += ["--attention-dropout", repr(float(model.attention_dropout))]
    return flags


def _moe_flags(model: GPTConfig) -> list[str]:
    flags = [
        *("--num-experts", str(model.num_moe_experts)),
        *("--moe-layer-freq", str(model.moe_layer_freq)),
        *("--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)),
        *("--moe-router-topk", str(model.moe_router_topk)),
        *("--moe-router-score-function", model.moe_router_score_function),
    ]
    if model.moe_router_pre_softmax:
        flags.append("--moe-router-pre-softmax")
    if model.moe_router_norm_topk_prob:
        flags.append("--moe-router-norm-topk-prob")
    if model.moe_shared_expert_intermediate_size is not None:
        size = str(model.moe_shared_expert_intermediate_size)
        flags += ["--moe-shared-expert-intermediate-size", size]
    if model.moe_shared_expert_gate:
        flags.append("--moe-shared-expert-gate")
    return flags


def _config_field(directory: str, name: str) -> Any:
    try:
        hf = _hf().read_hf_config(directory)
    except (OSError, ValueError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error
    if name not in hf:
        raise ArgumentsError(f"--load-hf {directory}: its config.json has no {name!r}")
    return hf[name]


def model_type(directory: str) -> str:
    """The ``model_type`` of the model in ``directory``."""
    return str(_config_field(directory, "model_type"))


def hf_vocab_size(directory: str) -> int:
    """The vocabulary rows of the model in ``directory``."""
    rows = _config_field(directory, "vocab_size")
    if not isinstance(rows, int):
        raise ArgumentsError(f"--load-hf {directory}: its vocab_size {rows!r} is not a number")
    return rows


def check_model_flags(config: Any, vocab_size: int) -> str:
    """Raise unless the run's model is the one in ``--load-hf``; returns its model_type."""
    directory = config.checkpoint.load_hf
    try:
        hf = _hf().read_hf_config(directory)
        theirs, differ = model_differences(hf, config.gpt_config(vocab_size))
    except (OSError, ValueError, ImportError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error
    if differ:
        try:
            hint = " ".join(pretrain_flags(theirs))
        except ValueError as error:
            hint = str(error)
        raise ArgumentsError(
            f"--load-hf {directory}: the model flags differ from its config.json in "
            f"{'; '.join(differ)}; its flags are: {hint}"
        )
    return hf["model_type"]


def source_dir(config: Any) -> str | None:
    """The folder with the ``config.json`` the run's model came with: ``--load-hf``, or the
    one kept with the ``--load`` checkpoints; None for a model trained from scratch."""
    ckpt = config.checkpoint
    if ckpt.load_hf is not None:
        return ckpt.load_hf
    return None if ckpt.load is None else _hf().kept_hf_config(ckpt.load)


def prepare(config: Any) -> None:
    """At the start of a run: check that ``--save-hf`` can write the model it came with, and
    keep that model's Hugging Face config with the ``--save`` checkpoints (global rank 0),
    so that ``tools/checkpoint/convert_hf.py export`` writes it back."""
    ckpt = config.checkpoint
    source = source_dir(config)
    if source is None:
        return
    if ckpt.save_hf is not None and ckpt.hf_model_type is not None:
        kind = _kept_model_type(source)
        if kind != ckpt.hf_model_type:
            raise ArgumentsError(
                f"--hf-model-type {ckpt.hf_model_type}: the model came from a {kind} folder "
                f"({source}); export it as {kind}"
            )
    if ckpt.save is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    try:
        _hf().keep_hf_config(source, ckpt.save)
    except (OSError, ValueError) as error:
        raise ArgumentsError(f"--save {ckpt.save}: {error}") from error


def _kept_model_type(directory: str) -> str:
    try:
        return str(_hf().read_hf_config(directory).get("model_type"))
    except (OSError, ValueError) as error:
        raise ArgumentsError(f"{directory}: {error}") from error


def load(config: Any, setup: Any, model_type: str) -> None:
    """Fill the chunks from ``--load-hf`` and restart the optimizer's master weights there."""
    directory = config.checkpoint.load_hf
    try:
        _hf().load_hf(setup.chunks, directory, model_type, placement=_placement(setup.groups))
    except (OSError, ValueError, KeyError, ImportError) as error:
        raise ArgumentsError(f"--load-hf {directory}: {error}") from error
    setup.optimizer.copy_masters_from_weights()
    print_rank_0(f" > loaded the {model_type} weights of {directory}")


def _placement(groups: Any) -> Any:
    from megapp.checkpointing.state import Placement

    return Placement.of(groups)


def save(config: Any, setup: Any, model_type: str) -> None:
    """Write the model to ``--save-hf`` (collective; one data-parallel replica writes)."""
    directory = config.checkpoint.save_hf
    groups = setup.groups
    # the experts of an expert-parallel model are spread over the data-parallel ranks too
    experts = comm.world_size(groups.ep) > 1
    if experts or comm.rank(groups.dp_cp) == 0:
        tokenizer_dir = config.checkpoint.load_hf or config.data.tokenizer_model
        source = source_dir(config)
        _hf().save_hf(
            setup.chunks,
            directory,
            model_type,
            group=dist.group.WORLD if experts else groups.mp,
            tokenizer_dir=tokenizer_dir,
            source_dir=source,
            eod=None if source is not None else _eod(config),
            placement=_placement(groups),
        )
    print_rank_0(f" > saved the model as a Hugging Face {model_type} folder in {directory}")


def run_eod(settings: dict[str, Any]) -> int:
    """The end-of-document id of a run's tokenizer (``settings``: its data flags, as saved),
    the first and last token of a model trained from scratch."""
    from megapp.data.tokenizers import build_tokenizer

    names = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
    try:
        return build_tokenizer(*(settings.get(name) for name in names)).eod
    except (OSError, ValueError, ImportError) as error:
        raise ValueError(f"the token ids are its tokenizer's, which fails: {error}") from error


def _eod(config: Any) -> int:
    try:
        return run_eod(dataclasses.asdict(config.data))
    except ValueError as error:
        raise ArgumentsError(f"--save-hf: {error}") from error
