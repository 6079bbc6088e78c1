"""tools/benchmarks/bench_tensor_parallel.py runs end to end on tp = 1 and 2 with a small layer,
and what it counted is what the analysis says one layer issues: four all-reduces of s·b·h fp32
without sequence parallelism, six all-gathers and four reduce-scatters with it, on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one subprocess run of the benchmark
ROOT = Path(__file__).resolve().parents[1]
S, B, H = 32, 2, 64


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "tp.json"
    command = [
        sys.executable,
        str(ROOT / "tools" / "benchmarks" / "bench_tensor_parallel.py"),
        *("--tp", "1", "2", "--seq", str(S), "--batch", str(B), "--hidden", str(H)),
        *("--heads", "4", "--iters", "2", "--warmup", "1", "--json", str(out)),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("$ python ")  # the command that produced the figures
    assert "|  on | 6 AG + 4 RS |" in done.stdout  # the traffic table
    return json.loads(out.read_text())


def test_every_layout_ran(report):
    layouts = [(r["tp"], r["sp"], r["threads"]) for r in report["results"]]
    assert [(tp, sp) for tp, sp, _ in layouts] == [(1, False), (1, False), (2, False), (2, True)]
    assert layouts[1][2] == 1  # tp = 1 again on one thread: the per-core baseline


def test_counted_collectives_are_the_analytic_ones(report):
    expected = {
        (1, False): [],
        (2, False): ["fwd AR", "fwd AR", "bwd AR", "bwd AR"],
        (2, True): ["fwd AG", "fwd RS"] * 2 + ["bwd AG", "bwd AG", "bwd RS"] * 2,
    }
    for r in report["results"]:
        counted = [f"{op['phase']} {op['kind']}" for op in r["ops"]]
        assert counted == expected[(r["tp"], r["sp"])]
        assert all(op["payload"] == S * B * H * 4 for op in r["ops"])
        assert r["same_on_every_rank"]
        assert len(r["total"]) == 2 and all(t > 0 for t in r["total"])
