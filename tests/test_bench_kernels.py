"""tools/benchmarks/bench_kernels.py runs end to end on the CPU for one op with two rounds,
compares megapp with its reference before timing, and reports bandwidth from the op's minimal
byte count."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # one subprocess run of the benchmark


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "kernels.json"
    command = [
        sys.executable,
        str(ROOT / "tools" / "benchmarks" / "bench_kernels.py"),
        *("--device", "cpu", "--ops", "bias_gelu", "--dtypes", "fp32", "--passes", "fwd"),
        *("--budget-s", "0.05", "--min-repeats", "2", "--repeats", "2", "--warmup", "1"),
        *("--retries", "0", "--json", str(out)),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())


def test_header_names_the_command_and_sources(run):
    stdout, report = run
    assert stdout.startswith("$ python ") and report["command"].startswith("python ")
    assert "\nsources: " in stdout and "| bias_gelu |" in stdout


def test_bandwidth_is_minimal_bytes_over_the_median(run):
    _, report = run
    (row,) = report["devices"]["cpu"]["rows"]
    x = 1024 * 4 * 1024 * 4  # [s, b, h] fp32
    assert row["bytes"] == 2 * x + 1024 * 4  # read x and bias, write y
    assert len(row["samples_s"]["megapp"]) == 2
    median = statistics.median(row["samples_s"]["megapp"])
    assert row["gbps"] == pytest.approx(row["bytes"] / median / 1e9)
    assert row["hbm_pct"] is None  # no HBM on a CPU


def test_megapp_was_checked_against_its_reference(run):
    _, report = run
    check = report["devices"]["cpu"]["notes"]["bias_gelu"]["checks"]["fp32"]
    assert float(check.split("y ", 1)[1].split(",")[0]) < 1e-5
