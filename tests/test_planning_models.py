"""Model presets: every preset is a model pretrain_gpt.py accepts, its parameter count is
the published one, and load_model reads names and flag files or fails in one line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megapp.planning import rank_parameters
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.models import MODELS, load_model

ROOT = Path(__file__).resolve().parents[1]


def _parameters(name: str) -> int:
    preset = MODELS[name]
    config = pretrain_config(Layout(), preset.flags, global_batch_size=8)
    return rank_parameters(config.gpt_config(preset.vocab_size), [0], 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_preset_is_a_valid_model(name):
    preset = MODELS[name]
    config = pretrain_config(Layout(), preset.flags, global_batch_size=8)
    assert config.model.num_layers == preset.num_layers > 0
    assert config.model.seq_length == preset.seq_length > 0
    assert preset.description and "\n" not in preset.description


def _deepseek_v3_excess() -> int:
    """What the DeepSeek-V3 preset's documented approximations add to the model: its first
    three layers' MLP as 256 experts, a shared expert and a router in place of one dense
    MLP of 18432, and 61 layers of the 96-head attention stand-in in place of multi-head
    latent attention (arXiv:2412.19437: query rank 1536, key/value rank 512, 128 heads of
    128 + 64 rotary for queries and keys, 128 for values)."""
    h, swiglu = 7168, 3
    experts = (256 + 1) * swiglu * h * 2048 + 256 * h
    dense = swiglu * h * 18432
    mla = h * 1536 + 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 + 512 * 128 * 256
    mla += 128 * 128 * h
    stand_in = h * (96 + 2 * 48) * 128 + 96 * 128 * h
    return 3 * (experts - dense) + 61 * (stand_in - mla)


APPROXIMATED = {"deepseek-v3": _deepseek_v3_excess}


@pytest.mark.parametrize("name", sorted(n for n, p in MODELS.items() if p.parameters))
def test_parameter_count_is_the_published_size(name):
    published = MODELS[name].parameters
    if name in APPROXIMATED:  # the preset's description names what it adds
        published += APPROXIMATED[name]()
    assert _parameters(name) == pytest.approx(published, rel=0.04)


@pytest.mark.parametrize(
    ("name", "exact"),
    [
        ("llama2-7b", 6_738_415_616),  # the Hugging Face checkpoint's count
        ("llama3-8b", 8_030_261_248),
        ("gpt2", 124_475_904),  # 124,439,808 with the vocabulary unpadded (50257)
    ],
)
def test_parameter_count_to_the_parameter(name, exact):
    assert _parameters(name) == exact


def test_tiny_is_the_cpu_demo_model():
    script = (ROOT / "examples" / "pretrain_gpt_cpu_demo.sh").read_text()
    command = " ".join(script.split("torchrun", 1)[1].replace("\\\n", " ").split())
    demo = shlex.split(command)
    shape = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
    for flag in shape:
        assert MODELS["tiny"].value(flag) == demo[demo.index(flag) + 1]


def test_with_seq_length_grows_learned_positions():
    longer = MODELS["gpt2"].with_seq_length(2048)
    assert longer.seq_length == 2048
    assert longer.value("--max-position-embeddings") == "2048"
    pretrain_config(Layout(), longer.flags, global_batch_size=1)
    assert MODELS["llama2-7b"].with_seq_length(8192).value("--max-position-embeddings") is None


def test_load_model_by_name_and_vocab_override():
    assert load_model("llama2-70b") is MODELS["llama2-70b"]
    assert load_model("gpt2", vocab_size=50304).vocab_size == 50304


def test_unknown_name_fails_in_one_line_listing_the_presets():
    with pytest.raises(ValueError) as error:
        load_model("gpt-5")
    message = str(error.value)
    assert "\n" not in message
    assert "'gpt-5'" in message
    for name in MODELS:
        assert re.search(rf"\b{re.escape(name)}\b", message)


def test_flag_file_with_vocab_size(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text(
        "# a small llama\n--num-layers 2 --hidden-size 64 --num-attention-heads 4\n"
        "--seq-length 32 --swiglu --normalization RMSNorm --vocab-size 1000\n"
    )
    preset = load_model(str(path))
    assert preset.vocab_size == 1000
    assert "--vocab-size" not in preset.flags
    assert preset.num_layers == 2
    assert load_model(str(path), vocab_size=77).vocab_size == 77


def test_flag_file_without_vocab_size_needs_one(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32\n")
    with pytest.raises(ValueError, match="no --vocab-size N"):
        load_model(str(path))
    assert load_model(str(path), vocab_size=500).vocab_size == 500


SHAPE = "--num-layers 2 --hidden-size 64 --seq-length 32"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"{SHAPE} --num-attention-heads 5 --vocab-size 100", "not divisible by"),
        (f"{SHAPE} --num-attention-heads 4 --bogus --vocab-size 100", "unrecognized arguments"),
        (f"{SHAPE} --num-attention-heads 4 --vocab-size x", "--vocab-size needs a positive"),
        (f"{SHAPE} --num-attention-heads x --vocab-size 100", "invalid int value"),
    ],
)
def test_bad_flag_file_fails_in_one_line(tmp_path, text, expected):
    path = tmp_path / "model.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_model(str(path))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and expected in message
    assert "--help" not in message
