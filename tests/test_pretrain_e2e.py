"""pretrain_gpt.py end to end: 4 ranks (tp 2 × pp 2) train, evaluate, save; a second run
resumes from the middle checkpoint and continues with exactly the losses of the
uninterrupted run; bad settings, bad data and a hostile or corrupt checkpoint stop the job
with one clear error line.

The runs are pretrain_gpt.py's ``main`` on the ranks of a reused gloo world
(:mod:`megapp.testing.pretrain_world`): every rank of a bad start meets the same error
there and the first to report says it. Under torchrun (marked slow, but for the timeout
too short for start-up, which only a launch reaches) the same bad starts also show that
the launch prints that one line and no worker traceback.

Dropout stays on (Megatron's 0.1), so exact equality also needs the RNG streams restored
and nothing outside the iterations drawing from them. Everything runs in fp32 on CPU with
the same reduction order in both runs, so the comparison is bitwise.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from megapp.data import IndexedDatasetBuilder
from megapp.testing.pretrain_world import run_pretrain_in_world
from megapp.training.launch import REPOSITORY, finish, start_pretrain
from megapp.training.metrics import read_records
from tests.support import dotted_system_payload

ITERS, SAVE_AT, PROFILE_AT = 6, 3, 4
MODEL = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 2 "
    "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --lr-decay-style cosine --split 80,10,10 "
    f"--train-iters {ITERS} --log-interval 1 --eval-interval {SAVE_AT} --eval-iters 2"
).split()


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory):
    """The uninterrupted run: trains ITERS iterations and saves after SAVE_AT and at the end."""
    root = tmp_path_factory.mktemp("full_run")
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(root / "cache")]
    full = run_pretrain_in_world(
        4,
        [
            *MODEL,
            *data,
            *("--save", str(root / "checkpoints"), "--save-interval", str(SAVE_AT)),
            *("--metrics-path", str(root / "full.jsonl")),
            *("--profile-iteration", str(PROFILE_AT)),
        ],
        cwd=root,
    )
    assert full.returncode == 0, full.stderr[-4000:]
    return root, full


@pytest.fixture(scope="module")
def resumed_run(corpus, full_run, tmp_path_factory):
    """The run resumed from the full run's middle checkpoint: its directory and outcome."""
    root, _ = full_run
    resumed_dir = tmp_path_factory.mktemp("resumed")
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(resumed_dir / "cache")]
    resumed = run_pretrain_in_world(
        4,
        [
            *MODEL,
            *data,
            *("--load", str(root / "checkpoints"), "--ckpt-step", str(SAVE_AT)),
            *("--save", str(resumed_dir / "resumed")),
            *("--metrics-path", str(resumed_dir / "resumed.jsonl")),
        ],
        cwd=resumed_dir,
    )
    return resumed_dir, resumed


@pytest.mark.slow  # two pretrain_gpt.py jobs; a resume stays fast in test_checkpoint
def test_train_save_resume_continues_exactly(full_run, resumed_run):
    root, full = full_run
    resumed_dir, resumed = resumed_run
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    full_records = read_records(root / "full.jsonl")
    resumed_records = read_records(resumed_dir / "resumed.jsonl")
    train = {r["iteration"]: r for r in full_records if r["kind"] == "train"}
    assert sorted(train) == list(range(1, ITERS + 1))
    assert [train[i]["consumed_samples"] for i in train] == [8 * i for i in train]
    losses = [train[i]["lm_loss"] for i in sorted(train)]
    assert losses[-1] < losses[0] - 0.3, losses  # it learns
    saved = [r["iteration"] for r in full_records if r["kind"] == "checkpoint"]
    assert saved == [SAVE_AT, ITERS]

    # The resumed run starts after the checkpoint and repeats the rest bit for bit:
    # training losses, gradient norms, learning rates, and every evaluation after it.
    assert resumed_records[0] == {**resumed_records[0], "kind": "run", "iteration": SAVE_AT}
    again = [r for r in resumed_records if r["kind"] in ("train", "eval")]
    tail = [r for r in full_records if r["kind"] in ("train", "eval") and r["iteration"] > SAVE_AT]
    keys = ("kind", "iteration", "consumed_samples", "lm_loss", "grad_norm", "learning_rate")
    assert [{k: r.get(k) for k in keys} for r in again] == [
        {k: r.get(k) for k in keys} for r in tail
    ]
    assert [r["split"] for r in again if r["kind"] == "eval"] == ["valid", "valid", "test"]

    # The profiled iterations (after the checkpoint) changed no loss: the resumed run,
    # unprofiled, repeated them bit for bit above.
    (profile,) = [r for r in full_records if r["kind"] == "profile"]
    assert profile["iteration"] == PROFILE_AT and 0 < profile["bubble"] < 1
    assert [(r["rank"], r["tp"], r["pp"]) for r in profile["ranks"]] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]
    for rank in profile["ranks"]:
        assert 0 < rank["state_bytes"] < rank["peak_bytes"]
        assert rank["comm_seconds"] > 0  # tensor-parallel all-reduces
        assert 0 < rank["message_cpu_seconds"] < rank["cpu_seconds"]  # pipeline messages
        names = [e[1] for e in rank["events"] if e[0] == "compute"]
        assert sorted(names) == sorted(f"{op}{m}" for op in "FB" for m in range(4))
    assert [train[i].get("profiled", False) for i in train] == [i == PROFILE_AT + 1 for i in train]

    # The last rank printed Megatron's line for every iteration and the evaluations.
    assert f" iteration {ITERS:8d}/{ITERS:8d} | consumed samples: {8 * ITERS:12d} |" in full.stdout
    assert f" validation loss at iteration {SAVE_AT} | lm loss value: " in full.stdout
    assert f"lm loss: {train[ITERS]['lm_loss']:.6E} |" in full.stdout
    assert "loaded checkpoint" in resumed.stdout


