"""Timelines: Chrome traces and Gantt charts from simulated and measured events."""

import json

from megapp.pipeline_parallel import build_schedule, simulate
from megapp.pipeline_parallel.simulate import Event
from megapp.pipeline_parallel.timeline import chrome_trace, plot_timelines, write_chrome_trace


def test_chrome_trace_has_one_slice_per_event(tmp_path):
    timeline = simulate(build_schedule("1f1b", 2, 3))
    trace = chrome_trace(timeline.events, time_unit_s=0.1)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(timeline.events)
    first = next(e for e in slices if e["name"] == "F0" and e["pid"] == 1)
    assert first["ts"] == 0.1e6 and first["dur"] == 0.1e6  # starts after rank 0's F0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1"}
    path = tmp_path / "trace.json"
    write_chrome_trace(timeline.events, path)
    assert json.loads(path.read_text()) == chrome_trace(timeline.events)


def test_gantt_png_of_predicted_and_measured(tmp_path):
    predicted = simulate(build_schedule("interleaved-1f1b", 2, 4, 2)).events
    measured = [Event(0, "compute", "F0", 0.0, 0.5), Event(0, "wait", "p2p", 0.5, 0.7)]
    path = tmp_path / "timeline.png"
    plot_timelines([("predicted", predicted), ("measured", measured)], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
