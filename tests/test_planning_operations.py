"""The operation-level time model: matmuls by tiles and waves, attention by head dimension,
memory-bound kernels by width, their fit to microbenchmarks, and the time model using them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from megapp.models.gpt import GPTConfig
from megapp.planning.hardware import Hardware, load_hardware
from megapp.planning.layer_costs import compute_seconds
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.op_fit import (
    fit_attention,
    fit_kernels,
    fit_matmul,
    op_rates,
    relative_least_squares,
)
from megapp.planning.op_profiles import A100_COMPUTE_FIT, H200_COPY, H200_MEASURED
from megapp.planning.op_profiles import op_rates as derived_op_rates
from megapp.planning.operations import (
    AttentionRates,
    OpRates,
    expert_parts,
    layer_kernels,
    layer_parts,
    layer_seconds,
    logits_seconds,
)
from megapp.planning.timing import action_costs, predict_step_time, shape_of

DOCS = Path(__file__).resolve().parents[1] / "docs" / "img"
RATES = OpRates(
    matmul_flops=800e12,
    multiprocessors=132,
    tile=(128, 256),
    memory_bandwidth=3e12,
    attention=(
        AttentionRates(64, 400e12, 150e12, 15e-6, 50e-6),
        AttentionRates(128, 600e12, 200e12, 20e-6, 90e-6),
    ),
    kernels=(("bias_gelu", 1024, 1e12, 2e12), ("bias_gelu", 4096, 4e12, 2e12)),
    wave_overhead=1e-6,
    matmul_overhead=4e-6,
    kernel_overhead=2e-6,
)
GPT = GPTConfig(
    num_layers=4,
    hidden_size=2048,
    num_attention_heads=16,
    vocab_size=1024,
    max_position_embeddings=2048,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    params_dtype=torch.bfloat16,
)


def test_a_matmul_pays_for_whole_waves_of_whole_tiles():
    one_wave = RATES.matmul(128 * 12, 256 * 11, 4096)  # 132 tiles: one full wave
    assert RATES.waves(128 * 12, 256 * 11) == 1
    compute = 2 * 132 * 128 * 256 * 4096 / 800e12 + 1e-6
    assert one_wave == pytest.approx(compute + 4e-6)
    # one more row of tiles starts a second wave that costs as much as the first
    assert RATES.waves(128 * 12 + 1, 256 * 11) == 2
    assert RATES.matmul(128 * 12 + 1, 256 * 11, 4096) == pytest.approx(2 * compute + 4e-6)


def test_a_matmul_with_a_short_reduction_is_priced_by_its_bytes():
    m, n, k = 131072, 256, 16  # writing the output dominates
    traffic = 2 * (m * k + k * n + m * n) / 3e12
    assert RATES.matmul(m, n, k) == pytest.approx(traffic + 4e-6)


def test_a_small_output_splits_its_reduction_over_the_idle_multiprocessors():
    m, n, k = 128, 256, 132 * 1024  # one tile: 132 pieces of 1024, one wave
    fast_memory = dataclasses.replace(RATES, memory_bandwidth=1e18)
    assert fast_memory.split(m, n, k) == 132 and fast_memory.waves(m, n, k=k) == 1
    one_piece = 2 * 132 * 128 * 256 * 1024 / 800e12 + 1e-6
    assert fast_memory.matmul(m, n, k) == pytest.approx(one_piece + 4e-6)


def test_kernel_rates_interpolate_in_log_width_and_hold_beyond_the_ends():
    at = {w: RATES.kernel("bias_gelu", w, 1e12, 0.0)[0] for w in (512, 1024, 2048, 8192)}
    assert at[512] == pytest.approx(1.0) and at[8192] == pytest.approx(0.25)
    assert at[2048] == pytest.approx(1 / 2.0)  # halfway in log width: the geometric mean rate
    unmeasured = RATES.kernel("layer_norm", 2048, 3e12, 6e12)
    assert unmeasured == pytest.approx((1.0, 2.0))  # the default bandwidth


def test_a_kernel_pays_its_fixed_seconds_per_call_beside_its_bytes():
    """Measured fixed costs are interpolated in log-width like the rates (linearly where
    one end is zero) and paid once per call; the gap after each kernel is not in them."""
    rates = dataclasses.replace(RATES, kernel_latency=(
        ("bias_gelu", 1024, 4e-6, 8e-6), ("bias_gelu", 4096, 0.0, 16e-6)))  # fmt: skip
    assert rates.kernel("bias_gelu", 1024, 1e6, 2e6) == pytest.approx((1e-6 + 4e-6, 1e-6 + 8e-6))
    forward, backward = rates.kernel("bias_gelu", 2048, 0.0, 2e6, calls=3)
    assert forward == 0.0 and backward == pytest.approx(2e6 / 2e12 + 3 * (8e-6 * 16e-6) ** 0.5)
    assert rates.kernel("bias_gelu", 2048, 1e6, 0.0)[0] == pytest.approx(1e6 / 2e12 + 2e-6)


def test_attention_takes_the_rates_of_the_nearest_head_dimension():
    assert RATES.attention_at(80).head_dim == 64 and RATES.attention_at(100).head_dim == 128
    forward, backward = RATES.attention_seconds(6e12, 128)
    assert (forward, backward) == pytest.approx((0.01 + 20e-6, 0.03 + 90e-6))


def test_a_layer_is_the_sum_of_its_parts_or_its_launches():
    parts = layer_parts(GPT, 2048, 4, RATES)
    assert set(parts) == {"matmul", "attention", "memory", "grad_accumulation", "gaps"}
    layer = layer_seconds(GPT, 2048, 4, RATES)
    sums = [sum(column) for column in zip(*parts.values(), strict=True)]
    assert (layer.forward, layer.input_grad, layer.weight_grad) == pytest.approx(sums)
    assert layer.core_forward == parts["attention"][0]
    # a host that launches slowly enough makes every pass last its kernels' launches
    slow = dataclasses.replace(RATES, launch_overhead=1.0)
    launches = [float(n) for n in layer_kernels(GPT, 2048, 4, RATES)]
    assert list(vars(layer_seconds(GPT, 2048, 4, slow)).values())[:3] == launches


def test_tensor_parallelism_splits_a_layers_matmuls():
    tp2 = dataclasses.replace(GPT, tensor_model_parallel_size=2)
    one, two = layer_parts(GPT, 2048, 4, RATES), layer_parts(tp2, 2048, 4, RATES)
    assert two["matmul"][0] < 0.6 * one["matmul"][0]
    assert two["attention"][0] < 0.6 * one["attention"][0]


MOE_GPT = dataclasses.replace(
    GPT, num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=1024, activation="swiglu"
)


def test_a_moe_layer_is_its_attention_half_and_its_experts_grouped_matmuls():
    """An MoE layer's parts: the dense layer's without the MLP's two linear layers and
    activation, plus the router and the experts, each linear layer one grouped matmul of
    its L local experts over T·k·etp/L rows (forward, input gradient, weight gradient)."""
    tokens, ep = 2048 * 4, 4
    moe = dataclasses.replace(MOE_GPT, expert_model_parallel_size=ep)
    dense, half = (
        layer_parts(moe, 2048, 4, RATES),
        layer_parts(moe, 2048, 4, RATES, dense_mlp=False),
    )
    ffn = moe.ffn_hidden_size
    mlp = [RATES.linear(tokens, 2048, 2 * ffn), RATES.linear(tokens, ffn, 2048)]
    assert half["matmul"] == pytest.approx(
        [a - b - c for a, b, c in zip(dense["matmul"], *mlp, strict=True)]
    )
    assert half["memory"][0] < dense["memory"][0]  # no dense activation
    local, rows = 16 // ep, tokens * 4 // (16 // ep)
    expected = [RATES.linear(tokens, 2048, 16, 4)]
    for k, n in ((2048, 2 * 1024), (1024, 2048)):
        expected.append(
            (RATES.matmul(rows, n, k, 2, local), RATES.matmul(rows, k, n, 2, local),
             RATES.matmul(k, n, rows, 2, local))
        )  # fmt: skip
    experts = expert_parts(moe, 2048, 4, RATES)
    assert experts["matmul"] == pytest.approx([sum(c) for c in zip(*expected, strict=True)])
    layer = layer_seconds(moe, 2048, 4, RATES, experts=True)
    sums = [sum(c) for c in zip(*half.values(), *experts.values(), strict=True)]
    assert (layer.forward, layer.input_grad, layer.weight_grad) == pytest.approx(sums)


def test_fewer_rows_per_expert_waste_more_of_each_wave():
    """The same routed rows and FLOPs over more experts, so fewer rows each: each expert's
    last tile and the last wave are partly empty, so the experts' matmuls take no less
    time, and all of them more than the full-wave rate gives."""
    seconds = []
    for experts in (4, 16, 64):
        moe = dataclasses.replace(MOE_GPT, num_moe_experts=experts)
        seconds.append(expert_parts(moe, 512, 1, RATES)["matmul"][0])
    flops = 2 * 512 * 4 * 2048 * 3 * 1024  # T·k rows through fc1 (gated) and fc2
    assert flops / RATES.matmul_flops < seconds[0] <= seconds[1] <= seconds[2]


def test_the_time_model_prices_actions_by_operations_when_the_profile_has_rates():
    flags = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16"]
    flags += ["--seq-length", "2048", "--bf16", "--hidden-dropout", "0"]
    config = pretrain_config(Layout(micro_batch_size=4), [*flags, "--attention-dropout", "0"], 8)
    base = load_hardware("h200")
    hardware = dataclasses.replace(base, ops=RATES)
    gpt = config.gpt_config(1024)
    layer, output = compute_seconds(gpt, 2048, 4, 1024, hardware)
    assert layer == layer_seconds(gpt, 2048, 4, RATES)
    assert output == logits_seconds(gpt, 8192, 1024, RATES)
    costs = action_costs(gpt, shape_of(config), hardware)
    assert costs.weight_grad[0][0] == pytest.approx(4 * layer.weight_grad + output.weight_grad)
    # without rates the same model is priced by its FLOPs at gemm_flops: another time
    assert predict_step_time(config, 1024, hardware).seconds != pytest.approx(
        predict_step_time(config, 1024, base).seconds, rel=1e-3
    )


def test_a_profile_with_rates_survives_its_json():
    hardware = dataclasses.replace(load_hardware("h100"), ops=RATES)
    assert Hardware.from_json(hardware.to_json()) == hardware


def test_relative_least_squares_keeps_coefficients_non_negative():
    rows = [[1.0, 1.0], [2.0, 1.0], [4.0, 1.0]]
    assert relative_least_squares(rows, [3.0, 5.0, 9.0]) == pytest.approx([2.0, 1.0])
    # a negative intercept is dropped and the slope refitted alone
    coefficients = relative_least_squares(rows, [1.0, 3.0, 7.0])
    assert coefficients[1] == 0.0 and coefficients[0] > 0


def test_the_matmul_fit_recovers_the_rates_that_made_the_timings():
    truth = RATES
    grid = [
        {"m": m, "n": n, "k": k, "seconds": truth.matmul(m, n, k)}
        for m in (4096, 16384) for n in (1024, 4096, 12288) for k in (1024, 4096, 12288)
    ]  # fmt: skip
    fit = fit_matmul(grid, 132, 3e12, 2)
    # this grid divides evenly into 128 × 128 tiles too, so the tile is not identifiable
    # from it; the rate and the per-kernel overhead are
    assert fit["tile"] in ((128, 128), (128, 256), (256, 128))
    assert fit["matmul_flops"] == pytest.approx(800e12, rel=1e-6)
    assert fit["matmul_overhead"] == pytest.approx(4e-6, rel=1e-6)
    assert fit["mean_error"] < 1e-9


def test_the_gradient_layouts_get_rates_of_their_own_under_the_forward_tiling():
    truth = dataclasses.replace(RATES, gradient_matmul_flops=(700e12, 600e12))
    shapes = [(m, n, k) for m in (4096, 16384) for n in (1024, 12288) for k in (1024, 12288)]
    grid = [
        {"m": m, "n": n, "k": k, "layout": layout,
         "seconds": truth.matmul(m, n, k, layout=index)}
        for index, layout in enumerate(("forward", "input_grad", "weight_grad"))
        for m, n, k in shapes
    ]  # fmt: skip
    fit = fit_matmul(grid, 132, 3e12, 2)
    assert fit["matmul_flops"] == pytest.approx(800e12, rel=1e-6)
    assert fit["gradient_flops"] == pytest.approx((700e12, 600e12), rel=1e-6)
    assert fit["weight_grad_errors"]["max_error"] < 1e-9
    # linear() prices each pass at its layout's rate
    forward, input_grad, weight_grad = truth.linear(8192, 4096, 4096)
    assert input_grad > forward
    assert weight_grad == pytest.approx(truth.matmul(4096, 4096, 8192, layout=2))


def test_two_sizes_of_a_kernel_give_its_bandwidth_and_its_fixed_cost_per_call():
    def row(op: str, elements: int, bandwidth: float, fixed: float) -> dict:
        moved = 4.0 * elements  # bytes
        rate = moved / (moved / bandwidth + fixed)
        return {"op": op, "width": 1024, "forward": rate, "backward": rate / 2,
                "forward_bytes": moved, "backward_bytes": moved}  # fmt: skip

    full = [row("rms_norm", 2**26, 3e12, 5e-6), row("copy", 2**26, 4e12, 0.0)]
    small = [row("rms_norm", 2**22, 3e12, 5e-6)]
    rates, latency = fit_kernels(full, small)
    (norm,) = (r for r in rates if r[0] == "rms_norm")
    assert norm[2] == pytest.approx(3e12, rel=1e-9)
    assert latency == (("rms_norm", 1024, pytest.approx(5e-6), pytest.approx(latency[0][3])),)
    # measured on one size only: its rate as measured, no fixed cost
    assert next(r for r in rates if r[0] == "copy")[2] == pytest.approx(4e12)


def test_the_attention_fit_is_one_per_head_dimension():
    """Timings made by rates with a cost per query row give back the rate, the row cost
    and the overhead, per head dimension, from the single calls (not the back-to-back
    timings kept beside them)."""
    rows = dataclasses.replace(RATES, attention=(
        AttentionRates(64, 400e12, 150e12, 15e-6, 50e-6, 0.1e-9, 0.5e-9),
        AttentionRates(128, 600e12, 200e12, 20e-6, 90e-6, 0.0, 0.4e-9),
    ))  # fmt: skip
    shapes = []
    for b, heads, s in ((2, 32, 1024), (2, 16, 2048), (1, 32, 4096), (1, 16, 8192)):
        for d in (64, 128):
            flops = 2.0 * b * heads * s * s * d
            forward, backward = rows.attention_seconds(flops, d, b * heads * s)
            shapes.append({"batch": b, "heads": heads, "seq": s, "head_dim": d,
                           "forward_s": forward, "backward_s": backward,
                           "forward_loop_s": forward / 2,
                           "backward_loop_s": backward / 2})  # fmt: skip
    fits = {f["head_dim"]: f for f in fit_attention(shapes)}
    assert fits[64]["forward_flops"] == pytest.approx(400e12, rel=1e-6)
    assert fits[64]["backward_row_seconds"] == pytest.approx(0.5e-9, rel=1e-6)
    assert fits[128]["backward_overhead"] == pytest.approx(90e-6, rel=1e-6)
    assert fits[128]["forward_row_seconds"] == pytest.approx(0.0, abs=1e-15)


def test_a_direction_that_moves_no_bytes_costs_nothing():
    assert RATES.kernel("copy", 0, 0.0, 3e12) == pytest.approx((0.0, 1.0))


def test_megapps_layers_rebuild_their_saved_inputs_in_backward():
    """The input gradient pays each norm's forward twice more and the activation's once,
    and the fused projection's gradient gathered from q, k and v (three copies); megapp's
    fused attention output merges as a view, where the published runs' layers (megapp_layers
    off) pay the relayout both ways. Layers recomputed whole rebuild nothing."""
    rates = dataclasses.replace(RATES, kernels=(*RATES.kernels, ("relayout", 128, 1e12, 1e12)))
    theirs = dataclasses.replace(rates, megapp_layers=False)
    mine, kept = layer_parts(GPT, 2048, 4, rates), layer_parts(GPT, 2048, 4, theirs)
    tokens, h, f = 2048 * 4, GPT.hidden_size, GPT.ffn_hidden_size
    act = tokens * h * 2  # bytes of q, k, v or the attention output
    rebuilt = [
        *[rates.kernel("layer_norm", h, 2 * tokens * h * 2, 0.0)[0]] * 4,
        rates.kernel("bias_gelu", f, 2 * tokens * f * 2, 0.0)[0],
    ]
    gathered = rates.kernel("relayout", 128, 0.0, 2 * 3 * act, 3)[1]
    relayout = rates.kernel("relayout", 128, 2 * act, 2 * act)
    assert mine["memory"][1] - kept["memory"][1] == pytest.approx(
        sum(rebuilt) + gathered - relayout[1]
    )
    assert mine["memory"][0] - kept["memory"][0] == pytest.approx(-relayout[0])
    assert mine["matmul"] == kept["matmul"]
    whole = dataclasses.replace(
        GPT, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    mine, kept = layer_parts(whole, 2048, 4, rates), layer_parts(whole, 2048, 4, theirs)
    assert mine["memory"][1] - kept["memory"][1] == pytest.approx(gathered - relayout[1])


def test_grouped_queries_copy_and_repeat_keys_and_values_only_in_megapps_layers():
    """megapp's grouped-query layer copies its queries out of the fused projection, repeats
    keys and values per head and makes values contiguous (forward), sums the repeats'
    gradients, copies a gradient back and assembles the projection's (backward), all at the
    relayout's rate; its contiguous queries make the attention output's relayout a view.
    Layers that attend grouped queries natively (megapp_layers off) do none of it and pay
    the relayout."""
    gqa = dataclasses.replace(GPT, num_query_groups=4)
    theirs = dataclasses.replace(RATES, megapp_layers=False)
    bw, tokens = RATES.memory_bandwidth, 2048 * 4
    queries, kv = tokens * 16 * 128 * 2, tokens * 4 * 128 * 2  # bytes of one pass over each
    relayout = 2 * queries
    forward = (2 * queries + 4 * queries + 2 * kv - relayout) / bw
    backward = (2 * kv + 2 * (queries + kv) + 2 * (queries + 2 * kv) - relayout) / bw
    h, f = GPT.hidden_size, GPT.ffn_hidden_size  # megapp rebuilds its norms and activation
    rebuilt = 4 * RATES.kernel("layer_norm", h, 2 * tokens * h * 2, 0.0)[0]
    rebuilt += RATES.kernel("bias_gelu", f, 2 * tokens * f * 2, 0.0)[0]
    mine, kept = layer_parts(gqa, 2048, 4, RATES), layer_parts(gqa, 2048, 4, theirs)
    extra = [mine["memory"][k] - kept["memory"][k] for k in (0, 1)]
    assert extra == pytest.approx([forward, backward + rebuilt])
    # kernels: forward the queries' copy, two repeats and the values' copy, less the
    # relayout; backward a gradient copy, two sums and three assembling copies, less the
    # relayout's gradient, and megapp's five rebuilt inputs (four norms, the activation)
    gaps = [
        (a - b) / RATES.kernel_overhead for a, b in zip(mine["gaps"], kept["gaps"], strict=True)
    ]
    assert gaps == pytest.approx([4 - 1, 6 - 1 + 5, 0])


def test_rope_with_full_heads_leaves_megapps_values_to_copy():
    """RoPE rotates queries and keys into contiguous tensors and leaves the values a strided
    view, which the fused attention copies forward and backward (an H200 profile)."""
    rope = dataclasses.replace(GPT, position_embedding_type="rope")
    plain, rotated = layer_parts(GPT, 2048, 4, RATES), layer_parts(rope, 2048, 4, RATES)
    values = 2 * 2048 * 4 * 16 * 128 * 2 / RATES.memory_bandwidth  # read and written
    queries = RATES.kernel("rope", 128, 2 * 2048 * 4 * 16 * 128 * 2, 0.0)[0]  # and keys
    assert rotated["memory"][0] - plain["memory"][0] == pytest.approx(2 * queries + values)


def test_the_h200_measurements_fit_and_regenerate_the_stored_profile():
    """The calibration measured on an H200 (docs/img/h200_calibration.json) refitted here
    gives the profile stored beside it, and its grid of matmuls fits within a few percent."""
    measurements = json.loads((DOCS / "h200_calibration.json").read_text())
    rates, fit = op_rates(measurements)
    assert fit["matmul"]["mean_error"] < 0.05
    assert all(a["forward_errors"]["max_error"] < 0.06 for a in fit["attention"])
    stored = load_hardware(str(DOCS / "h200_profile.json"))
    assert stored.ops == rates
    assert math.isclose(stored.memory_bandwidth, rates.memory_bandwidth)


def test_the_built_in_rates_are_the_h200_fit_carried_by_their_rules():
    """op_profiles' H200 constants are the fit of the stored H200 timings (rounded); the
    H100 keeps its compute and scales its memory-bound rate by HBM, the A100 scales compute
    by peak and by its fitted share, and has 108 multiprocessors."""
    measurements = json.loads((DOCS / "h200_calibration.json").read_text())
    fitted, _ = op_rates(measurements)
    built = H200_MEASURED
    for name in ("matmul_flops", "wave_overhead", "matmul_overhead", "kernel_overhead"):
        assert getattr(built, name) == pytest.approx(getattr(fitted, name), rel=1e-4)
    assert built.tile == fitted.tile and built.multiprocessors == fitted.multiprocessors
    for mine, theirs in zip(built.attention, fitted.attention, strict=True):
        assert mine.head_dim == theirs.head_dim
        assert mine.backward_flops == pytest.approx(theirs.backward_flops, rel=1e-4)
    copy = next(f for op, _, f, _ in fitted.kernels if op == "copy")
    assert pytest.approx(copy, rel=1e-4) == H200_COPY
    h100, a100 = derived_op_rates("h100"), derived_op_rates("a100")
    assert h100.matmul_flops == built.matmul_flops and h100.kernels == ()
    assert h100.memory_bandwidth == pytest.approx(copy * 3.35 / 4.8, rel=1e-4)
    assert a100.multiprocessors == 108
    share = 312 / 989 * A100_COMPUTE_FIT  # the one constant fitted to published runs
    assert a100.matmul_flops == pytest.approx(built.matmul_flops * share)
    assert load_hardware("h100-ops").ops == h100 and load_hardware("h100").ops is None
