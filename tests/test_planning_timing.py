"""The time model: FLOPs against the training count, hand-computed cases, the effect of
each layout choice, and hardware profiles."""

from __future__ import annotations

import dataclasses

import pytest

from megapp.models.gpt import GPTConfig
from megapp.planning.hardware import PROFILES, Hardware, Link, load_hardware
from megapp.planning.layer_costs import layer_flops
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.model_state import rank_parameters
from megapp.planning.timing import action_costs, predict_step_time, shape_of
from megapp.training.flops import gpt_training_flops

MODEL = [
    "--num-layers",
    "8",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "128",
    "--bf16",
]
VOCAB = 1024  # a multiple of 128 × 8: no padding under any tp here

# Round numbers, no fixed overheads, no overlap: every second is traceable by hand.
PLAIN = Hardware(
    name="plain",
    gemm_flops=1e12,
    peak_flops=2e12,
    memory_bytes=80e9,
    memory_bandwidth=1e12,
    gpus_per_node=8,
    intra_node_bandwidth=100e9,
    intra_node_latency=1e-6,
    inter_node_bandwidth=10e9,
    inter_node_latency=5e-6,
    overlap_communication=False,
)
GLOO = dataclasses.replace(PLAIN, transport="gloo")


def config(layout: Layout, gbs: int = 16, model=MODEL):
    return pretrain_config(layout, model, gbs)


def model_flops(gbs: int) -> float:
    gpt = GPTConfig(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=VOCAB)
    return gpt_training_flops(gpt, seq_length=128, tokens=gbs * 128)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(),
        Layout(tp=2, dp=2, sequence_parallel=True),
        Layout(pp=2, vpp=2, dp=2, micro_batch_size=2),
        Layout(pp=2, vpp=2, schedule="zb-v", tp=2),
        Layout(pp=4, schedule="zb-h1"),
    ],
    ids=lambda layout: layout.name,
)
def test_flops_of_every_action_sum_to_the_training_count(layout):
    cfg = config(layout)
    costs = action_costs(cfg.gpt_config(VOCAB), shape_of(cfg), PLAIN)
    per_replica = sum(
        sum(map(sum, table))
        for table in (costs.flops_forward, costs.flops_input_grad, costs.flops_weight_grad)
    )
    total = per_replica * cfg.num_microbatches * layout.tp * cfg.data_parallel_size
    assert total == pytest.approx(model_flops(16), rel=1e-12)


def test_single_rank_step_by_hand():
    """pp = tp = dp = 1: three passes of the FLOPs at the GEMM rate, the loss's five fp32
    passes over the logits, AdamW's bytes and the zeroing of the fp32 gradients at the
    memory bandwidth, nothing else."""
    cfg = config(Layout(micro_batch_size=4))
    step = predict_step_time(cfg, VOCAB, PLAIN)
    n = rank_parameters(cfg.gpt_config(VOCAB), [0], 1)
    tokens = 16 * 128
    adamw = 32 + 4 + 2  # its fp32 passes, then the master copied into the 16-bit weight
    expected = model_flops(16) / 1e12 + 5 * 4 * tokens * VOCAB / 1e12 + n * (adamw + 4) / 1e12
    assert step.seconds == pytest.approx(expected, rel=1e-9)
    assert step.bubble == 0.0
    assert step.mfu == pytest.approx(step.tflops_per_gpu * 1e12 / 2e12)
    assert step.tokens_per_second_per_gpu == pytest.approx(tokens / step.seconds)


def test_no_pipeline_no_bubble_and_pipelines_have_one():
    assert predict_step_time(config(Layout(dp=4)), VOCAB, PLAIN).bubble == 0.0
    piped = predict_step_time(config(Layout(pp=4)), VOCAB, PLAIN)
    assert 0.1 < piped.bubble < 0.5  # 1F1B, p=4, m=16: (p-1)/(m+p-1) = 16% for equal stages


@pytest.mark.parametrize("gbs", [8, 64])
def test_1f1b_bubble_follows_the_formula_for_near_equal_stages(gbs):
    """With a small vocabulary the stages are within 2% of each other: the bubble is the
    textbook (p - 1) / (m + p - 1)."""
    step = predict_step_time(config(Layout(pp=4), gbs=gbs), 128, PLAIN)
    assert step.bubble == pytest.approx(3 / (gbs + 3), abs=0.02)


