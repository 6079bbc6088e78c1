"""--tp-comm-overlap in the time model: the three overlap methods' formulas, one layer by
hand (dense and mixture-of-experts), and what pieces and busy multiprocessors cost a matmul
priced by its operations."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megapp.benchmarks import overlap_matmuls
from megapp.models.gpt import GPTConfig
from megapp.plan import Planner
from megapp.planning.explain import parse_layout
from megapp.planning.hardware import PROFILES
from megapp.planning.layer_costs import tensor_parallel_seconds
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.layout_space import Space, layouts
from megapp.planning.models import MODELS
from megapp.planning.timing import predict_step_time
from megapp.planning.tp_overlap import (
    COMMUNICATION_SMS,
    PIPELINE_PIECES,
    bulk,
    overlapped_seconds,
    pipeline,
    ring_exchange,
)
from tests.support import PLAIN_HARDWARE

# round numbers, no latency, communication beside compute: every second traceable by hand
PLAIN = dataclasses.replace(
    PLAIN_HARDWARE, intra_node_latency=0.0, inter_node_latency=0.0, overlap_communication=True
)


def gpt(tp: int = 4, overlap: bool = True, **kw) -> GPTConfig:
    return GPTConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=8,
        vocab_size=1024,
        tensor_model_parallel_size=tp,
        sequence_parallel=True,
        tp_comm_overlap=overlap,
        **kw,
    )


def test_methods_hide_the_shorter_side_and_pay_the_ends():
    # compute-bound: the ring pays its pieces, the pipeline its last scatter
    assert ring_exchange(2.0, 1.0, 4) == pytest.approx(8.0)
    assert pipeline(2.0, 4.0) == pytest.approx(2.0 + 3 * 4.0 + 4.0)
    assert pipeline(2.0, 1.0) == pytest.approx(4 * 2.0 + 1.0)
    # bandwidth-bound: the ring pays every hop after its own piece
    assert ring_exchange(1.0, 3.0, 4) == pytest.approx(3 * 3.0 + 1.0)
    assert bulk(2.0, 5.0) == bulk(5.0, 2.0) == 5.0


def test_one_layer_by_hand_at_a_flops_rate():
    # at gemm_flops pieces and busy multiprocessors cost nothing: only transfers longer
    # than the matmul beside them show
    tp, tokens, h = 4, 128, 256
    act = tokens * h * 4  # fp32
    slow = dataclasses.replace(PLAIN, intra_node_bandwidth=1e9)
    link_bw = slow.intra_node_bandwidth
    hop = act / tp / link_bw
    collective = (tp - 1) * act / tp / link_bw
    scatter = collective / PIPELINE_PIECES

    def mm(m, n, k):
        return 2 * m * n * k / PLAIN.gemm_flops

    def column(out):  # ring in forward, two bulks in backward
        forward = ring_exchange(mm(tokens // tp, out, h), hop, tp) - mm(tokens, out, h)
        return forward, 2 * (max(mm(tokens, h, out), collective) - mm(tokens, h, out))

    def row(inp):  # pipeline in forward, ring in backward
        forward = pipeline(mm(tokens // PIPELINE_PIECES, h, inp), scatter) - mm(tokens, h, inp)
        return forward, ring_exchange(mm(tokens // tp, inp, h), hop, tp) - mm(tokens, inp, h)

    qkv, ffn = 3 * h // tp, 4 * h // tp
    attention = [a + b for a, b in zip(column(qkv), row(h // tp), strict=True)]
    mlp = [a + b for a, b in zip(column(ffn), row(ffn), strict=True)]
    f, b = overlapped_seconds(gpt(), 128, 1, slow)
    assert (f, b) == pytest.approx((attention[0] + mlp[0], attention[1] + mlp[1]))
    assert f > 0 and b > 0  # this small layer's matmuls do not cover its transfers
    # a mixture-of-experts layer: its experts' gather and scatter as without overlap
    f, b = overlapped_seconds(gpt(), 128, 1, slow, dense_mlp=False)
    assert (f, b) == pytest.approx((attention[0] + 2 * collective, attention[1] + 2 * collective))


def test_a_fast_link_leaves_only_the_matmuls_loss_and_it_is_priced_by_the_ops():
    h100 = PROFILES["h100-ops"]
    fast = dataclasses.replace(h100, intra_node_bandwidth=1e18, intra_node_latency=0.0)
    big = GPTConfig(
        num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=1024,
        tensor_model_parallel_size=8, sequence_parallel=True, tp_comm_overlap=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    f, b = overlapped_seconds(big, 4096, 1, fast)
    assert f > 0 and b > 0  # pieces and 16 busy multiprocessors cost the matmuls time
    flops_rate = dataclasses.replace(fast, ops=None)
    # nothing left but the pipelines' last scatters
    assert overlapped_seconds(big, 4096, 1, flops_rate) == pytest.approx((0.0, 0.0), abs=1e-9)
    # a matmul beside communication runs about as much slower as it has fewer
    # multiprocessors (waves round differently)
    ops = h100.ops
    left = ops.multiprocessors - COMMUNICATION_SMS
    narrow = dataclasses.replace(
        ops.scaled_compute(left / ops.multiprocessors), multiprocessors=left
    )
    whole, slowed = ops.matmul(8192, 4096, 4096), narrow.matmul(8192, 4096, 4096)
    assert slowed / whole == pytest.approx(ops.multiprocessors / left, rel=0.03)


def test_overlap_replaces_the_layers_collectives_and_keeps_the_ends():
    on, off = gpt(), gpt(overlap=False)
    h100 = PROFILES["h100-ops"]
    with_ends = tensor_parallel_seconds(on, 128, 1, 2, True, True, h100)
    middle = tensor_parallel_seconds(on, 128, 1, 2, False, False, h100)
    f, b = overlapped_seconds(on, 128, 1, h100)
    assert middle[:2] == pytest.approx((2 * f, 2 * b))
    ends = [x - y for x, y in zip(with_ends, middle, strict=True)]
    plain = [
        x - y
        for x, y in zip(
            tensor_parallel_seconds(off, 128, 1, 2, True, True, h100),
            tensor_parallel_seconds(off, 128, 1, 2, False, False, h100),
            strict=True,
        )
    ]
    assert ends == pytest.approx(plain)  # embedding, output layer and loss as without it
    recomputed = dataclasses.replace(on, recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=1)  # fmt: skip
    _, b2, *_ = tensor_parallel_seconds(recomputed, 128, 1, 2, False, False, h100)
    assert b2 == pytest.approx(2 * (f + b))  # the rerun forward's run again


def test_a_large_layer_hides_its_collectives():
    flags = ["--num-layers", "8", "--hidden-size", "8192", "--num-attention-heads", "64",
             "--seq-length", "4096", "--bf16"]  # fmt: skip
    layout = Layout(tp=8, sequence_parallel=True, dp=1)
    plain = pretrain_config(layout, flags, 8)
    overlapped = pretrain_config(layout, [*flags, "--tp-comm-overlap"], 8)
    h100 = PROFILES["h100-ops"]
    a = predict_step_time(plain, 32000, h100)
    b = predict_step_time(overlapped, 32000, h100)
    assert b.seconds < a.seconds
    assert b.breakdown["tensor_parallel"] < a.breakdown["tensor_parallel"]


def test_hardware_that_runs_no_communication_beside_compute_hides_nothing():
    serial = dataclasses.replace(PLAIN, overlap_communication=False)
    assert tensor_parallel_seconds(gpt(), 128, 1, 2, True, True, serial) == (
        tensor_parallel_seconds(gpt(overlap=False), 128, 1, 2, True, True, serial)
    )
    assert tensor_parallel_seconds(gpt(), 128, 1, 2, True, True, PLAIN) != (
        tensor_parallel_seconds(gpt(overlap=False), 128, 1, 2, True, True, PLAIN)
    )


def test_the_flag_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="needs sequence_parallel"):
        GPTConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
            tensor_model_parallel_size=2, tp_comm_overlap=True,
        )  # fmt: skip


def test_the_overlap_benchmark_times_and_prices_every_pair(tmp_path):
    out = tmp_path / "overlap.json"
    assert (
        overlap_matmuls.main(["--quick", "--device", "cpu", "--repeats", "1", "--out", str(out)])
        == 0
    )
    (case,) = json.loads(out.read_text())["cases"].values()
    names = {r["pair"] for r in case["pairs"]}
    assert names == {f"{l}_{p}" for l in ("qkv", "fc1") for p in ("fprop", "dgrad", "wgrad")} | {
        f"{l}_{p}" for l in ("proj", "fc2") for p in ("fprop", "dgrad")
    }
    assert all(r["alone_s"] > 0 and r["overlapped_s"] > 0 for r in case["pairs"])
    priced = sum(r["predicted_overlapped_s"] - r["predicted_alone_s"] for r in case["pairs"])
    assert case["predicted_extra_s"] == pytest.approx(priced)


def test_the_planner_searches_every_sequence_parallel_layout_also_overlapped():
    base = gpt(overlap=False)
    every = list(layouts(base, 8, 8, 16))
    overlapped = {dataclasses.replace(x, tp_comm_overlap=False) for x in every if x.tp_comm_overlap}
    assert overlapped == {x for x in every if x.sequence_parallel and not x.tp_comm_overlap}
    assert not any(x.tp_comm_overlap for x in layouts(base, 8, 8, 16, Space(tp_comm_overlap=False)))
    layout = next(x for x in every if x.tp_comm_overlap)
    assert ".sp.tpo." in layout.name and parse_layout(layout.name) == layout
    assert "--tp-comm-overlap" in layout.flags(base.num_layers)
    with pytest.raises(ValueError, match="sequence parallelism"):
        Layout(tp=2, tp_comm_overlap=True)


def test_where_nothing_runs_beside_compute_the_planner_lays_out_no_overlap():
    model = MODELS["gpt2"]
    serial = dataclasses.replace(PLAIN, overlap_communication=False)
    plain = Planner(model, serial, 16, 8).plan(8, top_k=1)
    both = Planner(model, PLAIN, 16, 8).plan(8, top_k=1)
    without = Planner(model, PLAIN, 16, 8).plan(8, top_k=1, space=Space(tp_comm_overlap=False))
    assert plain.enumerated == without.enumerated < both.enumerated
