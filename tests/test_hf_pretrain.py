"""A Hugging Face model through pretrain_gpt.py and back, bitwise.

HF folder -> `pretrain_gpt.py --load-hf` under tp 2 x pp 2 (one step at learning rate 0,
so the weights stay what they were) -> `--save-hf` from that layout, and a megapp
checkpoint -> resumed in one process (tp 1) with `--save-hf`, and exported by
`tools/convert_hf.py export`: all three folders hold the original tensors bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.test_hf_interop import hf_tensors
from tests.test_pretrain_e2e import ENV, ROOT, launch

transformers = pytest.importorskip("transformers")

RUN = [
    *("--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"),
    *("--lr", "0", "--min-lr", "0", "--train-iters", "1", "--eval-iters", "0"),
    *("--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"),
]


def generate_tool(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "generate.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def tool(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_hf.py"), *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )


def assert_same_tensors(exported, original):
    ours, theirs = hf_tensors(exported), hf_tensors(original)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_hf_to_tp2_pp2_to_checkpoint_to_one_process_to_hf_is_bitwise(corpus, tmp_path):
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=300,  # the byte tokenizer's 257 ids fit
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
    # Runs that need only the folder, or only the checkpoint, go side by side: each is
    # one process, and the machine has two cores.
    with ThreadPoolExecutor(max_workers=3) as pool:
        args = ["--prompt", "def main(", "--max-new-tokens", "12", "--ids"]
        hf_text = pool.submit(
            generate_tool, "--hf", source, "--tokenizer-type", "ByteTokenizer", *args
        )
        flags = tool("flags", source)
        assert flags.returncode == 0, flags.stderr
        model_flags = flags.stdout.split()
        assert "--use-rope-scaling" in model_flags and "--swiglu" in model_flags
        data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]

        layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
        first = launch(
            4,
            *layout,
            *model_flags,
            *RUN,
            *data,
            *("--load-hf", source, "--save", tmp_path / "ckpt"),
            *("--save-hf", tmp_path / "from_tp2pp2"),
            cwd=tmp_path,
        )
        assert first.returncode == 0, first.stderr[-4000:]

        # The checkpoint, read three ways at once: resumed in one process, exported, generating.
        second = pool.submit(
            launch,
            1,
            *model_flags,
            *RUN,
            *data,
            # The same flags resume: --load's checkpoint wins over --load-hf's weights.
            *("--load", tmp_path / "ckpt", "--load-hf", source, "--save-hf", tmp_path / "from_tp1"),
            cwd=tmp_path,
        )
        export = ("export", tmp_path / "ckpt", "--output", tmp_path / "tool")
        exported = pool.submit(tool, *export, "--model-type", "llama")
        checkpoint_text = pool.submit(generate_tool, "--load", tmp_path / "ckpt", *args)
        assert_same_tensors(tmp_path / "from_tp2pp2", source)

    second = second.result()
    assert second.returncode == 0, second.stderr[-4000:]
    assert_same_tensors(tmp_path / "from_tp1", source)

    exported = exported.result()
    assert exported.returncode == 0, exported.stderr
    assert_same_tensors(tmp_path / "tool", source)

    # The checkpoint and the original folder generate the same text (the run's byte
    # tokenizer comes from the checkpoint's settings).
    from_checkpoint, from_hf = checkpoint_text.result(), hf_text.result()
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr
    assert from_hf.returncode == 0, from_hf.stderr
    assert from_checkpoint.stdout == from_hf.stdout
    assert from_checkpoint.stdout.startswith(str(list(b"def main("))[:-1])


def test_load_hf_refuses_flags_that_describe_another_model(corpus, tmp_path):
    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    wrong = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4"]
    run = launch(1, *wrong, *RUN, *data, "--load-hf", tmp_path / "hf", cwd=tmp_path)
    assert run.returncode != 0
    assert "--load-hf" in run.stderr and "num_layers 3 (the model: 2)" in run.stderr
    assert "its flags are: --num-layers 2 --hidden-size 32" in run.stderr
