"""The planner: its space, its pruning against brute force, memory, the printed commands,
and its errors."""

from __future__ import annotations

import dataclasses
import re
import shlex

import pytest

from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS
from megapp.pipeline_parallel.messages import ScheduleError
from megapp.plan import command_line, main
from megapp.planning.hardware import load_hardware
from megapp.planning.layout import pretrain_config
from megapp.planning.layout_space import Space, layouts
from megapp.planning.memory import predict_memory
from megapp.planning.models import MODELS, ModelPreset
from megapp.planning.search import Planner
from megapp.planning.shared_cores import CpuProfile, SharedCores
from megapp.planning.timing import predict_step_time
from megapp.training.arguments import config_from_flags
from megapp.training.flag_groups import ArgumentsError

FLAGS = (
    "--num-layers",
    "8",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "512",
    "--bf16",
)
MODEL = ModelPreset(FLAGS, 32000, "a small GPT")
H100 = load_hardware("h100")
MODEL_TINY = MODELS["tiny"]


@pytest.fixture
def flag_file(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text(" ".join(FLAGS) + "\n--vocab-size 32000\n")
    return str(path)


def test_the_space_follows_the_rules():
    planner = Planner(MODEL, H100, 16, 8)
    space = list(layouts(planner.base, 8, 4, 16, Space(max_micro_batch_size=4)))
    assert space and len(space) == len(set(space))
    for layout in space:
        assert layout.world_size == 8 and layout.tp <= 4 and 8 % layout.tp == 0
        assert 16 % (layout.micro_batch_size * layout.dp) == 0 and layout.micro_batch_size <= 4
        assert layout.vpp == 2 or not (layout.schedule and SCHEDULE_KINDS[layout.schedule].v_shaped)
        assert layout.zero_stage == 0 or layout.dp > 1
        assert not layout.sequence_parallel or layout.tp > 1
        assert layout.pp > 1 or layout.schedule is None
    kinds = {(x.tp, x.pp, x.schedule, x.recompute, x.zero_stage) for x in space}
    assert (4, 2, "zb-v", "full", 3) not in kinds  # dp 1: no ZeRO
    assert (2, 2, "zb-v", "full", 3) in kinds
    assert {x.tp for x in space} == {1, 2, 4}


def test_split_backward_names_the_schedules_with_input_gradients():
    from megapp.pipeline_parallel.catalog import SCHEDULES, build_schedule
    from megapp.pipeline_parallel.schedules import Op

    for name in SCHEDULES:
        schedule = build_schedule(name, 2, 4, 2 if name != "1f1b" and name != "gpipe" else 1)
        splits = any(a.op is Op.INPUT_GRAD for row in schedule.actions for a in row)
        assert splits == SCHEDULE_KINDS[name].split_backward, name


def brute_force(hardware, gbs, gpus):
    """Every layout predicted in full, fastest first."""
    planner = Planner(MODEL, hardware, gbs, gpus)
    timed = []
    for layout in layouts(
        planner.base, gpus, hardware.gpus_per_node, gbs, Space(max_micro_batch_size=2)
    ):
        try:
            config = pretrain_config(layout, FLAGS, gbs)
            step = predict_step_time(config, MODEL.vocab_size, hardware)
        except (ArgumentsError, ValueError, ScheduleError):
            continue
        predicted = predict_memory(config, MODEL.vocab_size, hardware.transport)
        memory = max(r.total for r in predicted)
        if memory <= hardware.usable_memory:
            timed.append((step.seconds, layout))
    return sorted(timed, key=lambda item: item[0])


@pytest.mark.slow  # times every layout of the space by brute force
def test_pruning_finds_what_brute_force_finds():
    """The bound-and-stop search returns the brute force's best times, and never a layout
    that does not fit: memory tight enough that the fastest layouts are dropped."""
    hardware = dataclasses.replace(H100, memory_bytes=0.5e9, gpus_per_node=4)
    everything = brute_force(hardware, 8, 4)
    result = Planner(MODEL, hardware, 8, 4).plan(4, 3, Space(max_micro_batch_size=2))
    got = [planned.step.seconds for planned in result.best]
    assert got == pytest.approx([seconds for seconds, _ in everything[:3]], rel=1e-12)
    assert result.timed < len(everything)  # it did prune
    # many layouts do not fit here: the memory floor drops most of them without a config
    # built or a memory predicted, with whole backwards and with split ones (whose store
    # from I to W it counts); a floor: the backward's working memory is not in it, and at
    # 0.5 GB that is often the peak
    planner = Planner(MODEL, hardware, 8, 4)
    over, floored = {False: 0, True: 0}, {False: 0, True: 0}
    for layout in layouts(planner.base, 4, 4, 8, Space(max_micro_batch_size=2)):
        try:
            config = pretrain_config(layout, FLAGS, 8)
        except (ArgumentsError, ValueError):
            continue
        predicted = predict_memory(config, MODEL.vocab_size, hardware.transport)
        if max(r.total for r in predicted) > hardware.usable_memory:
            split = config.schedule.splits_backward
            over[split] += 1
            floor = planner.memory_floor(layout, planner.gpt(layout), planner.schedule(layout))
            floored[split] += floor > hardware.usable_memory
    for split in (False, True):
        assert over[split] > 0 and floored[split] > 0.8 * over[split], (over, floored)
    assert all(planned.memory_bytes <= hardware.usable_memory for planned in result.best)
    roomy = Planner(MODEL, dataclasses.replace(hardware, memory_bytes=80e9), 8, 4)
    roomy_result = roomy.plan(4, 1, Space(max_micro_batch_size=2))
    assert roomy_result.checked_first == 0  # everything fits: simulated first
    fastest = roomy_result.best[0]
    assert fastest.memory_bytes > hardware.usable_memory  # dropped above: it does not fit
    assert fastest.step.seconds < got[0]


def rows(output: str) -> list[list[str]]:
    lines = output.strip().splitlines()
    commands = [line.split() for line in lines if line.startswith("    torchrun")]
    return commands


def test_every_printed_command_is_a_valid_run(flag_file, capsys):
    code = main(
        [
            "--model",
            flag_file,
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--gpu",
            "a100",
            "--global-batch-size",
            "32",
            "--top-k",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    commands = rows(out)
    assert len(commands) == 4
    for words in commands:
        assert words[:5] == ["torchrun", "--nproc-per-node", "8", "--nnodes", "2"]
        flags = words[words.index("pretrain_gpt.py") + 1 :]
        assert flags[-4:] == ["--lr", "1e-4", "--train-iters", "1000"]
        config = config_from_flags([*flags, "--use-default-corpus"], world_size=16)
        assert config.training.global_batch_size == 32
    table = [line.split() for line in out.splitlines()[2:] if line[:3].strip().isdigit()]
    seconds = [float(row[3]) for row in table]
    assert seconds == sorted(seconds)
    assert all(float(row[2]) <= load_hardware("a100").usable_memory / 2**30 for row in table)


def test_schedules_can_be_restricted():
    planner = Planner(MODEL, H100, 16, 8)
    space = list(layouts(planner.base, 8, 8, 16, Space(schedules=("zb-v",))))
    assert {x.schedule for x in space} == {"zb-v", None}  # None: no pipeline
    assert all(x.vpp == 2 for x in space if x.pp > 1)


def test_sequence_length_override_reaches_the_command(capsys):
    assert (
        main(
            [
                "--model",
                "gpt2",
                "--gpus",
                "8",
                "--global-batch-size",
                "16",
                "--seq-length",
                "256",
                "--top-k",
                "1",
            ]
        )
        == 0
    )
    words = rows(capsys.readouterr().out)[0]
    assert words[words.index("--seq-length") + 1] == "256"
    assert "--nnodes" not in words


def test_command_line_names_every_layout_flag():
    planner = Planner(MODEL, H100, 16, 16)
    layout = next(x for x in layouts(planner.base, 16, 8, 16) if x.schedule == "zb-v")
    words = shlex.split(command_line(layout, MODEL, 16, 8, 16))
    assert words[words.index("--pipeline-schedule") + 1] == "zb-v"
    assert words[words.index("--num-layers-per-virtual-pipeline-stage") + 1] == str(
        8 // (2 * layout.pp)
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope", "--gpus", "8", "--global-batch-size", "8"], "unknown model 'nope'"),
        (
            ["--model", "gpt2", "--gpus", "0", "--global-batch-size", "8"],
            "argument --gpus: must be >= 1, got 0",
        ),
        (
            ["--model", "gpt2", "--gpus", "8", "--global-batch-size", "8", "--gpu", "v100"],
            "unknown hardware 'v100'",
        ),
        (
            ["--model", "gpt2", "--gpus", "12", "--global-batch-size", "12"],
            "--gpus 12 is not a whole number of 8-GPU nodes",
        ),
        (["--model", "gpt2", "--gpus", "8"], "the following arguments are required"),
    ],
)
def test_bad_input_fails_in_one_line(argv, message, capsys):
    _fails_in_one_line(argv, message, capsys)


def _fails_in_one_line(argv, message, capsys) -> None:
    """``main(argv)`` exits 2 with ``message`` in one line of stderr."""
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert message in err


def test_nothing_fits_says_so(tmp_path, capsys):
    """Nothing fits: said so in one line, with what else refused layouts where any did
    (GPT-2's 12 layers do not split over 8 pipeline ranks)."""
    tiny = dataclasses.replace(H100, name="tiny", memory_bytes=1e6)
    tiny.save(tmp_path / "tiny.json")
    argv = ["--model", "gpt2", "--global-batch-size", "8", "--gpu", str(tmp_path / "tiny.json")]
    assert main([*argv, "--gpus", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "python -m megapp.plan: error: no layout fits in memory"
    assert main([*argv, "--gpus", "8"]) == 1
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"python -m megapp.plan: error: no layout can run: \d+ over memory, [1-9]\d* refused "
        r"by pretrain_gpt.py's checks, 0 deadlock on this transport",
        err,
    ), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--gpus", "1024", "--global-batch-size", "1531"],
            "global batch 1531 is not divisible by any data-parallel size that 1024 GPUs leave "
            "(64, 128, 256, 512, 1024: GPUs / (tp × cp × pp), tp dividing a node's 8 GPUs and the "
            "model's 4 heads, pp up to its 4 layers); use a multiple of 64",
        ),
        (
            ["--gpus", "8", "--global-batch-size", "1", "--schedules", "zb-v", "--max-chunks", "1"],
            "the schedules zb-v run two chunks per pipeline rank, and no pipeline size that "
            "global batch 1 allows gives two (the model's 4 layers, at most 1 chunks per rank)",
        ),
        (
            ["--gpus", "8", "--global-batch-size", "8", "--cp", "3"],
            "no context-parallel size of 3 can run (p2p, all_gather, a2a): none divides the 8 GPUs",
        ),
        (
            ["--gpus", "8", "--global-batch-size", "8", "--cp", "8", "--cp-comm-types", "a2a"],
            "no context-parallel size of 8 can run (a2a): comm_type 'a2a' splits the attention "
            "heads over the context-parallel ranks, but 4 query heads are not divisible by cp = 8",
        ),
        (
            ["--gpus", "8", "--global-batch-size", "8", "--cp", "8", "--seq-length", "200"],
            "no context-parallel size of 8 can run (p2p, all_gather, a2a): ",
        ),
    ],
)
def test_an_empty_space_says_which_rule_left_nothing(argv, message, capsys):
    """Not "no layout fits in memory": no layout was there to fit."""
    assert main(["--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m megapp.plan: error: no layout: {message}")
    assert err.count("\n") == 1


def test_context_parallelism_is_searched_for_long_sequences_only():
    """Up to LONG_SEQUENCE tokens the default space has cp 1 alone (the short queries stay
    as fast as before); beyond it every cp that divides the GPUs and passes the rules:
    the sequence splits into 2·cp chunks (s/cp over tp with sequence parallelism) and a2a
    splits each tensor-parallel rank's heads."""
    short = Planner(MODEL, H100, 16, 8)
    assert {x.cp for x in layouts(short.base, 8, 8, 16, seq_length=512)} == {1}
    long = dataclasses.replace(MODEL, flags=(*FLAGS, "--attention-dropout", "0"))
    long = long.with_seq_length(16388)  # 4 · 4097: no cp 4 (8 chunks), s/cp at cp 2 = 2 · 4097
    planner = Planner(long, H100, 16, 8)
    space = list(layouts(planner.base, 8, 8, 16, Space(max_micro_batch_size=1), seq_length=16388))
    assert {x.cp for x in space} == {1, 2}
    assert {x.cp_comm_type for x in space if x.cp > 1} == {"p2p", "all_gather", "a2a"}
    assert {x.tp for x in space if x.cp == 2 and x.sequence_parallel} == {2}
    for layout in space:
        assert layout.world_size == 8 and 16388 % (2 * layout.cp) == 0
        assert layout.cp > 1 or layout.cp_comm_type == "p2p"  # cp 1 once
    plain = Space(max_micro_batch_size=1, max_chunks=1, schedules=("1f1b",))
    wide = list(layouts(planner.base, 16, 8, 16, plain, seq_length=16384))
    assert {x.cp for x in wide} == {1, 2, 4, 8, 16}
    for layout in wide:
        if layout.cp_comm_type == "a2a" and layout.cp > 1:
            assert (8 // layout.tp) % layout.cp == 0
        if layout.sequence_parallel:
            assert (16384 // layout.cp) % layout.tp == 0
    assert (4, 4, "a2a") not in {(x.tp, x.cp, x.cp_comm_type) for x in wide}  # 2 heads each
    assert (2, 4, "a2a") in {(x.tp, x.cp, x.cp_comm_type) for x in wide}
    model = long.with_seq_length(16384)
    for layout in wide[:: max(1, len(wide) // 40)]:  # pretrain_gpt.py takes what it lists
        pretrain_config(layout, model.flags, 16)
    dropout = list(layouts(short.base, 16, 8, 16, seq_length=16384))  # GPT's 0.1: cp refused
    assert {x.cp for x in dropout} == {1}


def test_a_long_sequence_plans_context_parallelism():
    """One 64K-token sequence per iteration on 8 GPUs (no data parallelism): attention is
    most of the work, and splitting the sequence over cp ranks, whose ring transfers hide
    under it, beats splitting the layers (tp's all-reduces) or the model (pp's bubble)."""
    long = dataclasses.replace(MODEL, flags=(*FLAGS, "--attention-dropout", "0"))
    long = long.with_seq_length(65536)
    space = Space(max_micro_batch_size=1, max_chunks=1, schedules=("1f1b",))
    result = Planner(long, H100, 1, 8).plan(8, 3, space)
    assert result.best and all(planned.layout.cp > 1 for planned in result.best)
    assert result.best[0].layout.cp == 8 and result.best[0].layout.cp_comm_type == "p2p"
    assert result.enumerated > result.invalid + result.over_memory + result.timed


def test_tensor_parallel_groups_stay_within_a_node():
    """tp 6 divides 48 GPUs and 48 heads, but on 8-GPU nodes a group of 6 would straddle
    two nodes: only sizes that divide the node are laid out."""
    from megapp.models.gpt import GPTConfig

    base = GPTConfig(num_layers=4, hidden_size=96 * 48, num_attention_heads=48, vocab_size=128)
    sizes = {layout.tp for layout in layouts(base, 48, 8, 96, Space(max_micro_batch_size=1))}
    assert sizes == {1, 2, 4, 8}


@pytest.mark.slow  # two plans of eight processes through the shared-cores simulation
def test_a_cpu_machine_profile_plans_its_shared_cores(tmp_path, capsys):
    """A calibrated CPU machine's file plans through its own time model: 8 processes on 2
    cores, each layout's time the shared-cores simulation's."""
    hardware = dataclasses.replace(
        load_hardware("h100"),
        name="cpu-8proc",
        gemm_flops=3e9,
        peak_flops=None,
        overlap_communication=False,
        transport="gloo",
    )
    machine = CpuProfile(hardware, SharedCores(cores=2, message_overhead=1e-4))
    machine.save(tmp_path / "cpu.json")
    argv = ["--model", "tiny", "--gpus", "8", "--global-batch-size", "16", "--top-k", "2"]
    assert main([*argv, "--gpu", str(tmp_path / "cpu.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny on 8 × cpu-8proc (8 per node)")
    best = Planner(MODEL_TINY, machine, 16, 8).plan(8, 1).best[0]
    config = pretrain_config(best.layout, MODEL_TINY.flags, 16)
    alone = predict_step_time(config, MODEL_TINY.vocab_size, hardware).seconds
    assert best.step.seconds > alone  # eight processes take turns on two cores
    assert best.layout.name in out


TINY_ARGS = ["--model", "tiny", "--gpus", "8", "--global-batch-size", "16"]
NAME_A = "tp2.pp2.dp2.v1.mb1.1f1b.sp.selective.z1"
NAME_B = "tp1.pp4.dp2.v1.mb2.zb-h1.norecompute.z0"


def test_explain_breaks_down_each_of_the_top_layouts(capsys):
    assert main([*TINY_ARGS, "--top-k", "2", "--explain", "--max-micro-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    table = [line.split()[1] for line in out.splitlines() if line[:3].strip().isdigit()]
    sections = [line.split()[1].rstrip(":") for line in out.splitlines() if line[:1] == "#"]
    assert sections == table and len(table) == 2
    assert out.count("predicted step") == 2 and out.count("memory per pipeline rank") == 2


def test_one_named_layout_is_explained_without_a_search(capsys):
    assert main([*TINY_ARGS, "--layout", NAME_A]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{NAME_A}: step ")
    assert any(line.startswith("  predicted step") for line in lines)
    assert lines[-1].startswith("torchrun") and "--recompute-granularity selective" in lines[-1]


def test_compare_prints_b_minus_a(capsys):
    assert main([*TINY_ARGS, "--compare", NAME_A, NAME_B]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"A: {NAME_A}") and lines[1].startswith(f"B: {NAME_B}")
    numeric = [line for line in lines[3:] if line.endswith(tuple("0123456789"))]
    assert any(line.startswith("step (s)") for line in numeric)
    for line in numeric:
        a, b, diff = (float(word) for word in line.split()[-3:])
        assert diff == pytest.approx(b - a, rel=1e-3, abs=1e-3 * max(abs(a), abs(b)))


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        (["--layout", "tp2.pp2.dp2"], "layout 'tp2.pp2.dp2' does not parse: expected tp<n>"),
        (["--layout", "tp2.pp2.dp1.v1.mb1.1f1b.norecompute.z0"], "runs on 4 GPUs, not the 8"),
        (
            ["--compare", NAME_A, "tp8.pp1.dp1.v1.mb1.default.norecompute.z0"],
            "layout tp8.pp1.dp1.v1.mb1.default.norecompute.z0 is not valid for this model:",
        ),
        (["--layout", NAME_A, "--compare", NAME_A, NAME_B], "not allowed with argument"),
    ],
)
def test_a_bad_layout_fails_in_one_line(layouts, message, capsys):
    _fails_in_one_line([*TINY_ARGS, *layouts], message, capsys)
