"""Hugging Face models imported into megapp under several layouts, and exported back.

Tiny random models of every supported architecture are built by `transformers` from a
config (no download) and saved. megapp loads them (each rank reading its own slices) and
its logits and loss are compared with transformers' own forward; the export is compared
tensor by tensor, bitwise, with the files it came from, and reloads in transformers.

Tolerance: everything is fp32 and both sides compute the same products, but sum them in
other orders (a fused QKV projection, tensor-parallel partial sums, fused attention
against transformers' eager attention), so logits of magnitude about 1 differ by a few
ulps: 1e-5 absolute, 1e-5 relative. The exported weights are copies: bitwise equal.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.models.gpt import build_gpt_chunks
from megapp.models.hf_checkpoint import hf_gpt_config, load_hf, save_hf
from megapp.pipeline_parallel.engine import forward_backward
from megapp.testing import distributed
from tests.support import hf_tensors

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, BATCH, SEQ = 96, 4, 24
TOL = dict(atol=1e-5, rtol=1e-5)


def _configs():
    t = transformers
    small = dict(vocab_size=VOCAB, max_position_embeddings=64)
    llama = dict(
        small,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
    )
    return {
        "gpt2": (
            t.GPT2LMHeadModel,
            t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64),
        ),
        "gpt2_erf": (
            t.GPT2LMHeadModel,
            t.GPT2Config(
                vocab_size=VOCAB,
                n_embd=64,
                n_layer=4,
                n_head=4,
                n_positions=64,
                activation_function="gelu",
            ),
        ),
        # GPT-NeoX: a quarter of each head rotated, erf GeLU, one fused QKV per head.
        "gpt_neox": (
            t.GPTNeoXForCausalLM,
            t.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=64,
                use_parallel_residual=False,
                rotary_pct=0.25,
            ),
        ),
        "llama2": (t.LlamaForCausalLM, t.LlamaConfig(**dict(llama, num_key_value_heads=8))),
        "llama3": (t.LlamaForCausalLM, t.LlamaConfig(**llama, rope_theta=500000.0)),
        "llama31": (
            t.LlamaForCausalLM,
            t.LlamaConfig(
                **llama,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
        "mistral": (
            t.MistralForCausalLM,
            t.MistralConfig(**llama, sliding_window=None, head_dim=16),
        ),
        "qwen2": (
            t.Qwen2ForCausalLM,
            t.Qwen2Config(**llama, rope_theta=1e6, tie_word_embeddings=True),
        ),
    }


ARCHS = sorted(_configs())


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Each architecture saved in a folder, with transformers' logits and loss on one batch."""
    root = tmp_path_factory.mktemp("hf_models")
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    for k, (arch, (cls, config)) in enumerate(sorted(_configs().items())):
        torch.manual_seed(k)
        model = cls(config).eval()
        with torch.no_grad():  # nonzero biases and norm offsets, so every tensor matters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        # One model in several shard files with an index, the others in one file.
        model.save_pretrained(root / arch, max_shard_size="40KB" if arch == "llama3" else "1GB")
        with torch.no_grad():
            logits = model(tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
            )
        torch.save({"tokens": tokens, "logits": logits, "loss": loss}, root / arch / "reference.pt")
    return root


# fast: gpt2 and llama2; the other architectures are slow
@pytest.mark.parametrize(
    "arch",
    [a if a in ("gpt2", "llama2") else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS],
)
def test_one_process_import_matches_transformers_and_exports_bitwise(hf_models, tmp_path, arch):
    source = hf_models / arch
    config, model_type = hf_gpt_config(str(source), hidden_dropout=0.0, attention_dropout=0.0)
    (chunk,) = build_gpt_chunks(config)
    load_hf([chunk], str(source), model_type)
    reference = torch.load(source / "reference.pt")
    tokens = reference["tokens"]
    with torch.no_grad():
        logits = chunk(tokens[:, :-1])[..., :VOCAB]
        loss = chunk(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    torch.testing.assert_close(logits, reference["logits"], **TOL)
    torch.testing.assert_close(loss, reference["loss"], **TOL)

    save_hf([chunk], str(tmp_path / "export"), model_type, max_shard_bytes=30_000)
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "export")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    cls = _configs()[arch][0]
    again = cls.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        assert torch.equal(again(tokens[:, :-1]).logits, reference["logits"])


LAYOUTS = [
    # (world, tp, pp, vpp, sequence parallel, architectures)
    (2, 2, 1, None, False, ["gpt2", "llama31", "qwen2"]),
    (4, 4, 1, None, True, ["llama2", "mistral"]),
    (2, 1, 2, None, False, ["gpt2_erf", "qwen2", "gpt_neox"]),
    (4, 4, 1, None, True, ["gpt_neox"]),
    (4, 2, 2, None, True, ["gpt2", "llama3", "qwen2"]),
    (4, 1, 2, 2, False, ["llama31", "gpt2"]),
]
CASES = [(w, tp, pp, vpp, sp, a) for w, tp, pp, vpp, sp, archs in LAYOUTS for a in archs]


