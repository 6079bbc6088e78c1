"""tools/benchmarks/bench_preprocess.py runs end to end on a slice of the corpus: it proves both
encoders write the same files before it times them, and reports tokens/s per variant."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("tiktoken")


@pytest.mark.slow
def test_bench_preprocess_checks_then_times(tmp_path):
    out = tmp_path / "pre.json"
    command = [
        sys.executable,
        "tools/benchmarks/bench_preprocess.py",
        *("--max-files", "12", "--rounds", "1", "--workers", "1", "--json", str(out)),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("$ python tools/benchmarks/bench_preprocess.py")
    assert "identical .bin/.idx from both encoders: True" in done.stdout
    report = json.loads(out.read_text())
    assert report["identical"] and report["documents"] == 12
    variants = {(r["encoder"], r["workers"]) for r in report["results"]}
    assert variants == {("python", 1), ("tiktoken", 1)}
    assert all(len(r["seconds"]) == 1 and r["seconds"][0] > 0 for r in report["results"])
