"""Timelines: Chrome traces and Gantt charts from simulated and measured events."""

import json

import numpy as np

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
    # The charts are stacked in the given order: the predicted one (top) has forward (blue)
    # and backward (orange) bars, the measured one (bottom) a forward bar and no backward.
    from matplotlib import image as png  # a dev extra, as plotting itself

    image = png.imread(path)[..., :3]
    top, bottom = np.array_split(image, 2, axis=0)
    assert _pixels(top, FORWARD) > 100 and _pixels(top, BACKWARD) > 100
    assert _pixels(bottom, FORWARD) > 100 and _pixels(bottom, BACKWARD) == 0


FORWARD, BACKWARD = (0x4C, 0x78, 0xA8), (0xF5, 0x85, 0x18)


def _pixels(image: np.ndarray, rgb: tuple[int, int, int]) -> int:
    """How many pixels of ``image`` (floats in [0, 1]) have the colour ``rgb``."""
    return int((np.abs(image - np.array(rgb) / 255).max(axis=-1) < 2 / 255).sum())
