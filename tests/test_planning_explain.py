"""The breakdown of a predicted step and of its memory: the lines add up, each is what the
time and memory models price for it, and layout names parse back."""

from __future__ import annotations

import pytest

from megapp.planning.explain import (
    MEMORY_LINES,
    STEP_LINES,
    comparison_rows,
    explain_layout,
    explanation_rows,
    parse_layout,
)
from megapp.planning.explain_text import format_comparison, format_explanation
from megapp.planning.hardware import load_hardware
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.layout_space import Space, layouts
from megapp.planning.memory import predict_memory
from megapp.planning.models import MODELS
from megapp.planning.profiles import time_model
from megapp.planning.search import Planner
from megapp.planning.timing import action_costs, predict, shape_of

TINY = MODELS["tiny"]
# PipeDream-2BW steps each stage on its own: no tied embedding, no global clipping
ASYNC_FLAGS = (*TINY.flags, "--untie-embeddings-and-output-weights", "--clip-grad", "0")
CP_FLAGS = (*TINY.flags, "--attention-dropout", "0")  # context parallelism refuses dropout
MOE_FLAGS = (*TINY.flags, "--num-experts", "4", "--moe-router-topk", "2")
H100 = time_model(load_hardware("h100"))
GBS, GPUS = 16, 8

LAYOUTS = [
    "tp2.pp2.dp2.v1.mb1.1f1b.sp.selective.z1",
    "tp1.pp2.dp4.v2.mb1.interleaved-1f1b.full.z3",
    "tp2.pp2.dp2.v2.mb1.zb-v.norecompute.z2",
    "tp1.pp4.dp2.v1.mb2.zb-h1.norecompute.z0",
    "tp2.pp4.dp1.v1.mb1.gpipe.full.z0",
    "tp1.cp2-p2p.pp2.dp2.v1.mb1.default.selective.z1",
    "tp4.pp1.dp2.v1.mb1.default.sp.norecompute.z0",
    "tp1.ep2.pp2.dp4.v1.mb1.1f1b.full.z1",
    "tp1.pp2.dp4.v3+el.mb1.interleaved-1f1b.norecompute.z1",  # 0 1 1 1 1 0 layers
]


def flags_of(name: str) -> tuple[str, ...]:
    if ".ep" in name:
        return MOE_FLAGS
    return ASYNC_FLAGS if "pipedream" in name else CP_FLAGS if ".cp" in name else TINY.flags


def explained(name: str, flags=TINY.flags):
    return explain_layout(parse_layout(name), flags, TINY.vocab_size, GBS, GPUS, H100)


@pytest.mark.parametrize("name", [*LAYOUTS, "tp1.pp4.dp2.v1.mb1.pipedream-2bw.norecompute.z0"])
def test_the_step_lines_add_up_to_the_predicted_step(name):
    flags = flags_of(name)
    layout = parse_layout(name)
    e = explained(name, flags)
    step = e.step
    config = pretrain_config(layout, flags, GBS)
    assert step.seconds == predict(config, TINY.vocab_size, H100).seconds
    assert sum(value for _, value in step.lines()) == pytest.approx(step.seconds, rel=1e-12)
    assert abs(step.residual) < 1e-12 * step.seconds
    assert abs(step.unpriced) < 1e-12 * step.seconds  # devices run as priced
    assert (step.recompute > 0) == (layout.recompute is not None)
    assert (step.data_parallel_actions > 0) == (layout.zero_stage >= 2)
    assert (step.tensor_parallel > 0) == (layout.tp > 1)
    assert (step.context_parallel > 0) == (layout.cp > 1)
    assert (step.expert_all_to_all > 0) == (layout.ep > 1)
    if layout.dp * layout.cp == 1:
        assert step.data_parallel_actions == 0.0
        assert abs(step.data_parallel_tail) < 1e-12 * step.seconds  # a difference of sums
    if layout.pp == 1:
        assert step.bubble == 0.0 and step.pipeline_messages == 0.0
    assert step.bubble_fraction == e.step_time.bubble
    assert step.step_overhead == H100.hardware.step_overhead
    # the rank's idle time before its last action is the bubble plus the messages' waits
    timeline = e.step_time.timeline
    end = max(ev.end for ev in timeline.events if ev.rank == step.rank)
    idle = (end - timeline.busy(step.rank)) / timeline.schedule.iterations
    assert step.bubble + step.pipeline_messages == pytest.approx(idle, rel=1e-9, abs=1e-15)
    assert step.bubble >= 0.0