# --- bad starts: one error line ---------------------------------------------------------------

Case = tuple[int, list[str], str]  # (processes, flags, what the error line starts with)
Outcome = tuple[int, str]  # (exit status, stderr)


def _launch_side_by_side(cases: dict[str, Case], cwd: Path) -> dict[str, Outcome]:
    """Launch every case under torchrun at once; each one's exit status and stderr."""
    running = {name: start_pretrain(n, flags, cwd=cwd) for name, (n, flags, _) in cases.items()}
    outcomes = {}
    for name, process in running.items():
        done = finish(process, timeout_s=300)
        assert not done.timed_out, f"{name}: still running after 300 s:\n{done.stderr[-3000:]}"
        outcomes[name] = (done.returncode, done.stderr)
    return outcomes


def _run_in_world(cases: dict[str, Case], cwd: Path) -> dict[str, Outcome]:
    """Run every case in the reused world, one after the other."""
    outcomes = {}
    for name, (n, flags, _) in cases.items():
        done = run_pretrain_in_world(n, flags, cwd=cwd)
        outcomes[name] = (done.returncode, done.stderr)
    return outcomes


FRAME = re.compile(r'File "([^"]+)", line \d+')


def worker_traceback(stderr: str) -> str | None:
    """The first sign of a traceback from a worker in a launch's stderr, or None: a frame
    in this repository's files, or a traceback other than torchrun's own report that a
    worker failed (which ends in ChildFailedError and names only torch's files)."""
    for match in FRAME.finditer(stderr):
        path = Path(match.group(1))  # "<frozen runpy>" and the like are no files
        if path.is_absolute() and path.resolve().is_relative_to(REPOSITORY):
            return match.group(0)
    tracebacks = stderr.count("Traceback (most recent call last)")
    if tracebacks > stderr.count("errors.ChildFailedError"):
        return f"{tracebacks} tracebacks"
    return None


def _check_side_by_side(cases: dict[str, Case], outcomes: dict[str, Outcome]) -> None:
    """Every case exited nonzero with exactly one ``error:`` line, its ``message``, and
    no worker traceback."""
    for name, (returncode, stderr) in outcomes.items():
        message = cases[name][2]
        assert returncode != 0, f"{name}: exited 0"
        errors = [line for line in stderr.splitlines() if "pretrain_gpt.py: error:" in line]
        assert len(errors) == 1, f"{name}: {len(errors)} error lines:\n{stderr[-3000:]}"
        assert errors[0].startswith(f"pretrain_gpt.py: error: {message}"), (
            f"{name}: {message!r} does not start the error line:\n{errors[0]}"
        )
        assert worker_traceback(stderr) is None, (
            f"{name}: a worker printed a traceback ({worker_traceback(stderr)}):\n{stderr[-3000:]}"
        )


SMALL = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 32 --num-attention-heads 2 "
    "--seq-length 16 --micro-batch-size 2 --lr 1e-3 --train-iters 2"
)


