"""Hugging Face configs to megapp's and back, the new architecture fields, and their errors."""

from __future__ import annotations

import sys

import pytest
import torch

from megapp.fusions.rope import rotary_freqs
from megapp.models.gpt import GPTConfig
from megapp.models.hf_config import gpt_config_from_hf, hf_config_from_gpt

transformers = pytest.importorskip("transformers")


def test_llama31_rope_scaling_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = gpt_config_from_hf(config.to_dict())
    freqs = rotary_freqs(2, ours.rotary_dim, ours.rotary_base, scaling=ours.rope_scaling)
    # Row 1 holds position 1's angles: the inverse frequencies, twice.
    assert torch.equal(freqs[1, 0, 0, : ours.rotary_dim // 2], inv_freq)
    unscaled = rotary_freqs(2, ours.rotary_dim, ours.rotary_base)
    assert not torch.equal(freqs, unscaled)  # the scaling changes the long wavelengths


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "llama", "mistral", "qwen2"])
def test_config_round_trip(model_type):
    if model_type == "gpt2":
        config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50)
    elif model_type == "gpt_neox":
        config = GPTConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=50,
            activation="gelu_erf",
            position_embedding_type="rope",
            rotary_percent=0.25,
            share_embeddings_and_output_weights=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    else:
        config = GPTConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=40,
            vocab_size=50,
            activation="swiglu",
            normalization="RMSNorm",
            position_embedding_type="rope",
            add_bias_linear=False,
            add_qkv_bias=model_type == "qwen2",
            rotary_base=1e6,
            rope_scaling_factor=8.0 if model_type == "llama" else None,
            share_embeddings_and_output_weights=False,
            hidden_dropout=0.0,
        )
    hf = hf_config_from_gpt(config, model_type)
    again = gpt_config_from_hf(hf, hidden_dropout=config.hidden_dropout)
    if model_type == "gpt_neox":  # its config keeps dropout; the round trip is exact
        again = gpt_config_from_hf(hf)
    assert again == config
    # transformers reads it back as the same model
    hf_config = transformers.AutoConfig.for_model(**hf)
    assert gpt_config_from_hf(hf_config.to_dict(), hidden_dropout=config.hidden_dropout) == config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(rotary_percent=0.5), "rotary_percent needs position_embedding_type 'rope'"),
        (dict(position_embedding_type="rope", rotary_percent=1.5), r"rotary_percent must be in"),
        (
            dict(position_embedding_type="rope", rotary_percent=0.4),
            "RoPE rotates 3 channels per head",
        ),
        (dict(rope_scaling_factor=8.0), "rope_scaling_factor needs position_embedding_type"),
        (dict(add_qkv_bias=True), "add_qkv_bias is for models without biases on the linear layers"),
        (dict(activation="relu"), "activation must be one of"),
    ],
)
def test_invalid_architecture_fields_fail_at_start(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=10, **fields)


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({"model_type": "bert"}, "model_type 'bert' is not supported"),
        (
            {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 9,
             "scale_attn_by_inverse_layer_idx": True},
            "scale_attn_by_inverse_layer_idx",
        ),
        (
            {"model_type": "mistral", "hidden_size": 8, "intermediate_size": 8,
             "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 9,
             "sliding_window": 16, "max_position_embeddings": 64},
            "sliding-window attention",
        ),
        (
            {"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
             "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 9,
             "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            "rope_type 'yarn' is not supported",
        ),
    ],
)  # fmt: skip
def test_unsupported_hugging_face_configs_fail_in_one_line(hf, message):
    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf(hf)


def test_missing_safetensors_is_one_line(monkeypatch, tmp_path):
    from megapp.models.hf_weights import SafetensorsFolder

    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match="needs the `safetensors` package: pip install"):
        SafetensorsFolder(str(tmp_path))


LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 50,
}


def test_a_missing_field_is_named_in_one_line():
    hf = {k: v for k, v in LLAMA.items() if k != "vocab_size"}
    with pytest.raises(ValueError, match=r"^llama config.json has no 'vocab_size'$"):
        gpt_config_from_hf(hf)


def test_a_sliding_window_model_runs_within_one_window():
    hf = dict(LLAMA, model_type="mistral", sliding_window=16, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"run it within one window: --max-position-embeddings 16"):
        gpt_config_from_hf(hf)
    # the suggested context is taken: the model imports and runs over 16 positions
    assert gpt_config_from_hf(hf, max_position_embeddings=16).max_position_embeddings == 16
    with pytest.raises(ValueError, match="over a 17-token context"):
        gpt_config_from_hf(hf, max_position_embeddings=17)


@pytest.mark.parametrize(
    ("hf", "dropout"),
    [
        (dict(LLAMA, attention_dropout=0.0), (0.0, 0.0)),
        (dict(LLAMA, model_type="qwen2", attention_dropout=0.25), (0.0, 0.25)),
        (
            {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 50,
             "n_positions": 64, "resid_pdrop": 0.05, "attn_pdrop": 0.0},
            (0.05, 0.0),
        ),
    ],
)  # fmt: skip
def test_flags_build_the_model_with_its_dropout(hf, dropout):
    from megapp.training.arguments import config_from_flags
    from megapp.training.hf_start import pretrain_flags

    model = gpt_config_from_hf(hf)
    flags = pretrain_flags(model)
    run = ["--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0"]
    config = config_from_flags([*flags, *run, "--use-default-corpus"], world_size=1)
    built = config.gpt_config(model.vocab_size)
    assert (built.hidden_dropout, built.attention_dropout) == dropout
    from megapp.models.hf_config import model_differences

    assert model_differences(hf, built)[1] == []


def test_export_of_a_model_trained_from_scratch_names_its_token_ids():
    from megapp.models.hf_config import exported_config, generation_config

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=300)
    hf = exported_config(config, "gpt2", eod=256)
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (256, 256)
    assert generation_config(hf) == {"bos_token_id": 256, "eos_token_id": 256}
    # transformers takes them as they are, not its GPT-2 default of 50256
    assert transformers.AutoConfig.for_model(**hf).eos_token_id == 256


def test_export_refuses_a_type_the_model_is_not():
    from megapp.models.hf_config import exported_config

    llama = gpt_config_from_hf(LLAMA)
    with pytest.raises(ValueError, match="gpt2 needs normalization='LayerNorm'"):
        exported_config(llama, "gpt2")
    with pytest.raises(ValueError, match=r"the model is a llama model .* export it as llama"):
        exported_config(llama, "mistral", original=LLAMA)
    with pytest.raises(ValueError, match="describes another model: num_layers 3"):
        exported_config(gpt_config_from_hf(dict(LLAMA, num_hidden_layers=3)), "llama", LLAMA)