@pytest.mark.slow  # every rank imports transformers; one-process imports stay fast above
@pytest.mark.parametrize("world_size, tp, pp, vpp, sp, arch", CASES)
@distributed(timeout=240)
def test_layouts_import_match_transformers_and_export_bitwise(
    world_size, tp, pp, vpp, sp, arch, hf_models, tmp_path
):
    source = hf_models / arch
    ps.initialize_model_parallel(tp, pp, vpp)
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    config, model_type = hf_gpt_config(
        str(source),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        make_vocab_size_divisible_by=7,  # padded rows under every tp
    )
    chunks = build_gpt_chunks(
        config,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        vpp_size=vpp,
        tp_group=tp_group,
    )
    load_hf(chunks, str(source), model_type, tp_rank, tp)
    reference = torch.load(source / "reference.pt")
    tokens = reference["tokens"]
    microbatches = [tokens[i : i + 1] for i in range(BATCH)]
    logits = []

    def forward_step(iterator, chunk, inputs):
        sample = next(iterator)
        hidden = None if chunk.pre_process else inputs[0]
        ids = sample[:, :-1] if chunk.pre_process else None
        if not chunk.post_process:
            return chunk(input_ids=ids, hidden_states=hidden), None
        shard = chunk(input_ids=ids, hidden_states=hidden)  # [1, s, V_pad/tp]
        parts = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(parts, shard.contiguous(), group=tp_group)
        logits.append(torch.cat(parts, dim=-1)[..., :VOCAB])
        return shard, lambda out: out.sum() * 0

    with torch.no_grad():
        forward_backward(
            forward_step,
            [iter(microbatches) for _ in chunks],
            chunks,
            BATCH,
            pp_group=ps.get_pipeline_model_parallel_group(),
            forward_only=True,
        )
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        assert len(logits) == BATCH
        torch.testing.assert_close(torch.cat(logits), reference["logits"], **TOL)

    export = tmp_path / "export"
    model_group = ps.get_model_parallel_group()
    if ps.get_data_parallel_rank() == 0:  # one replica writes
        save_hf(chunks, str(export), model_type, tp_rank, tp, model_group, max_shard_bytes=50_000)
    if dist.get_rank() == 0:
        original, exported = hf_tensors(source), hf_tensors(export)
        assert sorted(exported) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), name


def _odd_configs():
    """One model per architecture whose config.json differs from transformers' defaults in
    what describes it: token ids, dropout, a context longer than any run's, RoPE settings."""
    t = transformers
    ids = dict(bos_token_id=3, eos_token_id=5, pad_token_id=0)
    rope = dict(
        ids,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attention_dropout=0.125,
        rms_norm_eps=1e-5,
    )
    return {
        "gpt2": (
            t.GPT2LMHeadModel,
            t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48,
                         resid_pdrop=0.0, embd_pdrop=0.25, attn_pdrop=0.0625, **ids),
        ),
        "gpt_neox": (
            t.GPTNeoXForCausalLM,
            t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=2048, use_parallel_residual=False,
                            rotary_pct=0.5, hidden_dropout=0.0625, attention_dropout=0.125,
                            **ids),
        ),
        "llama31": (
            t.LlamaForCausalLM,
            t.LlamaConfig(**rope, rope_theta=500000.0, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        ),
        # a window shorter than the context: megapp runs it within one window
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**rope, sliding_window=64)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**rope, rope_theta=1e6)),
    }  # fmt: skip


@pytest.fixture
def usual_umask():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


@pytest.mark.parametrize("arch", sorted(_odd_configs()))
def test_export_writes_back_the_imported_config(tmp_path, arch, usual_umask):
    cls, hf_config = _odd_configs()[arch]
    torch.manual_seed(0)
    cls(hf_config).save_pretrained(tmp_path / "hf")
    # A run's own settings: its dropout, and (RoPE) the context it trains at.
    run = dict(hidden_dropout=0.1, attention_dropout=0.1, make_vocab_size_divisible_by=128)
    if arch != "gpt2":
        run["max_position_embeddings"] = 32
    config, model_type = hf_gpt_config(str(tmp_path / "hf"), **run)
    (chunk,) = build_gpt_chunks(config)
    load_hf([chunk], str(tmp_path / "hf"), model_type)
    out = tmp_path / "export"
    save_hf([chunk], str(out), model_type, source_dir=str(tmp_path / "hf"))

    for name in ("config.json", "generation_config.json"):
        original = json.loads((tmp_path / "hf" / name).read_text())
        assert json.loads((out / name).read_text()) == original, name
    # transformers reads the same model, token ids and all
    ours, theirs = (
        transformers.AutoConfig.from_pretrained(d).to_dict() for d in (out, tmp_path / "hf")
    )
    ours.pop("_name_or_path"), theirs.pop("_name_or_path")
    assert ours == theirs and ours["eos_token_id"] == 5
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == usual_umask, path.name
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(out)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())


def test_export_of_a_model_from_scratch_writes_its_token_ids(tmp_path, usual_umask):
    config, _ = hf_gpt_config(str(_save_tiny_llama(tmp_path)))
    (chunk,) = build_gpt_chunks(config)
    save_hf([chunk], str(tmp_path / "export"), "llama", eod=7, max_shard_bytes=10_000)
    written = transformers.GenerationConfig.from_pretrained(tmp_path / "export")
    assert (written.bos_token_id, written.eos_token_id) == (7, 7)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "export").eos_token_id == 7
    files = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 4  # several shards
    assert {(tmp_path / "export" / f).stat().st_mode & 0o777 for f in files} == {usual_umask}


def test_export_as_a_type_the_model_is_not_writes_nothing(tmp_path):
    source = _save_tiny_llama(tmp_path)
    config, _ = hf_gpt_config(str(source))
    (chunk,) = build_gpt_chunks(config)
    for model_type, message in (("gpt2", "gpt2 needs normalization"), ("qwen2", "add_qkv_bias")):
        with pytest.raises(ValueError, match=message):
            save_hf([chunk], str(tmp_path / model_type), model_type)
        with pytest.raises(ValueError, match="the model is a llama model"):
            save_hf([chunk], str(tmp_path / model_type), model_type, source_dir=str(source))
        assert not (tmp_path / model_type).exists()


def _save_tiny_llama(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"
