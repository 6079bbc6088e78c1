"""What a sweep keeps per point: one JSON file with the layout, the measured figures read
from the point's metrics file, the prediction for the same layout and the parity verdict.

:func:`measure` turns a ``pretrain_gpt.py`` metrics file (``--log-interval 1``,
``--profile-iteration N``) into :class:`Measured`; :class:`PointRecord` is the file a sweep
writes and the report reads.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from megapp.training.iteration_profile import plain_iteration_seconds
from megapp.training.metrics import read_records

OK, FAILED, TIMEOUT = "ok", "failed", "timeout"


@dataclass
class RankMeasure:
    """One rank's profiled iteration: its coordinates, the peak live tensor bytes, the
    bytes live before the iteration (weights, gradients, optimizer state), the seconds it
    was blocked in collectives, and its pipeline timeline ``[kind, name, start, end]``."""

    rank: int
    tp: int
    pp: int
    dp: int
    peak_bytes: int
    state_bytes: int
    comm_seconds: float
    events: list[list] = field(default_factory=list)


@dataclass
class Measured:
    """The figures of one run. ``losses[i]``: the loss of iteration ``i + 1``.
    ``iteration_seconds``: the median iteration time after the first, leaving out the two
    profiled iterations (of a point launched several times: its fastest launch's, each
    one's in ``launch_seconds``; the machine's slow spells only ever add time).
    ``tokens_per_second``: the whole job's (global batch × sequence length over that
    time). ``bubble``: the idle share of the profiled pipeline
    timeline."""

    losses: list[float] = field(default_factory=list)
    iteration_seconds: float | None = None
    tokens_per_second: float | None = None
    bubble: float | None = None
    profile_seconds: float | None = None
    ranks: list[RankMeasure] = field(default_factory=list)
    launch_seconds: list[float] = field(default_factory=list)

    def add_launch(self, seconds: float) -> None:
        """Count one more launch's iteration time; the time becomes the fastest launch's."""
        if self.iteration_seconds is not None and self.tokens_per_second is not None:
            tokens = self.tokens_per_second * self.iteration_seconds
        else:
            tokens = None
        self.launch_seconds.append(seconds)
        self.iteration_seconds = min(self.launch_seconds)
        if tokens is not None:
            self.tokens_per_second = tokens / self.iteration_seconds

    def peak_per_stage(self) -> list[int]:
        """The largest peak of each pipeline rank (over its tensor and data-parallel peers)."""
        stages = sorted({r.pp for r in self.ranks})
        return [max(r.peak_bytes for r in self.ranks if r.pp == s) for s in stages]

    def state_per_stage(self) -> list[int]:
        """The largest bytes live before the iteration of each pipeline rank."""
        stages = sorted({r.pp for r in self.ranks})
        return [max(r.state_bytes for r in self.ranks if r.pp == s) for s in stages]

    @property
    def comm_seconds(self) -> float | None:
        """The longest any rank was blocked in collectives during the profiled iteration."""
        return max((r.comm_seconds for r in self.ranks), default=None)

    @property
    def peak_bytes(self) -> int | None:
        return max((r.peak_bytes for r in self.ranks), default=None)


@dataclass
class Prediction:
    """The planner's figures for the same layout: bytes per pipeline rank, seconds per
    iteration and bubble share (None where the predictor is not there). ``breakdown``:
    :func:`megapp.planning.explain.explanation_rows` by key (the step's lines in seconds,
    ``step.<line>``, which add up to the step, and the worst rank's memory lines in bytes,
    ``memory.<line>``; None in a record written before it or predicted without a time
    profile); ``step_rank``: the pipeline rank whose step it splits (the one that finishes
    last), ``memory_rank``: the one whose memory it splits (the worst)."""

    memory_per_stage: list[float] | None = None
    iteration_seconds: float | None = None
    bubble: float | None = None
    note: str | None = None
    breakdown: dict[str, float | None] | None = None
    step_rank: int | None = None
    memory_rank: int | None = None


@dataclass
class Parity:
    """The point's losses against the single-process reference of its update rule, named
    by ``reference``: ``status`` is ``pass``, ``FAIL``, ``unknown`` (no losses to compare)
    or ``n/a`` (PipeDream: no single-process run trains under its rule); the largest
    relative difference and the first iteration past the tolerance."""

    status: str
    max_rel_diff: float | None = None
    first_bad_iteration: int | None = None
    tolerance: float | None = None
    reference: str | None = None


@dataclass
class PointRecord:
    """Everything the sweep knows about one point (saved as ``points/<name>.json``).
    ``dense_twin``: the point ran the dense twin of a mixture-of-experts model; ``twin``:
    the name of a mixture-of-experts point's dense twin."""

    name: str
    key: str
    layout: dict[str, Any]
    world_size: int
    command: list[str]
    status: str
    wall_seconds: float | None = None
    error: str | None = None
    log: str | None = None
    reference: bool = False
    measured: Measured = field(default_factory=Measured)
    predicted: Prediction = field(default_factory=Prediction)
    parity: Parity | None = None
    dense_twin: bool = False
    twin: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> PointRecord:
        raw = json.loads(text)
        measured = raw.pop("measured", {}) or {}
        ranks = [RankMeasure(**r) for r in measured.pop("ranks", [])]
        predicted = Prediction(**(raw.pop("predicted", {}) or {}))
        parity = raw.pop("parity", None)
        if "launch_seconds" not in measured and measured.get("iteration_seconds") is not None:
            measured["launch_seconds"] = [measured["iteration_seconds"]]  # a one-launch record
        known = {f.name for f in fields(cls)}
        return cls(
            **{k: v for k, v in raw.items() if k in known},
            measured=Measured(**measured, ranks=ranks),
            predicted=predicted,
            parity=Parity(**parity) if parity else None,
        )


def save(record: PointRecord, path: str | Path) -> None:
    """Write ``record`` atomically: a crash mid-write leaves the old file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(record.to_json())
    os.replace(partial, path)


def load(path: str | Path) -> PointRecord:
    return PointRecord.from_json(Path(path).read_text())


def load_all(directory: str | Path) -> list[PointRecord]:
    """Every record under ``directory`` (a sweep's ``points/``), by name."""
    paths = sorted(Path(directory).glob("*.json"))
    return [load(p) for p in paths]


def measure(path: str | Path, profile_iteration: int | None) -> Measured:
    """The figures of the run that wrote the metrics file ``path``. Only the last launch in
    the file counts (a file appended to by an earlier attempt starts over at its ``run``);
    a file that is not metrics records raises ValueError."""
    records = read_records(path, last_run=True)
    train = [r for r in records if r.get("kind") == "train"]
    profile = next((r for r in records if r.get("kind") == "profile"), None)
    out = Measured(losses=[r["lm_loss"] for r in sorted(train, key=lambda r: r["iteration"])])
    steady = plain_iteration_seconds(train, profile_iteration)
    if steady:
        out.iteration_seconds = statistics.median(steady)
        out.launch_seconds = [out.iteration_seconds]
        tokens = train[-1]["global_batch_size"] * _seq_length(records)
        out.tokens_per_second = tokens / out.iteration_seconds
    if profile is not None:
        out.bubble = profile.get("bubble")
        out.profile_seconds = profile.get("seconds")
        keys = {f.name for f in fields(RankMeasure)}
        out.ranks = [
            RankMeasure(**{k: v for k, v in r.items() if k in keys}) for r in profile["ranks"]
        ]
    return out


def _seq_length(records: list[dict[str, Any]]) -> int:
    run = next(r for r in records if r.get("kind") == "run")
    return int(run["config"]["model"]["seq_length"])
