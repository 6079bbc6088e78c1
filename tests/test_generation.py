"""Generation with a key/value cache: transformers' greedy tokens, under tp too, and the tool.

The tiny models are initialised with std 0.3 (not 0.02), so their next-token choices
vary instead of repeating one token, and greedy agreement means something.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from megapp import parallel_state as ps
from megapp.models.generation import KVCache, Sampling, generate
from megapp.models.gpt import build_gpt_chunks
from megapp.models.hf_checkpoint import hf_gpt_config, load_hf
from megapp.testing import distributed
from megapp.training.launch import REPOSITORY, launch_env

transformers = pytest.importorskip("transformers")
VOCAB, NEW = 300, 24


def _models():
    t, small = transformers, dict(vocab_size=VOCAB, initializer_range=0.3)
    llama = dict(small, hidden_size=64, intermediate_size=80, num_hidden_layers=2)
    llama.update(num_attention_heads=8, num_key_value_heads=4)
    return {
        "gpt2": t.GPT2LMHeadModel(t.GPT2Config(**small, n_embd=64, n_layer=2, n_head=4)),
        "llama31": t.LlamaForCausalLM(
            t.LlamaConfig(
                **llama,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            )
        ),
        "qwen2": t.Qwen2ForCausalLM(t.Qwen2Config(**llama)),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model's folder, a prompt batch and transformers' greedy continuation."""
    root = tmp_path_factory.mktemp("generation")
    torch.manual_seed(0)
    prompt = torch.randint(32, 127, (2, 6))  # printable ASCII: text the tool can take
    for name, model in _models().items():
        model.eval().save_pretrained(root / name)
        with torch.no_grad():
            greedy = model.generate(
                prompt,
                max_new_tokens=NEW,
                do_sample=False,
                attention_mask=torch.ones_like(prompt),
                pad_token_id=0,
            )
        torch.save({"prompt": prompt, "greedy": greedy}, root / name / "greedy.pt")
    return root


def load(directory, tp=1, tp_group=None, tp_rank=0):
    config, model_type = hf_gpt_config(
        str(directory), hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp
    )
    (model,) = build_gpt_chunks(config, tp_group=tp_group)
    load_hf([model], str(directory), model_type, tp_rank, tp)
    return model.eval()


@pytest.mark.parametrize("name", ["gpt2", "llama31", "qwen2"])
def test_greedy_tokens_equal_transformers(models, name):
    reference = torch.load(models / name / "greedy.pt")
    ours = generate(load(models / name), reference["prompt"], NEW)
    assert len(set(ours[0, 6:].tolist())) > 5  # the continuation varies
    assert torch.equal(ours, reference["greedy"])


@pytest.mark.parametrize("name", ["gpt2", "llama31"])
def test_cached_logits_equal_a_full_forward(models, name):
    model = load(models / name)
    tokens = torch.load(models / name / "greedy.pt")["greedy"]
    cache = KVCache(model)
    cache.logits(tokens[:, :6])
    for t in range(6, tokens.shape[1]):
        cached = cache.logits(tokens[:, t : t + 1])
        with torch.no_grad():
            full = model(tokens[:, : t + 1])[:, -1, :VOCAB]
        # One query row at a time against whole matrices: with std-0.3 weights the fp32
        # round-off reaches a few 1e-6 of the largest logit (in float64 the two paths
        # agree to the float32 cast of the result).
        torch.testing.assert_close(cached, full, atol=1e-5 * full.abs().max(), rtol=0)


def test_sampling_rules(models):
    model = load(models / "llama31")
    prompt = torch.load(models / "llama31" / "greedy.pt")["prompt"]
    greedy = generate(model, prompt, 8)
    top1 = Sampling(greedy=False, temperature=0.7, top_k=1)
    assert torch.equal(generate(model, prompt, 8, top1, seed=5), greedy)
    tiny_p = Sampling(greedy=False, top_p=1e-6)  # only the most likely token survives
    assert torch.equal(generate(model, prompt, 8, tiny_p, seed=5), greedy)
    free = Sampling(greedy=False, temperature=1.5)
    first, again = (
        generate(model, prompt, 8, free, seed=1),
        generate(model, prompt, 8, free, seed=1),
    )
    assert torch.equal(first, again) and not torch.equal(first, greedy)
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0)):
        with pytest.raises(ValueError, match="sampling needs"):
            Sampling(greedy=False, **bad)
    eod = int(greedy[0, 7])  # stop the first sequence at its second new token
    stopped = generate(model, prompt, 8, eod=eod)
    assert stopped[0, 7] == eod and (stopped[0, 8:] == eod).all()


@pytest.mark.slow  # greedy decoding stays fast in one process above
@pytest.mark.parametrize("tp", [2, 4])
@distributed(world_size=4, timeout=120)
def test_tensor_parallel_greedy_equals_transformers(models, tp):
    ps.initialize_model_parallel(tp, 1)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    for name in ("gpt2", "llama31"):
        reference = torch.load(models / name / "greedy.pt")
        ours = generate(load(models / name, tp, group, rank), reference["prompt"], NEW)
        assert torch.equal(ours, reference["greedy"]), name


@pytest.mark.slow  # a subprocess run of the tool; test_tool_takes_token_ids runs it in-process
def test_tool_prints_the_same_tokens(models):
    reference = torch.load(models / "gpt2" / "greedy.pt")
    text = bytes(reference["prompt"][0].tolist()).decode("ascii")
    tool = REPOSITORY / "tools" / "checkpoint" / "generate.py"
    command = [sys.executable, str(tool), "--hf", str(models / "gpt2")]
    command += ["--tokenizer-type", "ByteTokenizer", "--prompt", text, "--ids"]
    command += ["--max-new-tokens", str(NEW)]
    run = subprocess.run(command, capture_output=True, text=True, env=launch_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(reference["greedy"][0].tolist())


def generate_tool(capsys, *args):
    """tools/checkpoint/generate.py run in this process: (exit status, stdout, stderr lines)."""
    from tools.checkpoint import generate as tool

    capsys.readouterr()  # what ran before is not the tool's
    try:
        status = tool.main([str(a) for a in args])
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err.strip().splitlines()


def test_tool_takes_token_ids(models, capsys):
    reference = torch.load(models / "gpt2" / "greedy.pt")
    ids = [",".join(map(str, row)) for row in reference["prompt"].tolist()]
    # the folder has no tokenizer: the ids are all it needs
    status, out, err = generate_tool(
        capsys, "--hf", models / "gpt2", "--prompt-ids", ids[0], "--prompt-ids", ids[1],
        "--max-new-tokens", NEW,
    )  # fmt: skip
    assert status == 0, err
    assert out.splitlines() == [str(row) for row in reference["greedy"].tolist()]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "", "--tokenizer-type", "ByteTokenizer"], "--prompt '' has no tokens"),
        (["--prompt-ids", "1,300"], r"--prompt-ids: ids \[300\] are outside the model's vocab"),
        (["--prompt", "abc"], "no tokenizer: give --tokenizer-type"),
        (["--prompt-ids", "1", "--max-new-tokens", "-1"], "max_new_tokens must be >= 0"),
    ],
)
def test_tool_bad_inputs_end_in_one_line(models, capsys, args, message):
    status, _, err = generate_tool(capsys, "--hf", models / "gpt2", *args)
    assert status == 2
    assert len(err) == 1 and err[0].startswith("generate.py: error: "), err
    assert re.search(message, err[0]), err