def test_doubling_tp_halves_the_arithmetic_and_adds_the_all_reduces():
    one = config(Layout(tp=1))
    two = config(Layout(tp=2))
    c1 = action_costs(one.gpt_config(VOCAB), shape_of(one), PLAIN)
    c2 = action_costs(two.gpt_config(VOCAB), shape_of(two), PLAIN)
    assert c2.flops_forward[0][0] == pytest.approx(c1.flops_forward[0][0] / 2)
    # four all-reduces of [s, b, h] bf16 per layer (two forward, two backward), the
    # embedding's and the output layer's, the cross-entropy's three of [s, b] fp32
    act = 128 * 1 * 256 * 2
    ring = 2 * (1e-6 + act / 2 / 100e9)
    small = 2 * (1e-6 + 4 * 128 / 2 / 100e9)
    assert c2.tensor_parallel[0][0] == pytest.approx(8 * 4 * ring + 2 * ring + 3 * small)
    arithmetic = c1.forward[0][0] - c1.flops_forward[0][0] / 1e12  # the loss's passes
    f2 = c2.flops_forward[0][0] / 1e12 + arithmetic / 2
    assert c2.forward[0][0] == pytest.approx(f2 + (8 * 2 + 1) * ring + 3 * small)


def test_sequence_parallel_moves_the_same_bytes_in_more_steps():
    plain = config(Layout(tp=4))
    sp = config(Layout(tp=4, sequence_parallel=True))
    hw = dataclasses.replace(PLAIN, intra_node_latency=0.0)
    a = action_costs(plain.gpt_config(VOCAB), shape_of(plain), hw).tensor_parallel[0][0]
    b = action_costs(sp.gpt_config(VOCAB), shape_of(sp), hw).tensor_parallel[0][0]
    assert a == pytest.approx(b)


def test_recompute_adds_its_rerun_forward_to_the_input_gradient():
    base = config(Layout())
    gpt = base.gpt_config(VOCAB)
    lin, core = layer_flops(gpt, 128, 1)
    none = action_costs(gpt, shape_of(base), PLAIN).flops_input_grad[0][0]
    for recompute, rerun in (("selective", core), ("full", lin + core)):
        cfg = config(Layout(recompute=recompute))
        got = action_costs(cfg.gpt_config(VOCAB), shape_of(cfg), PLAIN).flops_input_grad[0][0]
        assert got - none == pytest.approx(8 * rerun)
    full = predict_step_time(config(Layout(recompute="full")), VOCAB, PLAIN)
    assert full.breakdown["recompute_flops"] == pytest.approx(16 * 8 * (lin + core))


def test_data_parallel_reduction_by_zero_stage():
    """ZeRO-0 all-reduces the fp32 gradients; ZeRO-1 reduce-scatters them (half the bytes)
    and all-gathers the bf16 weights; ZeRO-2 moves the reduce-scatter into every
    microbatch's backward."""
    tails = {}
    for stage in (0, 1, 2):
        cfg = config(Layout(dp=4, zero_stage=stage))
        tails[stage] = action_costs(cfg.gpt_config(VOCAB), shape_of(cfg), PLAIN)
    z0, z1, z2 = tails[0], tails[1], tails[2]
    assert z1.grad_reduce[0] == pytest.approx(z0.grad_reduce[0] / 2, rel=1e-3)
    assert z2.grad_reduce[0] == 0.0
    assert z2.weight_grad[0][0] == pytest.approx(z1.weight_grad[0][0] + z1.grad_reduce[0])
    # a data-parallel group beyond one node pays InfiniBand's bandwidth
    wide = config(Layout(dp=16))
    far = action_costs(wide.gpt_config(VOCAB), shape_of(wide), PLAIN).grad_reduce[0]
    near = action_costs(wide.gpt_config(VOCAB), shape_of(wide), PLAIN.with_gpus_per_node(16))
    assert far > 9 * near.grad_reduce[0]