BAD_DATA = ("missing", "corrupt", "token ids", "flag", "load typo")
TIMEOUT = "timeout too short"  # only a launch waits for ranks to join


def _bad_start_cases(corpus: Path, tmp_path: Path) -> dict[str, Case]:
    """Bad settings and data, outputs that cannot be written, a model larger than the
    memory, a timeout shorter than start-up: each case's ``(nproc, flags, message)``."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus / f"stdlib{suffix}", broken / f"stdlib{suffix}")
    idx = broken / "stdlib.idx"
    idx.write_bytes(idx.read_bytes()[:-8])  # a truncated index
    # ids of another tokenizer: one document reaches 3999, past the byte tokenizer's 257
    builder = IndexedDatasetBuilder(str(tmp_path / "other.bin"), dtype=np.uint16)
    for doc in range(200):
        tokens = np.arange(200) % 250
        tokens[17] = 3999 if doc == 10 else tokens[17]
        builder.add_document(tokens)
    builder.finalize(str(tmp_path / "other.idx"))
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "a_directory").mkdir()
    small = SMALL.split()
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    good = [*small, "--data-path", str(corpus / "stdlib"), *cache]
    return {
        "missing": (
            2,
            [*small, "--data-path", str(tmp_path / "nowhere"), *cache],
            f"--data-path {tmp_path / 'nowhere'}: {tmp_path / 'nowhere'}.bin / ",
        ),
        "corrupt": (
            2,
            [*small, "--data-path", str(broken / "stdlib"), *cache],
            f"--data-path: {idx}: header says",
        ),
        "token ids": (
            2,
            [*small, "--data-path", str(tmp_path / "other"), *cache],
            f"--data-path: {tmp_path / 'other.bin'}: its largest token id is 3999, outside the "
            "tokenizer's vocabulary of 257",
        ),
        "flag": (
            2,
            [*small, "--hidden-size", "wide", "--use-default-corpus"],
            "argument --hidden-size: invalid int value: 'wide' (see pretrain_gpt.py --help)",
        ),
        "load typo": (
            2,
            [*small, "--use-default-corpus", *cache, "--load", str(tmp_path / "chekpoints")],
            f"--load {tmp_path / 'chekpoints'}: the directory does not exist",
        ),
        "save in /proc": (
            2,
            [*good, "--save", "/proc/nope"],
            "--save /proc/nope: cannot create it in /proc (",
        ),
        "save names a file": (
            2,
            [*good, "--save", str(tmp_path / "a_file")],
            f"--save {tmp_path / 'a_file'}: is a file; --save names a directory",
        ),
        "metrics names a directory": (
            2,
            [*good, "--metrics-path", str(tmp_path / "a_directory")],
            f"--metrics-path {tmp_path / 'a_directory'}: is a directory; --metrics-path names "
            "a file",
        ),
        "model too large": (
            2,
            [*good, "--hidden-size", "65536", "--num-layers", "48"],
            "the model does not fit in memory: 2 ranks' weights, gradients and optimizer "
            "states need 36",
        ),
        TIMEOUT: (
            2,
            # 6 ms: shorter than any start-up wait (the ranks' arrival, rank 0's indexes),
            # however fast the machine (at 60 ms a fast one once started the job in time)
            [*good, "--distributed-timeout-minutes", "0.0001"],
            "--distributed-timeout-minutes 0.0001 (0.006 s) is too short for start-up: rank ",
        ),
    }


@pytest.fixture(scope="module")
def bad_start_cases(corpus, tmp_path_factory) -> tuple[dict[str, Case], Path]:
    tmp_path = tmp_path_factory.mktemp("bad_starts")
    return _bad_start_cases(corpus, tmp_path), tmp_path


@pytest.fixture(scope="module")
def bad_starts(bad_start_cases):
    """Every case but the timeout run in the world: the cases and each one's outcome."""
    cases, cwd = bad_start_cases
    in_world = {name: case for name, case in cases.items() if name != TIMEOUT}
    return cases, _run_in_world(in_world, cwd)


def _check_case(bad_starts, *names: str) -> None:
    cases, outcomes = bad_starts
    _check_side_by_side({n: cases[n] for n in names}, {n: outcomes[n] for n in names})


def test_bad_settings_and_data_fail_with_one_clear_error(bad_starts):
    """Each exits nonzero with one line naming the problem, before any training."""
    _check_case(bad_starts, *BAD_DATA)


def test_a_save_directory_that_cannot_be_made_fails_at_start(bad_starts):
    _check_case(bad_starts, "save in /proc")