def test_the_lines_are_what_the_time_model_prices():
    name = "tp2.pp2.dp2.v1.mb1.1f1b.sp.norecompute.z1"
    layout, e = parse_layout(name), explained(name)
    config = pretrain_config(layout, TINY.flags, GBS)
    gpt = config.gpt_config(TINY.vocab_size)
    costs = action_costs(gpt, shape_of(config), H100.hardware)
    m, rank = config.num_microbatches, e.step.rank
    assert e.step.tensor_parallel == pytest.approx(m * sum(costs.tensor_parallel[rank]))
    assert e.step.optimizer == costs.optimizer[rank]
    assert e.step.embedding_sum > 0.0
    tail = e.step.data_parallel_tail + e.step.embedding_sum + e.step.optimizer
    assert tail == pytest.approx(costs.tail[rank], rel=1e-12)
    busy = costs.busy(rank, m, split_backward=False)
    actions = e.step.compute + e.step.tensor_parallel
    assert actions == pytest.approx(busy, rel=1e-12)
    # the step's own tensor-parallel figure is the busiest rank's: the last stage's loss adds
    assert e.step.tensor_parallel <= e.step_time.breakdown["tensor_parallel"]


def busy(name: str, rank: int) -> float:
    config = pretrain_config(parse_layout(name), TINY.flags, GBS)
    costs = action_costs(config.gpt_config(TINY.vocab_size), shape_of(config), H100.hardware)
    return costs.busy(rank, config.num_microbatches, split_backward=False)


def test_recompute_costs_what_it_adds_to_the_actions():
    names = [f"tp2.pp2.dp2.v1.mb1.1f1b.{r}.z0" for r in ("norecompute", "full")]
    plain, full = (explained(name) for name in names)
    assert full.step.compute == pytest.approx(plain.step.compute, rel=1e-12)
    assert full.step.tensor_parallel == pytest.approx(plain.step.tensor_parallel, rel=1e-12)
    rank = full.step.rank
    assert full.step.recompute == pytest.approx(busy(names[1], rank) - busy(names[0], rank))


@pytest.mark.parametrize("name", LAYOUTS[:3])
def test_memory_lines_add_up_worst_rank_first(name):
    layout, e = parse_layout(name), explained(name)
    config = pretrain_config(layout, TINY.flags, GBS)
    predicted = predict_memory(config, TINY.vocab_size, H100.hardware.transport)
    assert sorted(m.pp_rank for m in e.memory) == list(range(layout.pp))
    assert [m.total for m in e.memory] == sorted((m.total for m in e.memory), reverse=True)
    for m in e.memory:
        assert m.total == predicted[m.pp_rank].total
        assert sum(value for _, value in m.lines()) == pytest.approx(m.total, rel=1e-12)
        assert m.in_flight == predicted[m.pp_rank].in_flight > 0
        assert m.in_flight * m.per_microbatch == pytest.approx(m.activations)
    text = format_explanation(e)
    assert text.startswith(name) and "predicted step" in text
    ranks = [line.split()[0] for line in text.splitlines() if " × " in line][1:]
    assert ranks == [str(m.pp_rank) for m in e.memory]


def test_comparison_rows_are_b_minus_a():
    a = explained(LAYOUTS[0])
    b = explained(LAYOUTS[2])
    rows = comparison_rows(a, b)
    keys = [key for key, *_ in rows]
    assert keys == [key for key, _ in explanation_rows(a)]
    assert {f"step.{n}" for n in STEP_LINES} | {f"memory.{n}" for n in MEMORY_LINES} <= set(keys)
    for _, x, y, diff in rows:
        assert diff == y - x or (x != x and y != y)  # NaN: no MFU without a peak
    text = format_comparison(a, b)
    assert f"A: {a.name}" in text and f"B: {b.name}" in text
    step_row = next(line for line in text.splitlines() if line.startswith("step (s)"))
    x, y, diff = (float(v) for v in step_row.split()[-3:])
    assert (x, y) == pytest.approx((a.step.seconds, b.step.seconds), rel=1e-3)
    assert diff == pytest.approx(b.step.seconds - a.step.seconds, rel=1e-3)


def test_every_searched_layout_name_parses_back():
    planner = Planner(TINY, H100, GBS, GPUS)
    found = list(layouts(planner.base, GPUS, 8, GBS, Space(max_micro_batch_size=2)))
    assert len(found) > 100
    for layout in found:
        assert parse_layout(layout.name) == layout
    for layout in (
        Layout(tp=2, cp=4, cp_comm_type="all_gather", pp=2, sequence_parallel=True),
        Layout(tp=2, ep=4, etp=1, dp=4, schedule="pipedream-vsync", zero_stage=3),
    ):
        assert parse_layout(layout.name) == layout


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tp2.pp2", "does not parse: expected tp<n>"),
        ("tp1.pp1.dp1.v1.mb1.default.sp.norecompute.z0", "sequence parallelism needs tp > 1"),
    ],
)
def test_a_bad_name_is_refused(name, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(name)
