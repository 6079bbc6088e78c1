"""tools/benchmarks/bench_gpt.py: the correctness guard (the plain-PyTorch GPT it times megapp
against computes the same loss and gradients as GPTModel from the same weights, and the guard
notices when it does not), a run of the tool end to end with a toy model, and its MFU
measurement on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapp.benchmarks.gpt_mfu import throughput
from megapp.models import GPTConfig, GPTModel
from megapp.testing.plain_gpt import PlainGPT, compare, megapp_qkv_to_plain, plain_qkv_to_megapp

ROOT = Path(__file__).resolve().parents[1]
# l 2, h 32, 4 heads, s 16, V 64: per token 2·(6144 + 2048 + 2048 + 16384) + 4096 = 57344
# forward FLOPs (see tests/test_flops.py for the terms), × 3 for the training step.
TOY = dict(layers=2, hidden=32, heads=4, seq=16, vocab=64)
TOY_FLOPS_PER_TOKEN = 3 * 57344


def _config(dtype: torch.dtype, **overrides) -> GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=61,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
    )
    return GPTConfig(**{**base, **overrides})


def _batch(vocab: int = 61) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (3, 17), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


@pytest.mark.parametrize(
    "dtype, tolerance",
    # float64: the models differ only in summation order, so round-off of 1e-16 per op;
    # float32: the bench's own tolerance (plain_gpt.TOLERANCE), ~1e-6 observed.
    [(torch.float64, 1e-12), (torch.float32, None)],
)
def test_plain_gpt_has_gptmodels_loss_and_gradients(dtype, tolerance):
    model = GPTModel(_config(dtype), seed=7)
    plain = PlainGPT.from_megapp(model)
    agreement = compare(model, plain, *_batch(), tolerance=tolerance)
    assert agreement.ok, str(agreement)
    assert agreement.max_grad_rel < 1e-5  # every gradient present, none far off
    assert all(p.grad is None for p in model.parameters())  # cleared for the timing


def test_guard_catches_a_wrong_weight_and_a_wrong_layout():
    model = GPTModel(_config(torch.float64), seed=7)
    tokens, labels = _batch()
    plain = PlainGPT.from_megapp(model)
    with torch.no_grad():  # one fc2 weight of one layer off by 1e-3 of its scale
        plain.blocks[1].fc2_w[3, 5] += 2e-5
    agreement = compare(model, plain, tokens, labels)
    assert not agreement.ok
    assert agreement.worst.startswith("decoder.layers.")

    plain = PlainGPT.from_megapp(model)
    with torch.no_grad():  # megapp's head-major QKV rows taken as [Q; K; V]
        for block in plain.blocks:
            block.qkv_w.copy_(plain_qkv_to_megapp(block.qkv_w, 4))
    assert not compare(model, plain, tokens, labels).ok


def test_qkv_reordering_round_trips_and_unsupported_configs_fail():
    rows = torch.arange(3 * 4 * 2).view(-1, 1)  # 4 heads of width 2
    plain = megapp_qkv_to_plain(rows, 4)
    assert plain[:2].flatten().tolist() == [0, 1]  # q of head 0
    assert plain[2:4].flatten().tolist() == [6, 7]  # q of head 1 follows, not k of head 0
    assert torch.equal(plain_qkv_to_megapp(plain, 4), rows)
    with pytest.raises(ValueError, match="cannot mirror"):
        PlainGPT.from_megapp(GPTModel(_config(torch.float32, activation="swiglu")))


@pytest.mark.slow
def test_the_tool_runs_overhead_and_layouts_end_to_end(tmp_path):
    out = tmp_path / "bench_gpt.json"
    command = [
        sys.executable, str(ROOT / "tools" / "benchmarks" / "bench_gpt.py"),
        *(x for k, v in TOY.items() for x in (f"--{k}", str(v))),
        *("--batch", "4", "--repeats", "2", "--warmup", "1", "--target", "1e9"),
        *("--no-reference-tier", "--no-ablation", "--layouts", "1,1,2,-"),
        *("--global-batch", "4", "--micro-batch", "2", "--iters", "1", "--warmup-iters", "0"),
        *("--json", str(out)),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("$ python ") and "\nsources: commit " in done.stdout
    report = json.loads(out.read_text())
    overhead = report["overhead"]
    assert set(overhead["median_ms"]) == {"megapp", "stack", "plain"}
    assert overhead["flops_per_step"] == 4 * 16 * TOY_FLOPS_PER_TOKEN
    agreement = overhead["agreement"]
    assert agreement["max_grad_rel"] <= agreement["tolerance"]
    (layout,) = report["layouts"]
    assert layout["ranks"] == 2 and len(layout["times_s"]) == 1
    # The same model and batch on two pipeline stages: the guarded single-process loss.
    assert layout["first_loss"] == pytest.approx(agreement["loss"], rel=1e-5)


def test_mfu_measurement_on_the_cpu():
    args = argparse.Namespace(
        **TOY, batch=2, global_batch=4, micro_batch=2, iters=2, warmup_iters=1
    )
    r = throughput(args, torch.device("cpu"), torch.float32, peak=1.0)
    assert r["flops_per_iteration"] == 4 * 16 * TOY_FLOPS_PER_TOKEN
    assert r["tflops_per_device"] == pytest.approx(
        r["flops_per_iteration"] / r["iteration_s"] / 1e12
    )
    assert r["mfu"] == pytest.approx(r["tflops_per_device"])  # against a 1 TFLOP/s peak
    assert len(r["times_s"]) == 2 and r["max_memory_allocated_gib"] is None