def test_a_save_directory_that_is_a_file_fails_at_start(bad_starts):
    _check_case(bad_starts, "save names a file")


def test_a_metrics_file_that_is_a_directory_fails_at_start(bad_starts):
    _check_case(bad_starts, "metrics names a directory")


def test_a_model_larger_than_the_memory_fails_at_start(bad_starts):
    """Its weights, gradients and Adam states are counted before anything is allocated."""
    _check_case(bad_starts, "model too large")
    _, outcomes = bad_starts
    line = next(x for x in outcomes["model too large"][1].splitlines() if "error:" in x)
    assert re.search(r"need 3\d{4}\.\d GiB but this machine has \d+\.\d GiB free", line), line


@pytest.mark.slow  # a torchrun job
def test_a_timeout_shorter_than_start_up_says_which_flag_to_raise(bad_start_cases):
    """Under torchrun: the ranks wait for each other to join, and give up naming the flag."""
    cases, cwd = bad_start_cases
    outcomes = _launch_side_by_side({TIMEOUT: cases[TIMEOUT]}, cwd)
    _check_side_by_side({TIMEOUT: cases[TIMEOUT]}, outcomes)
    assert "raise --distributed-timeout-minutes" in outcomes[TIMEOUT][1]


UNDER_TORCHRUN = ("flag", "corrupt", "load typo", "save names a file", "model too large")
"""One bad start per place start-up fails (the arguments, rank 0's look at the data, a path
to read, a path to write, the memory check): each case of one place leaves the same way,
and every case's line is checked in the world above."""


@pytest.mark.slow
def test_under_torchrun_a_bad_start_is_one_line_and_no_traceback(bad_start_cases):
    """The launches of the cases above, side by side: torchrun stops the other workers
    once the first has reported; what the job prints is that one line."""
    cases, cwd = bad_start_cases
    assert set(UNDER_TORCHRUN) <= set(cases)
    launched = {name: cases[name] for name in UNDER_TORCHRUN}
    _check_side_by_side(launched, _launch_side_by_side(launched, cwd))


def _broken_checkpoint_cases(checkpoints: Path, corpus: Path, tmp_path: Path):
    """Cases loading two copies of ``checkpoints``: one whose .metadata file would run a
    command, one with a truncated tensor shard; and the file the command writes."""
    marker = tmp_path / "ran"
    hostile, truncated = tmp_path / "hostile", tmp_path / "truncated"
    for copy in (hostile, truncated):
        shutil.copytree(checkpoints, copy)
    step = f"iter_{SAVE_AT:07d}"
    (hostile / step / ".metadata").write_bytes(dotted_system_payload(marker, protocol=4))
    shard = truncated / step / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    data = ["--data-path", str(corpus / "stdlib"), "--data-cache-path", str(tmp_path / "cache")]
    load = ("--ckpt-step", str(SAVE_AT), "--load")
    cases = {
        "hostile": (
            4,
            [*MODEL, *data, *load, str(hostile)],
            f"--load {hostile}: {hostile / step / '.metadata'}: names the dotted global "
            "torch.distributed.checkpoint.metadata.os.system",
        ),
        "truncated": (
            4,
            [*MODEL, *data, *load, str(truncated)],
            f"--load {truncated}: {shard}: truncated (1000 bytes; ",
        ),
    }
    return cases, marker


@pytest.fixture(scope="module")
def broken_checkpoints(corpus, full_run, tmp_path_factory):
    root, _ = full_run
    cwd = tmp_path_factory.mktemp("broken_checkpoints")
    cases, marker = _broken_checkpoint_cases(root / "checkpoints", corpus, cwd)
    return cases, marker, cwd


@pytest.mark.slow  # needs the full run's checkpoint; test_checkpoint_safety stays fast
def test_a_hostile_or_corrupt_checkpoint_ends_the_job_with_one_error(broken_checkpoints):
    """A .metadata file that would run a command, and a truncated tensor shard: the job
    stops before training with one line naming the file, and the command never ran."""
    cases, marker, cwd = broken_checkpoints
    _check_side_by_side(cases, _run_in_world(cases, cwd))
    assert not marker.exists()


@pytest.mark.slow
def test_under_torchrun_a_hostile_or_corrupt_checkpoint_is_one_line(broken_checkpoints):
    cases, marker, cwd = broken_checkpoints
    _check_side_by_side(cases, _launch_side_by_side(cases, cwd))
    assert not marker.exists()