def test_overlap_hides_the_reduction_under_the_last_backward_but_its_last_bucket():
    cfg = config(Layout(dp=2))
    gpt = cfg.gpt_config(VOCAB)
    n = rank_parameters(gpt, [0], 1)
    shape = dataclasses.replace(shape_of(cfg), bucket_size=n // 4)
    hidden = dataclasses.replace(PLAIN, overlap_communication=True)
    exposed = action_costs(gpt, shape, PLAIN)
    overlapped = action_costs(gpt, shape, hidden)
    reduce = exposed.grad_reduce[0]
    window = exposed.input_grad[0][0] + exposed.weight_grad[0][0]
    assert reduce < window  # so only the last bucket's share stays exposed
    saved = reduce - reduce * (n // 4) / n
    assert exposed.tail[0] - overlapped.tail[0] == pytest.approx(saved)
    whole = action_costs(gpt, shape_of(cfg), hidden)  # one bucket: nothing to overlap,
    ring = 2 * 1e-6  # and three collectives fewer, each 2 ring steps over dp 2
    assert whole.tail[0] == pytest.approx(exposed.tail[0] - 3 * ring)
    assert whole.grad_reduce[0] == pytest.approx(reduce - 3 * ring)
    # --no-overlap-grad-reduce: every bucket after the backward, as without overlap
    after = action_costs(gpt, dataclasses.replace(shape, overlap_grad_reduce=False), hidden)
    assert after.tail[0] == pytest.approx(exposed.tail[0])
    flagged = pretrain_config(Layout(dp=2), [*MODEL, "--no-overlap-grad-reduce"], 16)
    assert shape_of(flagged).overlap_grad_reduce is False and shape_of(cfg).overlap_grad_reduce


@pytest.mark.parametrize(
    ("layout", "split"),
    [
        (Layout(pp=4), False),
        (Layout(pp=4, schedule="gpipe"), False),
        (Layout(pp=2, vpp=2, dp=2), False),
        (Layout(pp=2, vpp=2, schedule="looped-bfs"), False),
        (Layout(pp=4, schedule="zb-h1"), True),
        (Layout(pp=2, vpp=2, schedule="zb-v"), True),
    ],
    ids=lambda x: x.name if isinstance(x, Layout) else str(x),
)
def test_lower_bound_holds_and_is_tight_for_1f1b(layout, split):
    cfg = config(layout)
    costs = action_costs(cfg.gpt_config(VOCAB), shape_of(cfg), GLOO)
    step = predict_step_time(cfg, VOCAB, GLOO)
    bound = costs.lower_bounds(cfg.num_microbatches)[split]
    assert bound <= step.seconds + 1e-12
    if layout.schedule is None and layout.vpp == 1:  # 1F1B: (m + p - 1)(F + B), nearly
        assert bound > 0.97 * step.seconds


def test_nccl_and_gloo_predict_the_same_pipeline():
    """The engine posts so that NCCL's rules cost nothing: a schedule whose ranks send to
    each other at once (ZB-V) is predicted, not dropped, and as fast as on gloo."""
    cfg = config(Layout(pp=4, vpp=2, schedule="zb-v"), gbs=8)
    nccl, gloo = predict_step_time(cfg, VOCAB, PLAIN), predict_step_time(cfg, VOCAB, GLOO)
    assert nccl.bubble == pytest.approx(gloo.bubble)


def test_links():
    link = Link(bandwidth=10e9, latency=2e-6)
    assert link.all_reduce(8e9, 4) == pytest.approx(6 * 2e-6 + 2 * 3 / 4 * 8e9 / 10e9)
    assert link.all_gather(8e9, 4) == pytest.approx(3 * 2e-6 + 3 / 4 * 8e9 / 10e9)
    assert link.all_reduce(8e9, 1) == 0.0
    assert link.message(1e9) == pytest.approx(2e-6 + 0.1)


def test_profiles_and_json(tmp_path):
    h100 = load_hardware("H100")
    assert h100.peak_flops == 989e12 and 0.4 < h100.gemm_flops / h100.peak_flops < 0.8
    assert set(PROFILES) == {"h100", "h200", "a100", "h100-ops", "h200-ops", "a100-ops"}
    assert load_hardware("h200").memory_bytes > 1.7 * h100.memory_bytes
    path = tmp_path / "cpu.json"
    GLOO.save(path)
    assert load_hardware(str(path)) == GLOO
    with pytest.raises(ValueError, match="unknown hardware 'v100'; choose one of h100, h200"):
        load_hardware("v100")
    (tmp_path / "bad.json").write_text('{"name": "x", "gemm_flops": 1}')
    with pytest.raises(ValueError, match="lacks: gpus_per_node"):
        load_hardware(str(tmp_path / "bad.json"))


def test_asynchronous_schedules_pay_one_flush_per_run_and_step_among_their_actions():
    """2BW over k iterations: one fill and drain per run instead of per iteration, so its
    bubble is about (p - 1) / (k m + p - 1); its steps (the tail: reduction and optimizer)
    are actions. PipeDream steps after every microbatch: m times the optimizer's work."""
    flags = [*MODEL, "--clip-grad", "0", "--untie-embeddings-and-output-weights"]
    k, m = 8, 16
    flushed = predict_step_time(config(Layout(pp=4), model=flags), 128, PLAIN)
    runs = [*flags, "--pipeline-flush-interval", str(k)]
    two_bw = predict_step_time(
        config(Layout(pp=4, schedule="pipedream-2bw"), model=runs), 128, PLAIN
    )
    assert two_bw.bubble == pytest.approx(3 / (k * m + 3), abs=0.02)
    assert two_bw.seconds < flushed.seconds
    assert two_bw.breakdown["pipeline"] == pytest.approx(two_bw.timeline.makespan / k)
    steps = [e for e in two_bw.timeline.events if e.name.startswith("U")]
    assert len(steps) == 4 * k  # one per iteration on every rank
    pipedream = predict_step_time(
        config(Layout(pp=4, schedule="pipedream"), model=runs), 128, PLAIN
    )
    steps = [e for e in pipedream.timeline.events if e.name.startswith("U")]
    assert len(steps) == 4 * k * m
    assert pipedream.seconds > two_bw.seconds  # m optimizer steps per iteration


CP_MODEL = [*MODEL, "--attention-dropout", "0"]  # context parallelism runs no dropout


def cp_costs(layout: Layout, hardware: Hardware = PLAIN, gbs: int = 16):
    cfg = config(layout, gbs, CP_MODEL)
    return action_costs(cfg.gpt_config(VOCAB), shape_of(cfg), hardware)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(cp=2),
        Layout(cp=4, cp_comm_type="all_gather"),
        Layout(tp=2, cp=2, dp=2, sequence_parallel=True, cp_comm_type="a2a"),
        Layout(cp=2, pp=2, vpp=2, schedule="zb-v", recompute="selective"),
    ],
    ids=lambda layout: layout.name,
)
def test_context_parallel_flops_sum_to_the_training_count(layout):
    """Each cp rank runs its s/cp tokens' matmuls and their queries' attention over the
    whole sequence: summed over tp × cp × dp ranks, the model's FLOPs (the rerun apart)."""
    cfg = config(layout, model=CP_MODEL)
    costs = action_costs(cfg.gpt_config(VOCAB), shape_of(cfg), PLAIN)
    tables = (costs.flops_forward, costs.flops_input_grad, costs.flops_weight_grad)
    per_replica = sum(sum(map(sum, table)) for table in tables)
    ranks = layout.tp * layout.cp * cfg.data_parallel_size
    total = per_replica * cfg.num_microbatches * ranks
    step = predict_step_time(cfg, VOCAB, PLAIN)
    assert total - step.breakdown["recompute_flops"] == pytest.approx(model_flops(16), rel=1e-12)
    assert step.tflops_per_gpu * 1e12 * step.seconds * layout.world_size == pytest.approx(
        model_flops(16), rel=1e-12
    )


