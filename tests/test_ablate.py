"""megapp.ablation, behind tools/ablate.py and tools/ablation_report.py: the points a spec
expands to, resuming, failure capture, the parity alarm, the SLURM array script and the
report, with a fake launcher that writes metrics files instead of starting torchrun; one
real two-process sweep at the end."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megapp.ablation import breakdown_tables, records
from megapp.ablation import command as ablate
from megapp.ablation import points as points_of
from megapp.ablation import report as ablation_report
from megapp.ablation.launch import error_summary, run_command
from megapp.ablation.memory_check import parse_layout
from megapp.ablation.parity import FAIL, NOT_APPLICABLE, PASS, compare_losses
from megapp.ablation.points import SweepSpec, expand, load_spec, spec_from_mapping
from megapp.ablation.slurm import slurm_script
from megapp.ablation.sweep import reference_points, run_sweep
from megapp.planning.layout import Layout
from megapp.training.launch import Launched

MODEL = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4")
MODEL += ("--seq-length", "32")
LOSSES = [5.5, 4.9, 4.7, 4.6, 4.55, 4.5]


def small_spec(**overrides) -> SweepSpec:
    values = dict(
        model_flags=MODEL,
        global_batch_size=8,
        train_iters=6,
        nproc=4,
        tp=(1, 2),
        pp=(1, 2),
        micro_batch_size=(2,),
        recompute=(None, "selective"),
    )
    return SweepSpec(**{**values, **overrides})


def flag_value(command, flag: str) -> str:
    return command[list(command).index(flag) + 1]


def write_metrics(path: Path, losses, world: int, ms: float = 100.0, bubble: float = 0.25):
    """A metrics file as pretrain_gpt.py writes it: run, train per iteration, profile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"kind": "run", "iteration": 0, "config": {"world_size": world, "model": {}}}]
    lines[0]["config"]["model"]["seq_length"] = 32
    for i, loss in enumerate(losses, start=1):
        slow = 10 if i in (1, 4, 5) else 1  # warm-up and the two profiled iterations
        lines.append(
            {"kind": "train", "iteration": i, "lm_loss": loss, "global_batch_size": 8}
            | {"elapsed_ms_per_iteration": ms * slow, "tokens_per_second_per_device": 1.0}
        )
    ranks = [
        {"rank": r, "tp": 0, "pp": r % 2, "dp": r // 2, "peak_bytes": 1000 + 100 * r}
        | {"state_bytes": 500, "comm_seconds": 0.01 * r, "seconds": 0.1}
        | {"events": [["compute", "F0", 0.0, 0.05], ["wait", "p2p", 0.05, 0.06]]}
        for r in range(world)
    ]
    lines.append({"kind": "profile", "iteration": 4, "seconds": 0.1, "bubble": bubble})
    lines[-1]["ranks"] = ranks
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


class FakeLauncher:
    """Writes the metrics a point would, with ``losses_of(name)``; ``fail`` names points
    that exit with an error instead, ``calls`` counts launches."""

    def __init__(self, losses_of=None, fail=(), timeout=(), ms_of=None):
        self.losses_of = losses_of or (lambda name: LOSSES)
        self.ms_of = ms_of or (lambda name, launch: 100.0)
        self.fail, self.timeout, self.calls = set(fail), set(timeout), []

    def __call__(self, command, log_path, timeout_s, env) -> Launched:
        metrics = Path(flag_value(command, "--metrics-path"))
        name, launch = metrics.parent.name, 1
        if name.startswith("launch"):  # runs/<name>/launch<k>/metrics.jsonl
            name, launch = metrics.parent.parent.name, int(name.removeprefix("launch"))
        self.calls.append(name)
        assert env["OMP_NUM_THREADS"] == "1"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if name in self.fail:
            log_path.write_text("starting\npretrain_gpt.py: error: rank 3 ran out of luck\n")
            return Launched(2, False, 0.1)
        if name in self.timeout:
            log_path.write_text("iteration 1\n")
            return Launched(None, True, timeout_s)
        world = int(flag_value(command, "--nproc-per-node"))
        write_metrics(metrics, self.losses_of(name), world, ms=self.ms_of(name, launch))
        log_path.write_text("ok\n")
        return Launched(0, False, 0.1)


def test_expansion_keeps_valid_points_and_says_why_others_drop():
    spec = small_spec(
        vpp=(1, 2), schedule=(None, "interleaved-1f1b"), sequence_parallel=(False, True)
    )
    expansion = expand(spec)
    names = {p.name for p in expansion.points}
    assert "tp2.pp2.dp1.v1.mb2.default.sp.selective.z0" in names
    assert "tp1.pp2.dp2.v2.mb2.interleaved-1f1b.norecompute.z0" in names
    reasons = [d.reason for d in expansion.dropped]
    assert any("sequence parallelism needs tp > 1" in r for r in reasons)
    # interleaving on one pipeline stage is refused with pretrain_gpt.py's own message
    assert any("--num-layers-per-virtual-pipeline-stage needs" in r for r in reasons)
    assert len(expansion.points) + len(expansion.dropped) == 2 * 2 * 2 * 2 * 2 * 2
    for point in expansion.points:
        assert point.world_size == 4
        assert "--hidden-dropout" in point.flags and "--log-interval" in point.flags


def test_a_v_schedule_asked_for_with_one_chunk_is_the_two_chunk_point_once():
    """zb-v runs two chunks per rank whatever the vpp axis says: the sweep runs that
    layout once, named for what runs, and says why the other is left out."""
    spec = small_spec(tp=(1,), pp=(2,), vpp=(1, 2), schedule=("zb-v",), recompute=(None,))
    expansion = expand(spec)
    name = "tp1.pp2.dp2.v2.mb2.zb-v.norecompute.z0"
    assert [p.name for p in expansion.points] == [name]
    (dropped,) = expansion.dropped
    assert dropped.description == name and f"runs as {name}" in dropped.reason


def test_world_size_must_divide():
    expansion = expand(small_spec(tp=(3,), pp=(1,), recompute=(None,)))
    assert not expansion.points
    assert "not divisible by tp × pp = 3" in expansion.dropped[0].reason


def test_context_parallel_axes():
    """cp and its communication are axes like the others: one point per size at cp 1, each
    point runs pretrain_gpt.py's flags, and the rules of the job drop what it refuses. The
    sweep runs without dropout, which context parallelism needs."""
    spec = small_spec(tp=(1, 2), pp=(1,), cp=(1, 2, 4), cp_comm_type=("p2p", "a2a"))
    expansion = expand(spec)
    names = [p.name for p in expansion.points]
    assert len(names) == len(set(names))
    assert "tp1.pp1.dp4.v1.mb2.default.norecompute.z0" in names  # cp 1: once
    assert "tp1.cp4-a2a.pp1.dp1.v1.mb2.default.selective.z0" in names
    assert "tp2.cp2-p2p.pp1.dp1.v1.mb2.default.norecompute.z0" in names
    point = next(p for p in expansion.points if p.name.startswith("tp1.cp2-a2a.pp1.dp2"))
    assert flag_value(point.flags, "--context-parallel-size") == "2"
    assert flag_value(point.flags, "--cp-comm-type") == "a2a" and point.world_size == 4
    assert flag_value(point.flags, "--attention-dropout") == "0"
    reasons = [d.reason for d in expansion.dropped]
    assert any("not divisible by tp × cp × pp = 8" in r for r in reasons)  # tp 2 × cp 4
    # 4 heads over tp 2 leave 2 per rank, which a2a cannot split over cp 4; the ring can
    wide = small_spec(nproc=8, tp=(2,), pp=(1,), cp=(4,), recompute=(None,))
    ring, ulysses = expand(wide), expand(replace(wide, cp_comm_type=("a2a",)))
    assert [p.name for p in ring.points] == ["tp2.cp4-p2p.pp1.dp1.v1.mb2.default.norecompute.z0"]
    assert not ulysses.points and "'a2a'" in ulysses.dropped[0].reason
    odd = expand(small_spec(model_flags=(*MODEL[:-1], "30"), tp=(1,), pp=(1,), cp=(4,)))
    assert not odd.points and "not divisible by 2 × context-parallel size" in odd.dropped[0].reason


def test_expert_parallel_axis():
    """ep is an axis like cp: its points run --expert-model-parallel-size, and what the job
    refuses (ep beyond the experts, a dense model, tp without sequence parallelism) drops."""
    moe = (*MODEL, "--num-experts", "4", "--moe-router-topk", "2")
    spec = small_spec(model_flags=moe, tp=(1, 2), pp=(1,), ep=(1, 2, 8), recompute=(None,))
    expansion = expand(spec)
    names = [p.name for p in expansion.points]
    assert "tp1.ep2.pp1.dp4.v1.mb2.default.norecompute.z0" in names
    assert "tp1.pp1.dp4.v1.mb2.default.norecompute.z0" in names
    point = next(p for p in expansion.points if ".ep2." in p.name)
    assert flag_value(point.flags, "--expert-model-parallel-size") == "2"
    reasons = [d.reason for d in expansion.dropped]
    assert any("--expert-model-parallel-size" in r for r in reasons)  # ep 8
    assert any("--sequence-parallel" in r for r in reasons)  # tp 2 without it
    dense = expand(small_spec(tp=(1,), pp=(1,), ep=(2,)))
    assert not dense.points and "give --num-experts" in dense.dropped[0].reason


MOE = (*MODEL, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32")


def test_a_model_with_experts_gets_one_dense_twin_per_layout():
    """Each layout the points use, at ep 1, runs the dense twin once: the model without
    any expert flag and with --ffn-hidden-size = top-k × the expert width (+ the shared
    expert's); every mixture-of-experts point names its twin."""
    shared = (*MOE, "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate")
    spec = small_spec(model_flags=(*shared, "--moe-aux-loss-coeff=0.01"), tp=(1,), pp=(1, 2))
    spec = replace(spec, ep=(1, 2, 4), recompute=(None,))
    expansion = expand(spec)
    moe = [p for p in expansion.points if not p.dense_twin]
    twins = [p for p in expansion.points if p.dense_twin]
    assert len(moe) == 5 and [p.name for p in twins] == [  # ep 4 × pp 2 leaves no room
        "dense-tp1.pp1.dp4.v1.mb2.default.norecompute.z0",
        "dense-tp1.pp2.dp2.v1.mb2.default.norecompute.z0",
    ]
    assert expansion.points[-2:] == twins  # after the others
    for point in moe:
        assert point.twin == f"dense-{replace(point.layout, ep=1).name}"
    for twin in twins:
        assert twin.layout.ep == 1 and twin.world_size == 4
        assert flag_value(twin.flags, "--ffn-hidden-size") == str(2 * 32 + 16)
        assert flag_value(twin.flags, "--num-layers") == "4"
        assert not [f for f in twin.flags if "expert" in f or f.startswith("--moe")]
    assert len({p.key for p in expansion.points}) == 7
    assert expansion.twin.description().startswith(
        "the same model, without experts, with every MLP top-2 × the expert width 32 + "
        "the shared expert's 16 = 80 wide"
    )
    assert not any(p.dense_twin or p.twin for p in expand(small_spec()).points)
    with pytest.raises(ValueError, match="a dense model has no dense twin: give --num-exp"):
        points_of.twin_spec(small_spec())


def test_a_dense_twin_of_every_other_layer_keeps_the_mean_active_width():
    """With --moe-layer-freq 2 one --ffn-hidden-size cannot give the dense and the expert
    layers their own widths: the twin's MLPs take the mean (the same MLP work per
    token), unless the dense layers are already as wide as the active experts."""
    every_other = (*MOE, "--moe-layer-freq", "2", "--ffn-hidden-size", "256")
    spec = small_spec(model_flags=every_other, tp=(1,), pp=(1,), recompute=(None,))
    twin = expand(spec).twin
    assert (twin.moe_layers, twin.active_width, twin.dense_width) == (2, 64, 256)
    assert not twin.exact and twin.ffn_hidden_size == (2 * 64 + 2 * 256) // 4
    (point,) = (p for p in expand(spec).points if p.dense_twin)
    assert point.flags.count("--ffn-hidden-size") == 1
    assert flag_value(point.flags, "--ffn-hidden-size") == "160"
    assert "the mean over its 4 layers" in twin.description()
    same = (*MOE, "--moe-layer-freq", "2", "--ffn-hidden-size", "64")
    twin = expand(small_spec(model_flags=same, tp=(1,), pp=(1,))).twin
    assert twin.exact and twin.ffn_hidden_size == 64
    assert "as wide as its other 2 layers' MLPs" in twin.description()


def test_toml_spec(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(
        'model_flags = ["--num-layers", "4", "--hidden-size", "64", '
        '"--num-attention-heads", "4", "--seq-length", "32"]\n'
        'schedule = ["none", "1f1b"]\nrecompute = ["none", "full"]\ntp = [1, 2]\n'
        "nproc = 2\nglobal_batch_size = 8\n"
    )
    spec = spec_from_mapping(load_spec(path))
    assert spec.schedule == (None, "1f1b") and spec.recompute == (None, "full")
    assert spec.tp == (1, 2) and spec.nproc == 2 and spec.num_layers == 4
    with pytest.raises(ValueError, match="unknown sweep settings"):
        spec_from_mapping({"model_flags": list(MODEL), "tensor_parallel": [2]})


def test_a_bad_sweep_file_is_one_line_naming_it(tmp_path, capsys):
    """A syntax error, a missing file, a setting of the wrong kind and an unknown one each
    end the command with status 2 and one line that names the file."""
    model = 'model_flags = ["--num-layers", "4", "--hidden-size", "64"]\n'
    files = {
        "syntax.toml": (model + "tp = [1\n", "syntax.toml: Unclosed array"),
        "words.toml": (model + 'tp = ["two"]\n', "words.toml: tp = ['two']: 'two' is not an "),
        "float.toml": (model + "micro_batch_size = [1.5]\n", "float.toml: micro_batch_size"),
        "switch.toml": (model + 'sequence_parallel = ["on"]\n', "switch.toml: sequence_par"),
        "unknown.toml": (model + "tensor_parallel = [2]\n", "unknown.toml: unknown sweep "),
        "missing.toml": (None, "missing.toml: No such file or directory"),
    }
    for name, (text, message) in files.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        code = ablate.main(["--config", str(tmp_path / name), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (name, err)
        assert err.startswith(f"ablate.py: error: {tmp_path / message}"), (name, err)
    assert not (tmp_path / "out").exists()


def test_a_sweep_whose_every_point_is_refused_runs_nothing(tmp_path, capsys, monkeypatch):
    """Only the single-process references would run, with nothing to compare them with:
    status 2, every refused point listed with its reason, no launch, no records."""
    launches = []
    monkeypatch.setattr(ablate, "run_sweep", lambda *args, **kwargs: launches.append(args))
    flags = ["--out", str(tmp_path / "out"), "--model-flags", " ".join(MODEL), "--nproc", "4"]
    flags += ["--global-batch-size", "8", "--tp", "3", "--pp", "3"]
    for mode in ([], ["--dry-run"], ["--slurm"]):
        assert ablate.main([*flags, *mode]) == 2
        captured = capsys.readouterr()
        assert "0 points, 1 dropped\n  drop  tp3 pp3 vpp1 default mb1" in captured.out
        assert captured.err == (
            "ablate.py: error: every point of the sweep is refused (1; the first, tp3 pp3 "
            "vpp1 default mb1 norecompute z0: world size 4 is not divisible by tp × pp = 9)\n"
        )
    assert not launches and not (tmp_path / "out").exists()


def test_measure_reads_median_tokens_memory_and_bubble(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, LOSSES, world=4, ms=200.0)
    measured = records.measure(path, profile_iteration=4)
    assert measured.losses == LOSSES
    assert measured.iteration_seconds == pytest.approx(0.2)  # 1, 4 and 5 left out
    assert measured.tokens_per_second == pytest.approx(8 * 32 / 0.2)
    assert measured.peak_per_stage() == [1200, 1300]  # the largest of each pipeline rank
    assert measured.comm_seconds == pytest.approx(0.03) and measured.bubble == 0.25


def test_sweep_records_every_point_and_resumes(tmp_path):
    spec = small_spec()
    launcher = FakeLauncher()
    first = run_sweep(spec, tmp_path, launcher=launcher)
    references = reference_points(spec, expand(spec))
    assert [r.name for r in references] == ["tp1.pp1.dp1.v1.mb2.default.norecompute.z0"]
    expected = {references[0].name, *(p.name for p in expand(spec).points)}
    assert set(launcher.calls) == expected
    assert {r.name for r in first.records} == expected
    for record in first.records:
        assert record.status == records.OK and record.parity.status == PASS
        saved = records.load(tmp_path / "points" / f"{record.name}.json")
        assert saved.measured.losses == LOSSES and saved.key == record.key
    assert first.records[0].reference and first.records[0].world_size == 1
    again = FakeLauncher()
    second = run_sweep(spec, tmp_path, launcher=again)
    assert again.calls == [] and set(second.reused) == expected
    # a changed command (more iterations) is a different point: it runs again
    third = FakeLauncher(losses_of=lambda name: [*LOSSES, 4.4])
    run_sweep(small_spec(train_iters=7), tmp_path, launcher=third)
    assert set(third.calls) == expected


def test_failed_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    spec = small_spec()
    names = [p.name for p in expand(spec).points]
    launcher = FakeLauncher(fail={names[0]}, timeout={names[1]})
    result = run_sweep(spec, tmp_path, launcher=launcher)
    by_name = {r.name: r for r in result.records}
    assert by_name[names[0]].status == records.FAILED
    assert "exit status 2" in by_name[names[0]].error
    assert "error: rank 3 ran out of luck" in by_name[names[0]].error
    assert by_name[names[1]].status == records.TIMEOUT
    assert by_name[names[0]].parity is None
    assert all(by_name[n].status == records.OK for n in names[2:])
    # failed points are finished too, unless asked to retry them
    assert run_sweep(spec, tmp_path, launcher=FakeLauncher()).records
    retry = FakeLauncher()
    run_sweep(spec, tmp_path, launcher=retry, retry_failed=True)
    assert sorted(retry.calls) == sorted(names[:2])


def test_a_metrics_file_with_a_bad_line_fails_its_point_and_the_sweep_goes_on(tmp_path):
    """A metrics file whose middle line is not a record (a torn last line is only skipped)
    fails that point with the file and line named; the other points are measured."""
    spec = small_spec(tp=(1,), recompute=(None,))
    broken = expand(spec).points[0].name
    launcher = FakeLauncher()

    def corrupting(command, log_path, timeout_s, env):
        done = launcher(command, log_path, timeout_s, env)
        metrics = Path(flag_value(command, "--metrics-path"))
        lines = metrics.read_text().splitlines(keepends=True)
        if metrics.parent.name == broken:
            lines.insert(2, "{not json\n")
        metrics.write_text("".join([*lines, '{"kind": "tr']))  # and a torn last line
        return done

    result = run_sweep(spec, tmp_path, launcher=corrupting)
    by_name = {r.name: r for r in result.records}
    assert by_name[broken].status == records.FAILED
    assert by_name[broken].error.startswith(f"{tmp_path / 'runs' / broken / 'metrics.jsonl'}:3:")
    others = [r for name, r in by_name.items() if name != broken]
    assert others and all(r.status == records.OK and r.measured.losses == LOSSES for r in others)


def test_repeats_run_in_rounds_and_time_each_point_by_the_fastest_launch(tmp_path):
    spec = small_spec(repeats=3, tp=(1,), recompute=(None,))
    times = {1: 100.0, 2: 130.0, 3: 90.0}
    launcher = FakeLauncher(ms_of=lambda name, launch: times[launch])
    result = run_sweep(spec, tmp_path, launcher=launcher)
    names = [r.name for r in result.records]
    assert launcher.calls == names * 3  # every point once, then again, then again
    for record in result.records:
        assert record.measured.launch_seconds == pytest.approx([0.1, 0.13, 0.09])
        assert record.measured.iteration_seconds == pytest.approx(0.09)
        assert record.measured.tokens_per_second == pytest.approx(8 * 32 / 0.09)
        assert record.error is None
    resumed = FakeLauncher()
    run_sweep(spec, tmp_path, launcher=resumed)
    assert resumed.calls == []
    more = FakeLauncher(ms_of=lambda name, launch: 80.0)
    result = run_sweep(small_spec(repeats=4, tp=(1,), recompute=(None,)), tmp_path, launcher=more)
    assert more.calls == names
    assert result.records[0].measured.iteration_seconds == pytest.approx(0.08)


def test_dense_twins_run_as_points_and_the_report_divides_by_them(tmp_path):
    """The twin runs with the others (and its repeats), is marked in its record, gets no
    parity verdict; the report's column is each point's tokens/s over its twin's."""
    spec = small_spec(model_flags=MOE, tp=(1,), pp=(1,), ep=(1, 2), recompute=(None,))
    spec = replace(spec, repeats=2)
    twin = "dense-tp1.pp1.dp4.v1.mb2.default.norecompute.z0"
    ep2 = "tp1.ep2.pp1.dp4.v1.mb2.default.norecompute.z0"
    other = [x + 0.1 for x in LOSSES]  # another model
    speed = {twin: 50.0, ep2: 200.0}
    launcher = FakeLauncher(
        losses_of=lambda name: other if name == twin else LOSSES,
        ms_of=lambda name, launch: speed.get(name, 100.0),
    )
    sweep = tmp_path / "sweep"
    result = run_sweep(spec, sweep, launcher=launcher)
    assert launcher.calls.count(twin) == 2
    by_name = {r.name: r for r in records.load_all(sweep / "points")}
    assert by_name[twin].dense_twin and not by_name[twin].reference
    assert by_name[twin].parity is None and by_name[ep2].twin == twin
    assert all(r.parity.status == PASS for r in result.records if not r.dense_twin)
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert twin in manifest["points"] and "every MLP top-2" in manifest["dense_twin"]
    ratios = ablation_report.dense_ratios(list(by_name.values()))
    assert ratios == {
        "tp1.pp1.dp4.v1.mb2.default.norecompute.z0": pytest.approx(0.5),
        ep2: pytest.approx(0.25),
    }
    table = ablation_report.layout_table(list(by_name.values()))
    assert "| tokens/s | tokens/s vs dense | peak MiB" in table[0]
    assert table[1].count("---") == 13
    row = next(line for line in table if line.startswith(f"| `{ep2}`"))
    assert "| 200.0 (200–200) | 1280 | 0.25 |" in row
    assert "| dense twin |" in next(line for line in table if line.startswith(f"| `{twin}`"))
    note = " ".join(ablation_report.twin_note(manifest, list(by_name.values())))
    assert "over those of its dense twin" in note and "every MLP top-2" in note
    # a sweep without experts has neither the column nor the note
    dense = run_sweep(small_spec(tp=(1,), pp=(1,)), tmp_path / "dense", launcher=FakeLauncher())
    assert "vs dense" not in ablation_report.layout_table(dense.records)[0]
    assert not ablation_report.twin_note({}, dense.records)


def test_the_report_splits_each_prediction_into_the_planners_lines(tmp_path):
    """A point predicted on a hardware profile stores explain's rows, whose step lines add
    up to the predicted step; the report's row shows them next to the measured step,
    communication and idle share; a record written before the breakdown shows "-"."""
    spec = small_spec(tp=(2,), pp=(2,), recompute=("full",), hardware="h100")
    run_sweep(spec, tmp_path, launcher=FakeLauncher())
    name = "tp2.pp2.dp1.v1.mb2.default.full.z0"
    record = records.load(tmp_path / "points" / f"{name}.json")
    rows, predicted = record.predicted.breakdown, record.predicted.iteration_seconds
    assert rows["step_seconds"] == pytest.approx(predicted)
    lines = {k: v for k, v in rows.items() if k.startswith("step.")}
    assert sum(lines.values()) == pytest.approx(predicted, rel=1e-9)
    assert lines["step.tensor_parallel"] > 0 and lines["step.recompute"] > 0
    assert rows["memory.total"] == pytest.approx(max(record.predicted.memory_per_stage))
    # a record from before the breakdown: no such fields in its file
    raw = json.loads(record.to_json())
    for field in ("breakdown", "step_rank", "memory_rank"):
        del raw["predicted"][field]
    raw["name"] = "tp2.old"
    old = records.PointRecord.from_json(json.dumps(raw))
    assert old.predicted.breakdown is None and old.predicted.iteration_seconds == predicted

    section = breakdown_tables.breakdown_section([record, old])
    step_head, memory_head = (line for line in section if line.startswith("| layout |"))
    assert "| compute | recompute | tp | bubble | messages |" in step_head
    assert "| cp |" not in step_head  # 0 at every point
    heads = [h.strip() for h in step_head.strip("|").split("|")]

    def cells_of(layout: str) -> dict[str, str]:
        row = next(line for line in section if line.startswith(f"| `{layout}`"))
        return dict(zip(heads, (c.strip() for c in row.strip("|").split("|")), strict=True))

    cells = cells_of(name)
    parts = heads[heads.index("rank") + 1 : heads.index("predicted (ms)")]
    total = float(cells["predicted (ms)"])
    assert total == pytest.approx(predicted * 1e3, rel=1e-3)
    assert sum(float(cells[h]) for h in parts) == pytest.approx(total, rel=1e-3)
    # measured: 100 ms per iteration, 30 ms blocked on rank 3, idle share 0.25
    assert cells["measured (ms)"] == "100" and cells["comm, pred. / meas. (ms)"].endswith("/ 30")
    assert cells["idle share, pred. / meas."] == f"{record.predicted.bubble:.2f} / 0.25"
    stale = cells_of("tp2.old")
    assert {stale[h] for h in ("rank", *parts, "predicted (ms)")} == {"-"}
    assert stale["measured (ms)"] == "100" and stale["comm, pred. / meas. (ms)"] == "- / 30"
    assert "| activations (in flight × each) |" in memory_head
    peak_rank = record.predicted.memory_rank
    memory_row = next(line for line in section if line.startswith(f"| `{name}`") and "×" in line)
    peak = record.measured.peak_per_stage()[peak_rank] / 2**20
    assert memory_row.startswith(f"| `{name}` | {peak_rank} | ") and f"| {peak:.1f} |" in memory_row
    # a sweep whose records all predate the breakdown says so instead of a table
    assert "No record has the predicted breakdown" in breakdown_tables.breakdown_section([old])[0]


def test_a_repeat_that_fails_or_trains_another_model_is_not_counted(tmp_path):
    spec = small_spec(tp=(1,), pp=(1,), recompute=(None,))
    run_sweep(spec, tmp_path, launcher=FakeLauncher())
    twice = small_spec(repeats=2, tp=(1,), pp=(1,), recompute=(None,))
    name = expand(spec).points[0].name
    result = run_sweep(twice, tmp_path, launcher=FakeLauncher(fail={name}))
    record = next(r for r in result.records if r.name == name)
    assert record.status == records.OK and record.measured.launch_seconds == [0.1]
    assert "launch 2 failed (exit status 2)" in record.error
    other = FakeLauncher(losses_of=lambda n: [x + 1e-3 for x in LOSSES])
    result = run_sweep(twice, tmp_path, launcher=other)
    record = next(r for r in result.records if r.name == name)
    assert "other losses than the first" in record.error
    assert record.measured.launch_seconds == [0.1]
    result = run_sweep(twice, tmp_path, launcher=FakeLauncher(timeout={name}))
    record = next(r for r in result.records if r.name == name)
    assert "launch 2 failed (stopped after 600 s)" in record.error
    result = run_sweep(twice, tmp_path, launcher=FakeLauncher())  # the retry counts
    record = next(r for r in result.records if r.name == name)
    assert record.measured.launch_seconds == [0.1, 0.1] and record.error is None
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        spec_from_mapping({"model_flags": list(MODEL), "repeats": 0})


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow  # waits out the time limit
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states in /proc")
def test_run_command_stops_a_point_at_its_time_limit(tmp_path):
    """Past the limit the whole process group stops, a rank the launcher started included."""
    log, pid_file = tmp_path / "log.txt", tmp_path / "rank.pid"
    rank = f"sleep 60 & echo $! > {pid_file}.part; mv {pid_file}.part {pid_file}; wait"
    result = run_command(["sh", "-c", rank], log, 2.0, {"PATH": os.environ["PATH"]})
    assert result.timed_out and result.returncode is None
    assert "time limit" in error_summary(log)
    assert not running(int(pid_file.read_text()))


def test_parity_passes_equal_losses_and_flags_a_deviation():
    reference = [5.5, 4.9, 4.7]
    assert compare_losses([5.5 * (1 + 1e-7), 4.9, 4.7], reference).status == PASS
    bad = compare_losses([5.5, 4.9 * (1 + 1e-3), 4.7], reference)
    assert bad.status == FAIL and bad.first_bad_iteration == 2
    assert bad.max_rel_diff == pytest.approx(1e-3)
    assert compare_losses([5.5, 4.9], reference).status == FAIL  # stopped early


def test_sweep_flags_the_layout_that_trains_another_model(tmp_path, capsys):
    spec = small_spec(recompute=(None,))
    wrong = "tp2.pp2.dp1.v1.mb2.default.norecompute.z0"
    launcher = FakeLauncher(
        losses_of=lambda name: [x * 1.01 for x in LOSSES] if name == wrong else LOSSES
    )
    result = run_sweep(spec, tmp_path, launcher=launcher)
    status = {r.name: r.parity.status for r in result.records}
    assert status.pop(wrong) == FAIL and set(status.values()) == {PASS}
    ablate.summary(result.records)
    out = capsys.readouterr().out
    assert "PARITY ALARM" in out and wrong in out


ASYNC_MODEL = (*MODEL, "--clip-grad", "0", "--untie-embeddings-and-output-weights")
SCHEDULES = ("1f1b", "pipedream-2bw", "pipedream", "pipedream-vsync")


def async_spec(**overrides) -> SweepSpec:
    values = dict(model_flags=ASYNC_MODEL, tp=(1,), pp=(2,), schedule=SCHEDULES)
    return small_spec(**{**values, **overrides})


def test_each_update_rule_has_its_own_reference():
    rule = points_of.update_rule
    assert {rule(s) for s in (None, "zb-v", "auto", "1f1b")} == {points_of.FLUSHED}
    assert rule("pipedream-2bw") == points_of.TWO_BW
    assert rule("pipedream") == rule("pipedream-vsync") == points_of.PIPEDREAM
    expansion = expand(async_spec())
    assert not expansion.dropped and len(expansion.points) == 8  # × recompute none, selective
    assert [p.layout.schedule for p in expansion.points[::2]] == list(SCHEDULES)
    references = reference_points(async_spec(), expansion)
    assert [r.layout.schedule for r in references] == [None, "pipedream-2bw"]
    assert all(r.world_size == 1 and r.layout.micro_batch_size == 2 for r in references)
    assert "--clip-grad" in references[1].flags
    flushed_only = async_spec(schedule=("1f1b", "pipedream"))  # no 2BW point, no 2BW reference
    assert len(reference_points(flushed_only, expand(flushed_only))) == 1


@pytest.mark.slow  # draws the report; the rule per schedule stays fast above
def test_parity_per_update_rule(tmp_path, capsys):
    """1F1B against the flushed reference, 2BW against its own, PipeDream with no verdict."""
    spec = async_spec()
    two_bw_ok = "tp1.pp2.dp2.v1.mb2.pipedream-2bw.norecompute.z0"
    two_bw_bad = "tp1.pp2.dp2.v1.mb2.pipedream-2bw.selective.z0"
    flushed, two_bw = (r.name for r in reference_points(spec, expand(spec)))
    other_rule = [x + 0.05 for x in LOSSES]
    launcher = FakeLauncher(lambda name: other_rule if name in (two_bw, two_bw_ok) else LOSSES)
    sweep = tmp_path / "sweep"
    result = run_sweep(spec, sweep, launcher=launcher)
    assert json.loads((sweep / "sweep.json").read_text())["references"] == [flushed, two_bw]
    got = {r.name: (r.parity.status, r.parity.reference) for r in result.records}
    assert launcher.calls[:2] == [r.name for r in result.records if r.reference]
    assert got.pop(flushed) == (PASS, flushed) and got.pop(two_bw) == (PASS, two_bw)
    by_schedule = {"1f1b": (PASS, flushed), "pipedream-2bw": (PASS, two_bw)}
    for name, verdict in got.items():
        expected = by_schedule.get(name.split(".")[5], (NOT_APPLICABLE, None))
        assert verdict == ((FAIL, two_bw) if name == two_bw_bad else expected), name
    ablate.summary(result.records)
    out = capsys.readouterr().out
    why = "PipeDream's weight versions depend on the pipeline depth; its semantics are checked"
    assert f"parity n/a: {why}" in out and f"(against {two_bw})" in out
    assert ablation_report.main([str(sweep), "--out", str(tmp_path / "report")]) == 1
    text = (tmp_path / "report" / "report.md").read_text()
    alarm = text[: text.index("Made by")]
    assert f"`{two_bw_bad}`: max relative difference" in alarm and f"from `{two_bw}`" in alarm
    assert two_bw_ok not in alarm and "1f1b" not in alarm
    assert f"Parity: 2 of 2 finished layouts equal the single-process run `{flushed}`" in text
    assert f"1 of 2 finished layouts equal the single-process run `{two_bw}`" in text
    assert f"vertical sync): n/a for 4 layout(s). {why}" in text
    # a sweep directory written with one "reference" name still reads its reference
    manifest = ablation_report.read_manifest(sweep)
    manifest["reference"] = manifest.pop("references")[0]
    current = ablation_report.current_records(sweep, manifest)
    assert [r.name for r in current if r.reference] == [flushed]


def test_slurm_array_script(tmp_path):
    spec = small_spec(nproc=8, nnodes=2, recompute=(None,), timeout_s=3700)
    references, expansion = reference_points(spec, expand(spec)), expand(spec)
    script = slurm_script(spec, references, expansion.points, tmp_path, "ablate", "collect")
    points = [*references, *expansion.points]
    assert "one per layout (index 0: the single-process reference)" in script
    assert f"#SBATCH --array=0-{len(points) - 1}" in script
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --time=01:02:00" in script
    assert f"0) NAME={points[0].name} NNODES=1 NPROC=1" in script
    assert f"1) NAME={points[1].name} NNODES=2 NPROC=8" in script
    assert "srun --kill-on-bad-exit=1" in script
    assert 'torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC"' in script
    assert "--rdzv-backend c10d" in script and '"${FLAGS[@]}"' in script
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in script
    assert f"--profile-iteration {spec.profiled_iteration}" in script
    spec = async_spec(recompute=(None,))
    references, points = reference_points(spec, expand(spec)), expand(spec).points
    script = slurm_script(spec, references, points, tmp_path, "ablate", "collect")
    assert "(indices 0-1: the single-process references)" in script
    assert f"1) NAME={references[1].name} NNODES=1 NPROC=1" in script


def test_command_line_dry_run_and_slurm(tmp_path, capsys):
    flags = ["--out", str(tmp_path), "--model-flags", " ".join(MODEL), "--nproc", "4"]
    flags += ["--global-batch-size", "8", "--tp", "1", "2", "--micro-batch-size", "2"]
    flags += ["--sequence-parallel", "off", "on"]
    assert ablate.main([*flags, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("$ python tools/ablate.py --out")
    assert "run   tp2.pp1.dp2.v1.mb2.default.sp.norecompute.z0" in out
    assert "sequence parallelism needs tp > 1" in out
    context = ["--cp", "1", "2", "--cp-comm-type", "all_gather"]
    assert ablate.main([*flags, *context, "--dry-run"]) == 0
    assert "run   tp2.cp2-all_gather.pp1.dp1.v1.mb2.default.sp.norecompute.z0" in (
        capsys.readouterr().out
    )
    assert ablate.main([*flags, "--slurm"]) == 0
    assert "#SBATCH --array=0-3" in (tmp_path / "sweep.sbatch").read_text()
    manifest = json.loads((tmp_path / "sweep.json").read_text())
    assert len(manifest["points"]) == 3 and len(manifest["dropped"]) == 1
    assert ablate.main([*flags, "--slurm", "--repeats", "2"]) == 2
    assert "--repeats runs here only" in capsys.readouterr().out


@pytest.mark.slow  # draws every plot of the report
def test_report_from_synthetic_records(tmp_path):
    spec = small_spec(recompute=(None,))
    wrong = "tp1.pp2.dp2.v1.mb2.default.norecompute.z0"
    failed = "tp2.pp2.dp1.v1.mb2.default.norecompute.z0"
    launcher = FakeLauncher(
        losses_of=lambda name: [x + 0.01 for x in LOSSES] if name == wrong else LOSSES,
        fail={failed},
    )
    sweep = tmp_path / "sweep"
    run_sweep(spec, sweep, launcher=launcher, command_line="python tools/ablate.py X")
    # a point of an earlier spec in the same directory is not part of this report
    stale = records.load(sweep / "points" / f"{wrong}.json")
    stale.name, stale.reference = "tp4.stale", True
    records.save(stale, sweep / "points" / "tp4.stale.json")
    status = ablation_report.main([str(sweep), "--out", str(tmp_path / "report")])
    assert status == 1  # a layout deviates
    text = (tmp_path / "report" / "report.md").read_text()
    assert text.index("PARITY ALARM") < text.index("## Layouts")
    assert f"`{wrong}`: max relative difference" in text
    assert "from the sweep `python tools/ablate.py X`" in text and "tp4.stale" not in text
    row = next(line for line in text.splitlines() if line.startswith(f"| `{wrong}`"))
    # 100 ms per iteration, 8 × 32 tokens; peaks 1000 + 100 r bytes; comm 0.03 s on rank 3
    assert "| ok | 100.0 | 2560 | 0.0 / 0.0 | " in row and "| 0.25 | 30.0 |" in row
    assert "| schedule | None |" in text and "world size 4 (1 node(s) × 4)" in text
    assert "**FAIL** (" in row
    assert "error: rank 3 ran out of luck" in text and f"**`{failed}`** (failed" in text
    for png in ("throughput", "memory", "loss", "timelines"):
        assert (tmp_path / "report" / f"{png}.png").stat().st_size > 1000
        assert f"]({png}.png)" in text


def test_report_needs_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert ablation_report.main([str(tmp_path)]) == 2
    assert "error: the plots need matplotlib: pip install matplotlib" in capsys.readouterr().out


@pytest.mark.slow
def test_real_sweep_of_two_layouts_on_two_processes(tmp_path, corpus):
    """torchrun end to end: the reference and two layouts of two processes train the same
    model, with a profile, and the report draws them."""
    spec = SweepSpec(
        model_flags=MODEL,
        data_flags=("--data-path", str(corpus / "stdlib")),
        global_batch_size=4,
        train_iters=3,
        nproc=2,
        timeout_s=120,
        tp=(1, 2),
        micro_batch_size=(2,),
    )
    result = run_sweep(spec, tmp_path / "sweep")
    assert [r.world_size for r in result.records] == [1, 2, 2]
    for record in result.records:
        assert record.status == records.OK, record.error
        assert len(record.measured.losses) == 3 and record.parity.status == PASS
        assert record.measured.iteration_seconds > 0 and record.measured.peak_per_stage()[0] > 0
    assert ablation_report.main([str(tmp_path / "sweep")]) == 0
    text = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "Parity: 2 of 2 finished layouts equal the single-process run" in text
    print("wall seconds per point:", [round(r.wall_seconds, 1) for r in result.records])


def test_collect_turns_slurm_runs_into_records(tmp_path, capsys):
    flags = ["--out", str(tmp_path), "--model-flags", " ".join(MODEL), "--nproc", "4"]
    flags += ["--global-batch-size", "8", "--tp", "1", "2", "--micro-batch-size", "2"]
    flags += ["--train-iters", str(len(LOSSES))]
    assert ablate.main([*flags, "--slurm"]) == 0
    names = json.loads((tmp_path / "sweep.json").read_text())["points"]
    reference = "tp1.pp1.dp1.v1.mb2.default.norecompute.z0"
    write_metrics(tmp_path / "runs" / reference / "metrics.jsonl", LOSSES, world=1)
    write_metrics(tmp_path / "runs" / names[0] / "metrics.jsonl", LOSSES, world=4)
    assert ablate.main([*flags, "--collect"]) == 0
    collected = {r.name: r for r in records.load_all(tmp_path / "points")}
    assert collected[names[0]].status == records.OK
    assert collected[names[0]].parity.status == PASS
    assert collected[names[1]].status == records.FAILED  # its array job wrote nothing
    assert "not run" in collected[names[1]].error


def test_the_memory_check_reads_a_layout_as_data():
    """``--layout`` takes ``Layout(...)`` or bare ``name=value`` pairs; anything else, code
    included, is refused with the pair that is wrong and nothing is run."""
    assert parse_layout("Layout(tp=2, pp=2, dp=2)") == Layout(tp=2, pp=2, dp=2)
    text = "tp=2, dp=4, sequence_parallel=true, recompute=selective, schedule='zb-v'"
    assert parse_layout(text) == Layout(
        tp=2, dp=4, sequence_parallel=True, recompute="selective", schedule="zb-v"
    )
    assert parse_layout("pp=2, recompute=None").recompute is None
    assert parse_layout("tp=2, ep=2, etp=1") == Layout(tp=2, ep=2, etp=1)
    assert parse_layout("etp=None").etp is None
    assert parse_layout("dp=2, embedding_in_split=true").embedding_in_split
    refused = {
        "tp=two": "tp is an integer, got 'two'",
        "tensor=2": "'tensor=2' in 'tensor=2' is not name=value with a Layout field",
        "__import__('os').system('true')": "is not name=value with a Layout field",
        "tp=2, sequence_parallel=maybe": "sequence_parallel is true or false, got 'maybe'",
        "sequence_parallel=true": "sequence parallelism needs tp > 1",
    }
    for text, message in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_layout(text)
