"""What the training loop reports: the FLOP count behind the throughput, Megatron's log
line and evaluation block, and the JSON-lines metrics file."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import pretrain_gpt
from megapp.models import GPTModel
from megapp.training.metrics import (
    MetricsWriter,
    format_eval_lines,
    format_train_line,
    peak_tflops,
    perplexity,
)
from tests.support import args_for


@pytest.mark.parametrize("swiglu", [False, True])
def test_flops_match_a_count_of_the_model_forward(swiglu):
    """The throughput's FLOPs are 3 × what torch counts in the model's forward pass."""
    config = args_for(
        "--micro-batch-size 1 --global-batch-size 3 --num-query-groups 2"
        + (" --swiglu" if swiglu else ""),
        1,
    )
    vocab = 384  # a multiple of 128: no padding rows
    model = GPTModel(
        dataclasses.replace(
            config.gpt_config(vocab),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attention_backend="fused_softmax",  # explicit matmuls (no CPU sdpa kernel counted)
        )
    )
    seq = config.model.seq_length
    tokens = torch.randint(0, vocab, (config.training.global_batch_size, seq))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens)
    assert pretrain_gpt.flops_per_iteration(config, vocab) == 3 * counter.get_total_flops()


def _fields(line: str) -> dict[str, str]:
    """The ``name: value`` fields of a log line as Megatron's log readers split it (on
    ``|``), and its ``iteration N/M`` field as ``"iteration": "N/M"``; padding ignored."""
    fields = {}
    for part in line.split("|"):
        part = " ".join(part.split())
        if ": " in part:
            name, value = part.split(": ", 1)
            fields[name] = value
        elif part.startswith("iteration "):
            fields["iteration"] = part.removeprefix("iteration ").replace(" ", "")
        elif part:
            fields[part] = ""  # a heading such as "validation loss at iteration 10"
    return fields


def test_log_line_has_megatrons_fields():
    """The fields Megatron's log line has, in its order, names and number formats."""
    record = {
        "iteration": 10,
        "consumed_samples": 640,
        "elapsed_ms_per_iteration": 123.45,
        "tflops_per_device": 412.34,
        "mfu": 0.41693,
        "tokens_per_second_per_device": 2345.6,
        "learning_rate": 1e-4,
        "global_batch_size": 64,
        "lm_loss": 5.1234564,
        "loss_scale": 1.0,
        "grad_norm": 1.23449,
        "skipped_iterations": 0,
        "nan_iterations": 0,
    }
    line = format_train_line(record, 100)
    assert "\n" not in line
    fields = _fields(line)
    assert list(fields.items()) == [
        ("iteration", "10/100"),
        ("consumed samples", "640"),
        ("elapsed time per iteration (ms)", "123.5"),
        ("throughput per GPU (TFLOP/s/GPU)", "412.3"),
        ("MFU", "41.7%"),
        ("tokens per second", "2345.6"),
        ("learning rate", "1.000000E-04"),
        ("global batch size", "64"),
        ("lm loss", "5.123456E+00"),
        ("loss scale", "1.0"),
        ("grad norm", "1.234"),
        ("number of skipped iterations", "0"),
        ("number of nan iterations", "0"),
    ]
    cpu = _fields(format_train_line({**record, "mfu": None, "tflops_per_device": 0.00123}, 100))
    assert "MFU" not in cpu and cpu["throughput per GPU (TFLOP/s/GPU)"] == "0.0012"
    block = format_eval_lines(
        {"split": "valid", "where": "iteration 10", "lm_loss": 2.0, "lm_loss_ppl": 7.389056}
    ).splitlines()
    # the values between two rules of dashes, as Megatron prints them
    assert len(block) == 3 and set(block[0]) == set(block[2]) == {"-"}
    assert list(_fields(block[1]).items()) == [
        ("validation loss at iteration 10", ""),
        ("lm loss value", "2.000000E+00"),
        ("lm loss PPL", "7.389056E+00"),
    ]
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None


def test_metrics_file_is_appended_strict_json(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    writer.write({"kind": "train", "iteration": 1, "lm_loss": 5.25, "grad_norm": float("nan")})
    writer.close()
    again = MetricsWriter(str(path))  # a resumed run continues the same file
    again.write({"kind": "eval", "iteration": 2, "lm_loss": 1 / 3, "lm_loss_ppl": math.inf})
    again.close()
    lines = path.read_text().splitlines()
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # no NaN/Infinity
    assert records[0] == {"kind": "train", "iteration": 1, "lm_loss": 5.25, "grad_norm": None}
    assert records[1]["lm_loss"] == 1 / 3 and records[1]["lm_loss_ppl"] is None  # exact floats
    assert perplexity(2.0) == math.exp(2.0) and perplexity(1e4) == math.exp(20.0)