def test_ring_traffic_by_hand():
    """p2p at cp = 4, nothing overlapped: per layer cp − 1 messages of one rank's keys and
    values forward (2·n·b·h·2 bytes, bf16), and backward the keys again and cp hops of
    their gradients' accumulator in float32; the attention core's FLOPs are those of the
    rank's n queries against the whole sequence."""
    costs, one = cp_costs(Layout(cp=4)), cp_costs(Layout())
    n, h = 128 // 4, 256
    keys = 1e-6 + 2 * n * h * 2 / 100e9
    accumulator = 1e-6 + 2 * n * h * 4 / 100e9
    assert costs.cp_forward[0][0] == pytest.approx(8 * 3 * keys)
    assert costs.cp_backward[0][0] == pytest.approx(8 * (3 * keys + 4 * accumulator))
    assert costs.cp_calls_forward[0][0] == 8 * 3 and costs.cp_calls_backward[0][0] == 8 * 7
    assert costs.flops_forward[0][0] == pytest.approx(one.flops_forward[0][0] / 4)
    assert costs.context_parallel[0][0] == pytest.approx(8 * (6 * keys + 4 * accumulator))


def test_ring_transfers_hide_under_the_attention_of_their_step():
    """With overlap, a ring step's transfer costs only what its share of the attention core
    does not cover; the backward's last accumulator hop covers nothing."""
    gpt = config(Layout(cp=4), model=CP_MODEL).gpt_config(VOCAB)
    core = layer_flops(gpt, 128, 1)[1]
    for bandwidth in (1e15, 1e6):  # the core covers the transfer, or barely dents it
        hardware = dataclasses.replace(
            PLAIN, overlap_communication=True, intra_node_bandwidth=bandwidth
        )
        costs = cp_costs(Layout(cp=4), hardware)
        step = core / 4 / hardware.gemm_flops
        keys = 1e-6 + 2 * 32 * 256 * 2 / bandwidth
        accumulator = 1e-6 + 2 * 32 * 256 * 4 / bandwidth
        forward = 3 * max(0.0, keys - step)
        backward = max(0.0, keys - 2 * step) + 2 * max(0.0, keys + accumulator - 2 * step)
        backward += max(0.0, accumulator - 2 * step) + accumulator
        assert costs.cp_forward[0][0] == pytest.approx(8 * forward)
        assert costs.cp_backward[0][0] == pytest.approx(8 * backward)
    assert forward > 0  # the slow link leaves most of it exposed


