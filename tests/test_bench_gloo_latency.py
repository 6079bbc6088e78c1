"""tools/benchmarks/gloo_latency.py times every collective over the world and over pairs of
neighbouring ranks, on the test worlds."""

from __future__ import annotations

import importlib
import re

gloo_latency = importlib.import_module("tools.benchmarks.gloo_latency")


def test_every_op_is_timed_over_the_world_and_over_pairs(capsys):
    assert gloo_latency.main(["--world-sizes", "2", "4", "--iterations", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# python tools/benchmarks/gloo_latency.py --world-sizes 2 4 --iterations 3"
    rows = [re.fullmatch(r"\| (\d) \| (\w+) \| (\w+) \| (\d+\.\d\d) \|", line) for line in lines]
    timed = {(int(m[1]), m[2], m[3]) for m in rows if m and float(m[4]) > 0}
    ops = gloo_latency.OPS
    # a world of two is one pair: no separate pairs row
    assert timed == {(2, op, "world") for op in ops} | {
        (4, op, g) for op in ops for g in ("world", "pairs")
    }
