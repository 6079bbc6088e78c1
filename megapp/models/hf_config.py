"""Hugging Face model configs to :class:`GPTConfig` and back: GPT-2, Llama 2/3/3.1, Mistral,
Qwen2, GPT-NeoX with sequential residuals (partial rotary, erf GeLU), and the
mixtures of experts Mixtral and Qwen2-MoE.

``gpt_config_from_hf(config.json's dict)`` builds the megapp model that computes what the
Hugging Face model computes; ``hf_config_from_gpt(config, model_type)`` writes the
``config.json`` of a model megapp exports. Both refuse, with one line, what the other
side cannot express (GPT-2's per-layer attention scaling, Mistral's sliding window over a
longer context, a Llama MLP with biases, ...).

A model that came from Hugging Face goes back with its own ``config.json``
(:func:`exported_config`): megapp's config fixes the computation, not the token ids, the
context length the model was made for or its dropout, so those are the original's.
"""

from __future__ import annotations

from typing import Any

from megapp.models.gpt import GPTConfig

MODEL_TYPES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
MOE_TYPES = ("mixtral", "qwen2_moe")
# Hugging Face's GeLU names -> megapp's: the tanh approximation, or the exact erf form.
GELU_NAMES = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_erf"}
_HF_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# The fields that make a model what it is; the others (layout, dropout, recompute, dtype,
# initialization, and RoPE models' max_position_embeddings) are a run's own.
MODEL_FIELDS = (
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
    "num_moe_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_norm_topk_prob",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either transformers 5's ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling`` keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = kind
    return float(theta), merged


def gpt_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json``; ``overrides`` set layout and
    training fields (tensor_model_parallel_size, sequence_parallel, dropouts, ...), and
    for RoPE models ``max_position_embeddings``, how far megapp runs the model."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; megapp imports {', '.join(MODEL_TYPES)}"
        )
    try:
        if model_type == "gpt2":
            fields = _gpt2_fields(hf)
        elif model_type == "gpt_neox":
            fields = _neox_fields(hf)
        else:
            fields = _llama_fields(hf, model_type, overrides.get("max_position_embeddings"))
    except KeyError as error:
        raise ValueError(f"{model_type} config.json has no {error.args[0]!r}") from None
    fields.update(overrides)
    return GPTConfig(**fields)


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    for key, wanted in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True),
    ):
        if hf.get(key, wanted) != wanted:
            raise ValueError(f"GPT-2 with {key}={hf[key]} is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_NAMES:
        raise ValueError(f"GPT-2 activation {act!r} is not supported ({', '.join(GELU_NAMES)})")
    hidden = hf["n_embd"]
    return dict(
        num_layers=hf["n_layer"],
        hidden_size=hidden,
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        activation=GELU_NAMES[act],
        normalization="LayerNorm",
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding_type="learned_absolute",
        max_position_embeddings=hf.get("n_positions", 1024),
        add_bias_linear=True,
        hidden_dropout=hf.get("resid_pdrop", 0.1),
        attention_dropout=hf.get("attn_pdrop", 0.1),
        init_method_std=hf.get("initializer_range", 0.02),
        vocab_size=hf["vocab_size"],
        share_embeddings_and_output_weights=hf.get("tie_word_embeddings", True),
    )


def _neox_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("use_parallel_residual", True):
        raise ValueError(
            "gpt_neox with use_parallel_residual (attention and MLP side by side) is not "
            "supported; megapp's layers add them one after the other"
        )
    act = hf.get("hidden_act", "gelu")
    if act not in GELU_NAMES or not hf.get("attention_bias", True):
        raise ValueError(f"gpt_neox with hidden_act {act!r} or without biases is not supported")
    theta, rope = _rope(hf)
    if rope["rope_type"] != "default":
        raise ValueError(f"gpt_neox rope_type {rope['rope_type']!r} is not supported")
    hidden = hf["hidden_size"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf.get("intermediate_size") or 4 * hidden,
        activation=GELU_NAMES[act],
        normalization="LayerNorm",
        layernorm_epsilon=hf.get("layer_norm_eps", 1e-5),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=float(rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        add_bias_linear=True,
        hidden_dropout=hf.get("hidden_dropout", 0.0),
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        vocab_size=hf["vocab_size"],
        share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False),
    )


def _llama_fields(hf: dict[str, Any], model_type: str, context: int | None) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type} activation {act!r} is not supported (silu only)")
    if hf.get("mlp_bias", False):
        raise ValueError(f"{model_type} with mlp_bias is not supported")
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    positions = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is not None and window < (context or positions):
        # Within one window, full causal attention is the same computation.
        raise ValueError(
            f"{model_type}: sliding-window attention ({window} tokens) over a "
            f"{context or positions}-token context is not implemented; run it within one "
            f"window: --max-position-embeddings {window} (or less)"
        )
    theta, rope = _rope(hf)
    fields: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hidden // heads,
        ffn_hidden_size=hf["intermediate_size"],
        activation="swiglu",
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
        max_position_embeddings=positions,
        add_bias_linear=bool(hf.get("attention_bias", False)) and model_type == "llama",
        add_qkv_bias=model_type == "qwen2"
        or (model_type == "qwen2_moe" and hf.get("qkv_bias", True)),
        hidden_dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        vocab_size=hf["vocab_size"],
        share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False),
    )
    if model_type == "llama" and fields["add_bias_linear"]:
        raise ValueError("llama with attention_bias is not supported (its MLP has no bias)")
    if rope["rope_type"] == "llama3":
        fields.update(
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope["rope_type"] != "default":
        raise ValueError(f"{model_type} rope_type {rope['rope_type']!r} is not supported")
    if model_type in MOE_TYPES:
        fields.update(_moe_fields(hf, model_type))
    return fields


def _moe_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Mixtral: every layer a mixture of experts, softmax over all experts, the top k
    renormalized, no shared expert. Qwen2-MoE: the same router with ``norm_topk_prob``
    optional, a sigmoid-gated shared expert, and dense layers where
    ``decoder_sparse_step`` and ``mlp_only_layers`` say."""
    fields: dict[str, Any] = dict(
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=True,
    )
    if model_type == "mixtral":
        if hf.get("router_jitter_noise"):
            raise ValueError("mixtral with router_jitter_noise is not supported")
        return dict(
            fields,
            num_moe_experts=hf["num_local_experts"],
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_router_norm_topk_prob=True,
        )
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    freq = next((f for f in range(1, layers + 1) if sparse == list(range(0, layers, f))), None)
    if freq is None:
        raise ValueError(
            f"qwen2_moe with mixture-of-experts layers {sparse} (decoder_sparse_step {step}, "
            f"mlp_only_layers {sorted(dense)}) is not supported; megapp's are every n-th "
            "from layer 0"
        )
    shared = hf.get("shared_expert_intermediate_size") or None
    return dict(
        fields,
        num_moe_experts=hf["num_experts"],
        moe_layer_freq=freq,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
    )


def model_differences(hf: dict[str, Any], config: GPTConfig) -> tuple[GPTConfig, list[str]]:
    """The model ``hf`` describes (run over ``config``'s context when its positions are not
    weights) and each model field where ``config`` differs from it, as
    ``"name mine (the model: theirs)"``."""
    context = {}
    if hf.get("model_type") != "gpt2":  # only GPT-2's positions are weights
        context["max_position_embeddings"] = config.max_position_embeddings
    theirs = gpt_config_from_hf(hf, **context)
    fields = list(MODEL_FIELDS)
    if theirs.position_embedding_type == "learned_absolute":
        fields.append("max_position_embeddings")
    differ = [
        f"{f} {getattr(config, f)!r} (the model: {getattr(theirs, f)!r})"
        for f in fields
        if getattr(config, f) != getattr(theirs, f)
    ]
    return theirs, differ


def exported_config(
    config: GPTConfig,
    model_type: str,
    original: dict[str, Any] | None = None,
    eod: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` megapp exports ``config``'s weights with.

    With the ``original`` config.json of the model (the one it was imported from): that
    config, whole, with the dtype of the written tensors; it must describe ``config``'s
    model as a ``model_type``. Without: :func:`hf_config_from_gpt`, and ``eod`` (the
    run's end-of-document id) as both its first and its last token.
    """
    if original is None:
        hf = hf_config_from_gpt(config, model_type)
        hf.update(bos_token_id=eod, eos_token_id=eod)
        return hf
    if original.get("model_type") != model_type:
        raise ValueError(
            f"the model is a {original.get('model_type')} model (its original config.json "
            f"says so), not a {model_type} one; export it as {original.get('model_type')}"
        )
    _, differ = model_differences(original, config)
    if differ:
        raise ValueError(f"the original config.json describes another model: {'; '.join(differ)}")
    hf = dict(original)
    dtype = str(config.params_dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):  # transformers 5's name, and the older one
        if key in hf:
            hf[key] = dtype
    return hf


def generation_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` of a model whose ``config.json`` is ``hf``: its token
    ids (transformers stops generating at ``eos_token_id``)."""
    return {key: hf[key] for key in TOKEN_IDS if hf.get(key) is not None}


def hf_config_from_gpt(config: GPTConfig, model_type: str) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as a Hugging Face ``model_type`` model."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} unknown; one of {', '.join(MODEL_TYPES)}")
    common = {
        "architectures": [_HF_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "torch_dtype": str(config.params_dtype).removeprefix("torch."),
    }
    if model_type == "gpt2":
        _expect_gelu_attention(config, model_type, "learned_absolute")
        return {
            **common,
            "n_embd": config.hidden_size,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size,
            "n_positions": config.max_position_embeddings,
            "activation_function": "gelu_new" if config.activation == "gelu" else "gelu",
            "layer_norm_epsilon": config.layernorm_epsilon,
            "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout,
            "attn_pdrop": config.attention_dropout,
        }
    if model_type == "gpt_neox":
        _expect_gelu_attention(config, model_type, "rope")
        return {
            **common,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "hidden_act": "gelu" if config.activation == "gelu_erf" else "gelu_new",
            "layer_norm_eps": config.layernorm_epsilon,
            "max_position_embeddings": config.max_position_embeddings,
            "rotary_pct": config.rotary_percent,
            "rotary_emb_base": float(config.rotary_base),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": float(config.rotary_base),
                "partial_rotary_factor": config.rotary_percent,
            },
            "use_parallel_residual": False,
            "attention_bias": True,
            "hidden_dropout": config.hidden_dropout,
            "attention_dropout": config.attention_dropout,
        }
    _expect(config, model_type, normalization="RMSNorm", activation="swiglu")
    _expect(config, model_type, position_embedding_type="rope", add_bias_linear=False)
    _expect(config, model_type, add_qkv_bias=model_type in ("qwen2", "qwen2_moe"))
    if (model_type in MOE_TYPES) != (config.num_moe_experts is not None):
        which = "without" if config.num_moe_experts is None else "with"
        raise ValueError(f"{model_type} cannot express a model {which} experts")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": float(config.rotary_base)}
        rope.update(config.rope_scaling)
    if config.rotary_percent != 1.0:
        rope["partial_rotary_factor"] = config.rotary_percent
    return {
        **common,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "rms_norm_eps": config.layernorm_epsilon,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": float(config.rotary_base),
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "rope_parameters": rope,
        "attention_dropout": config.attention_dropout,
        "attention_bias": False,
        "mlp_bias": False,
        **({"sliding_window": None, "use_sliding_window": False} if model_type != "llama" else {}),
        **(_hf_moe_fields(config, model_type) if model_type in MOE_TYPES else {}),
    }


def _hf_moe_fields(config: GPTConfig, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts keys of a Mixtral or Qwen2-MoE ``config.json``."""
    _expect(config, model_type, moe_router_score_function="softmax", moe_router_pre_softmax=True)
    common = {"num_experts_per_tok": config.moe_router_topk, "router_jitter_noise": 0.0}
    if model_type == "mixtral":
        _expect(config, model_type, moe_layer_freq=1, moe_router_norm_topk_prob=True)
        _expect(config, model_type, moe_shared_expert_intermediate_size=None)
        _expect(config, model_type, ffn_hidden_size=config.moe_ffn_hidden_size)
        return {**common, "num_local_experts": config.num_moe_experts}
    shared = config.moe_shared_expert_intermediate_size
    _expect(config, model_type, moe_shared_expert_gate=shared is not None)
    freq = config.moe_layer_freq
    return {
        **common,
        "num_experts": config.num_moe_experts,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": shared or 0,
        "norm_topk_prob": config.moe_router_norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.num_layers) if i % freq],
        "qkv_bias": True,
    }


def _expect(config: GPTConfig, model_type: str, **wanted: Any) -> None:
    for name, value in wanted.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"{model_type} needs {name}={value!r}, the model has {getattr(config, name)!r}"
            )


def _expect_gelu_attention(config: GPTConfig, model_type: str, positions: str) -> None:
    """GPT-2 and GPT-NeoX: LayerNorm, biases, a GeLU and one key/value head per query head."""
    _expect(config, model_type, normalization="LayerNorm", add_bias_linear=True)
    _expect(config, model_type, position_embedding_type=positions)
    if config.activation not in ("gelu", "gelu_erf"):
        raise ValueError(f"{model_type} cannot express activation {config.activation!r}")
    if config.num_query_groups != config.num_attention_heads:
        raise ValueError(f"{model_type} cannot express grouped-query attention")