def test_all_gather_and_a2a_volumes():
    """all_gather: an all-gather of the whole sequence's keys and values forward, a
    reduce-scatter backward; a2a: three all-to-alls of the rank's q, k and v and the
    output's, each way, per rank 1/cp of the sequence. Neither overlaps."""
    link = Link(100e9, 1e-6)
    gathered = cp_costs(Layout(cp=4, cp_comm_type="all_gather"))
    per_layer = link.all_gather(2 * 128 * 256 * 2, 4)
    assert gathered.cp_forward[0][0] == pytest.approx(8 * per_layer)
    assert gathered.cp_backward[0][0] == pytest.approx(8 * per_layer)
    ulysses = cp_costs(Layout(cp=4, cp_comm_type="a2a"))
    q = 32 * 256 * 2
    per_layer = 2 * link.all_to_all(q, 4) + link.all_to_all(2 * q, 4)
    assert ulysses.cp_forward[0][0] == pytest.approx(8 * per_layer)
    assert ulysses.cp_calls_forward[0][0] == 8 * 3
    overlapped = dataclasses.replace(PLAIN, overlap_communication=True)
    assert cp_costs(Layout(cp=4, cp_comm_type="a2a"), overlapped).cp_forward[0][0] == (
        pytest.approx(8 * per_layer)
    )


def test_context_parallel_links_and_the_gradient_reduction():
    """The cp group rides NVLink while tp·cp fits a node, InfiniBand beyond; the gradients
    are reduced over dp × cp ranks, as dp alone of the same count reduces them."""
    near = cp_costs(Layout(tp=2, cp=4, cp_comm_type="all_gather"))
    far = cp_costs(Layout(tp=4, cp=4, cp_comm_type="all_gather"))  # 16 > 8 per node
    assert far.cp_forward[0][0] > 4 * near.cp_forward[0][0]
    assert cp_costs(Layout(cp=2, dp=2)).grad_reduce == pytest.approx(
        cp_costs(Layout(dp=4)).grad_reduce
    )
    sharded, plain = cp_costs(Layout(cp=4, zero_stage=1)), cp_costs(Layout(dp=4, zero_stage=1))
    assert sharded.optimizer == pytest.approx(plain.optimizer)  # a quarter each


def test_processes_sharing_cores_price_each_cp_transfer_as_a_collective_call():
    """On a CPU machine's profile every ring step or cp collective costs the fitted CPU
    time of a collective call, in the action that makes it, and the shared-cores
    simulation runs the cp ranks as peers of their pipeline rank."""
    from megapp.planning.profiles import predict_step_time as predict_on
    from megapp.planning.shared_cores import CpuProfile, SharedCores

    cfg = config(Layout(cp=2), model=CP_MODEL)
    gpt = cfg.gpt_config(VOCAB)
    machine = CpuProfile(GLOO, SharedCores(cores=2, collective_overhead=1e-3))
    plain, charged = (
        action_costs(gpt, shape_of(cfg), GLOO),
        machine.action_costs(gpt, shape_of(cfg)),
    )
    assert charged.forward[0][0] - plain.forward[0][0] == pytest.approx(8 * 1 * 1e-3)
    assert charged.input_grad[0][0] - plain.input_grad[0][0] == pytest.approx(8 * 3 * 1e-3)
    assert charged.cp_forward[0][0] - plain.cp_forward[0][0] == pytest.approx(8 * 1e-3)
    two = predict_on(cfg, VOCAB, machine)
    four = predict_on(config(Layout(cp=4), model=CP_MODEL), VOCAB, machine)
    assert four.seconds > two.seconds / 2  # four processes take turns on two cores
