"""A Hugging Face model through pretrain_gpt.py and back, bitwise.

HF folder -> `pretrain_gpt.py --load-hf` under tp 2 x pp 2 (one step at learning rate 0,
so the weights stay what they were) -> `--save-hf` from that layout, and a megapp
checkpoint -> resumed in one process (tp 1) with `--save-hf`, and exported by
`tools/checkpoint/convert_hf.py export`: all three folders hold the original tensors bit for bit,
and the original `config.json` and `generation_config.json`. The runs are pretrain_gpt.py's
main on the ranks of a reused gloo world (:mod:`megapp.testing.pretrain_world`).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from megapp.testing.pretrain_world import run_pretrain_in_world
from tests.support import HF_RUN as RUN
from tests.support import assert_same_model, convert_tool, read_json, tool_main

transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # a pretrain_gpt.py job between the conversions
def test_hf_to_tp2_pp2_to_checkpoint_to_one_process_to_hf_is_bitwise(corpus, tmp_path, capsys):
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=300,  # the byte tokenizer's 257 ids fit
        bos_token_id=11,
        eos_token_id=12,
        max_position_embeddings=16384,  # longer than the runs' sequences
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    source = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    args = ["--prompt", "def main(", "--max-new-tokens", "12", "--ids"]
    hf_text = tool_main(
        capsys, "generate", "--hf", source, "--tokenizer-type", "ByteTokenizer", *args
    )
    status, flags, err = tool_main(capsys, "convert_hf", "flags", source)
    assert status == 0, err
    model_flags = flags.split()
    assert "--use-rope-scaling" in model_flags and "--swiglu" in model_flags
    # Llama's dropout (none), not pretrain_gpt.py's default of 0.1
    assert "--hidden-dropout 0.0 --attention-dropout 0.0" in flags
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]

    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    first = run_pretrain_in_world(
        4,
        [
            *layout,
            *model_flags,
            *RUN,
            *data,
            *("--load-hf", source, "--save", tmp_path / "ckpt"),
            *("--save-hf", tmp_path / "from_tp2pp2"),
        ],
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-4000:]
    assert_same_model(tmp_path / "from_tp2pp2", source)
    saved = read_json(tmp_path / "ckpt" / "iter_0000001" / "common.json")["model_config"]
    assert (saved["hidden_dropout"], saved["attention_dropout"]) == (0.0, 0.0)

    # The checkpoint, read three ways: resumed in one process, exported, generating.
    second = run_pretrain_in_world(
        1,
        [
            *model_flags,
            *RUN,
            *data,
            # The same flags resume: --load's checkpoint wins over --load-hf's weights.
            *("--load", tmp_path / "ckpt", "--load-hf", source),
            *("--save-hf", tmp_path / "from_tp1"),
        ],
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr[-4000:]
    assert_same_model(tmp_path / "from_tp1", source)

    # the checkpoint knows its model's type and config
    status, err = convert_tool(capsys, "export", tmp_path / "ckpt", "--output", tmp_path / "tool")
    assert status == 0, err
    assert_same_model(tmp_path / "tool", source)

    # The checkpoint and the original folder generate the same text (the run's byte
    # tokenizer comes from the checkpoint's settings).
    from_checkpoint = tool_main(capsys, "generate", "--load", tmp_path / "ckpt", *args)
    assert from_checkpoint[0] == 0, from_checkpoint[2]
    assert hf_text[0] == 0, hf_text[2]
    assert from_checkpoint[1] == hf_text[1]
    assert from_checkpoint[1].startswith(str(list(b"def main("))[:-1])

    # The wrong type for a checkpoint ends in one line and writes nothing, whether the
    # checkpoint keeps its model's config or (a copy without it) was trained from scratch.
    scratch = tmp_path / "scratch_ckpt"
    shutil.copytree(tmp_path / "ckpt", scratch, ignore=shutil.ignore_patterns("hf_config"))
    for checkpoint, model_type, message in (
        (tmp_path / "ckpt", "gpt2", "the model is a llama model"),
        (scratch, "gpt2", "gpt2 needs normalization='LayerNorm'"),
        (scratch, None, "keeps no Hugging Face config"),
    ):
        chosen = [] if model_type is None else ["--model-type", model_type]
        status, err = convert_tool(
            capsys, "export", checkpoint, "--output", tmp_path / "wrong", *chosen
        )
        assert status == 2 and len(err) == 1, err
        assert err[0].startswith("convert_hf.py: error: ") and message in err[0], err
        assert not (tmp_path / "wrong").exists()
    # trained from scratch: the token ids are the run's tokenizer's end of document
    status, err = convert_tool(
        capsys, "export", scratch, "--output", tmp_path / "scratch", "--model-type", "llama"
    )
    assert status == 0, err
    byte_eod = 256
    assert read_json(tmp_path / "scratch" / "generation_config.json") == {
        "bos_token_id": byte_eod,
        "eos_token_id": byte_eod,
    }


def test_load_hf_refuses_flags_that_describe_another_model(corpus, tmp_path):
    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    wrong = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4"]
    run = run_pretrain_in_world(
        1, [*wrong, *RUN, *data, "--load-hf", tmp_path / "hf"], cwd=tmp_path
    )
    assert run.returncode != 0
    assert "--load-hf" in run.stderr and "num_layers 3 (the model: 2)" in run.stderr
    assert "its flags are: --num-layers 2 --hidden-size 32" in run.stderr


def test_load_hf_of_a_config_without_a_field_is_one_line(tmp_path, capsys):
    import pretrain_gpt

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main([*model, *RUN, "--use-default-corpus", "--load-hf", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].endswith(
        f"error: --load-hf {tmp_path / 'hf'}: its config.json has no 'vocab_size'"
    )
