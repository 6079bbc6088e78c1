"""tools/benchmarks/zero_memory.py on a tiny model: measured model-state bytes per rank equal the
ZeRO formula (buckets here need no padding); stage 2 sends one reduce-scatter per
microbatch where stage 1 sends one per step, and stage 3 gathers the weights for every
forward (and the layers' again for backward) instead of once after the step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # one subprocess run of the benchmark
def test_zero_memory_matches_the_formula(tmp_path):
    out = tmp_path / "zero.json"
    command = [sys.executable, "tools/benchmarks/zero_memory.py", "--dp", "2"]
    command += ["--stages", "0", "1", "2", "3"]
    command += ["--layers", "1", "--hidden", "64", "--vocab", "256", "--seq", "16"]
    command += ["--microbatches", "2", "--steps", "1", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("$ python tools/benchmarks/zero_memory.py")
    results = {r["stage"]: r for r in json.loads(out.read_text())["results"]}
    for stage, result in results.items():
        for rank in result["ranks"]:
            for kind, expected in result["formula"].items():
                assert rank[kind] == expected, (stage, kind)
    sent = {s: r["ranks"][0]["sent_bytes_per_step"] for s, r in results.items()}
    phi = results[0]["ranks"][0]["phi"]
    # Besides the gradients and weights, a few scalars (the loss, the norm): under 64 bytes.
    expected = {
        0: 4 * phi,  # an all-reduce of fp32 gradients over two ranks
        1: 2 * phi + phi,  # reduce-scatter fp32 gradients, all-gather bf16 weights
        2: 2 * (2 * phi) + phi,  # a reduce-scatter per microbatch (two of them)
        # per microbatch: every weight gathered for forward, the layers' again for backward
        # (the embedding and output layer stay whole in between), a reduce-scatter
        3: 2 * (phi + results[3]["ranks"][0]["phi_layers"] + 2 * phi),
    }
    for stage, value in expected.items():
        assert 0 <= sent[stage] - value < 64, (stage, sent[stage], value)
