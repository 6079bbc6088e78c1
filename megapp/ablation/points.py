"""The points of an ablation sweep: a spec (TOML file or flags) expanded into layouts.

A :class:`SweepSpec` names the model, the data, the run (global batch, iterations,
processes) and a list of values per layout field; :func:`expand` takes their cross product
and checks every point with :func:`megapp.planning.layout.pretrain_config`, the same check
``pretrain_gpt.py`` runs at start-up, so a refused point is dropped with the message the
job would have printed instead of costing a launch. :func:`update_rule` says which update
rule a schedule trains under, and :func:`reference_layouts` the single-process runs the
points are compared with, one per rule that has one. A model with experts also gets its
dense twin (:mod:`megapp.ablation.twins`) under each layout its points use, with ep 1:
points of their own, run once per distinct layout, that the report divides the
mixture-of-experts points' tokens/s by.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from megapp.ablation.twins import DenseTwin, dense_twin
from megapp.planning.layout import CP_COMM_TYPES, PIPEDREAM_VSYNC, Layout, pretrain_config
from megapp.training.config import PretrainConfig
from megapp.training.flag_groups import ModelArgs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
"""Every point runs without dropout, so that its losses equal the single-process run's
(and context parallelism, which refuses attention dropout, runs): the job's and the
check's flags end with these."""

DEFAULT_RUN_FLAGS = ("--lr", "1e-3", "--eval-iters", "0")
"""Run flags a spec gets unless it gives its own ``run_flags``: a constant learning rate
(no warmup to fit into a few iterations) and no evaluation."""


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep runs. Every list field is one axis of the cross product.

    ``model_flags``: the model's ``pretrain_gpt.py`` flags (``--num-layers``, ...); a
    ``model`` preset of :mod:`megapp.planning.models` (or a file of flags) puts its flags
    first.
    ``data_flags``: where the tokens come from. ``run_flags``: any other flags every point
    shares (learning rate, precision, ...). ``nproc`` × ``nnodes`` is the world size of
    every layout point (data parallel takes what tp × pp leave). ``profile_iteration``:
    the iteration whose timeline and communication are recorded, its memory in the next
    (None: two before the last). ``timeout_s``: a point running longer is stopped and
    recorded as failed. ``hardware``: a :func:`megapp.planning.hardware.load_hardware`
    profile (name or JSON file) for the predicted step time (None: no time prediction).
    ``repeats``: launches per point, in rounds over all points (so a machine that slows
    for a while slows every point alike); a point's time is the median of its launches'.
    ``cp`` and ``cp_comm_type``: context-parallel sizes and their communication (one point
    per size at cp 1, whatever the communication). ``ep``: expert-parallel sizes (a model
    with ``--num-experts``; expert tensor parallelism is tp's).
    """

    model_flags: tuple[str, ...]
    model: str | None = None
    data_flags: tuple[str, ...] = ("--use-default-corpus",)
    run_flags: tuple[str, ...] = DEFAULT_RUN_FLAGS
    global_batch_size: int = 32
    train_iters: int = 8
    nproc: int = 8
    nnodes: int = 1
    seed: int = 1234
    timeout_s: float = 600.0
    profile_iteration: int | None = None
    hardware: str | None = None
    repeats: int = 1
    tp: tuple[int, ...] = (1,)
    pp: tuple[int, ...] = (1,)
    vpp: tuple[int, ...] = (1,)
    schedule: tuple[str | None, ...] = (None,)
    micro_batch_size: tuple[int, ...] = (1,)
    recompute: tuple[str | None, ...] = (None,)
    zero_stage: tuple[int, ...] = (0,)
    sequence_parallel: tuple[bool, ...] = (False,)
    cp: tuple[int, ...] = (1,)
    cp_comm_type: tuple[str, ...] = ("p2p",)
    ep: tuple[int, ...] = (1,)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def num_layers(self) -> int:
        flags = list(self.model_flags)
        for i, flag in enumerate(flags):
            if flag == "--num-layers" and i + 1 < len(flags):
                return int(flags[i + 1])
            if flag.startswith("--num-layers="):
                return int(flag.split("=", 1)[1])
        raise ValueError("the model flags must give --num-layers")

    @property
    def profiled_iteration(self) -> int:
        """The iteration whose timeline the profile records: late, so warm-up is over, and
        not the last, as the profile measures memory in the iteration after it."""
        if self.profile_iteration is not None:
            return self.profile_iteration
        return max(1, self.train_iters - 2)

    def common_flags(self) -> list[str]:
        """The flags every point of the sweep shares (the reference included): model, data,
        run settings, batch, iterations, seed, dropout off and a loss every iteration."""
        return [
            *self.model_flags,
            *self.data_flags,
            *self.run_flags,
            *("--global-batch-size", str(self.global_batch_size)),
            *("--train-iters", str(self.train_iters)),
            *("--seed", str(self.seed)),
            *NO_DROPOUT,
            *("--log-interval", "1"),
        ]


@dataclass(frozen=True)
class Point:
    """One layout of the sweep and the flags that run it. ``key`` identifies a finished
    run: the same key means the same command, so its record can be reused.
    ``dense_twin``: the point runs the dense twin of the sweep's model (named
    ``dense-<layout>``); ``twin``: the name of a mixture-of-experts point's dense twin."""

    layout: Layout
    flags: tuple[str, ...]
    world_size: int
    dense_twin: bool = False
    twin: str | None = None

    @property
    def name(self) -> str:
        return f"dense-{self.layout.name}" if self.dense_twin else self.layout.name

    @property
    def key(self) -> str:
        text = "\0".join([str(self.world_size), *self.flags])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Dropped:
    """A point of the cross product that cannot run, and why (the job's own message)."""

    layout: Layout | None
    description: str
    reason: str


@dataclass
class Expansion:
    """The runnable points and the dropped ones, in cross-product order; a model with
    experts has its dense ``twin`` and the twins' points follow the others."""

    points: list[Point] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    twin: DenseTwin | None = None


def point_for(spec: SweepSpec, layout: Layout) -> Point:
    """The point that runs ``layout`` under ``spec`` (no validity check)."""
    flags = (*spec.common_flags(), *layout.flags(spec.num_layers))
    return Point(layout=layout, flags=flags, world_size=layout.world_size)


FLUSHED, TWO_BW, PIPEDREAM = "flushed", "pipedream-2bw", "pipedream"
"""The update rules a schedule trains under: the flushed schedules' W(t+1) = W(t) −
lr·∇f(W(t)); PipeDream-2BW's W(t+1) = W(t) − lr·∇f(W(t−1)), the same for every layout;
PipeDream's (with or without vertical sync), whose weight versions depend on the
pipeline depth."""

UPDATE_RULES = (FLUSHED, TWO_BW, PIPEDREAM)
"""Every update rule, in the order a report lists them."""

RULE_SCHEDULES = {FLUSHED: None, TWO_BW: "pipedream-2bw"}
"""The schedule of each rule's single-process reference (None: the default); PipeDream has
none, as no single-process run trains under its rule."""


def update_rule(schedule: str | None) -> str:
    """The update rule of the schedule called ``schedule`` (a :class:`Layout`'s, None for
    the default): :data:`TWO_BW`, :data:`PIPEDREAM` or else :data:`FLUSHED`."""
    if schedule == "pipedream-2bw":
        return TWO_BW
    if schedule in ("pipedream", PIPEDREAM_VSYNC):
        return PIPEDREAM
    return FLUSHED


def reference_layout(spec: SweepSpec, rule: str = FLUSHED) -> Layout | None:
    """The single-process layout the points of ``rule`` are compared with: tp = pp = dp =
    1, the first micro-batch size of the sweep, no recompute, the rule's schedule (the
    default for the flushed ones); None for a rule without one."""
    if rule not in RULE_SCHEDULES:
        return None
    return Layout(micro_batch_size=spec.micro_batch_size[0], schedule=RULE_SCHEDULES[rule])


def reference_layouts(spec: SweepSpec, layouts: Iterable[Layout]) -> list[Layout]:
    """The references a sweep of ``layouts`` runs: the flushed one first, always, then the
    PipeDream-2BW one when a layout trains under that rule."""
    rules = {FLUSHED} | {update_rule(layout.schedule) for layout in layouts}
    return [reference_layout(spec, rule) for rule in RULE_SCHEDULES if rule in rules]


def is_reference(spec: SweepSpec, layout: Layout) -> bool:
    """Whether ``layout`` is the single-process reference of its own update rule."""
    return layout == reference_layout(spec, update_rule(layout.schedule))


def check_point(spec: SweepSpec, layout: Layout) -> PretrainConfig:
    """The config ``pretrain_gpt.py`` builds for ``layout``; raises ValueError with its
    message where the job would refuse to start."""
    flags = [*spec.model_flags, *spec.data_flags, *NO_DROPOUT]
    return pretrain_config(layout, flags, spec.global_batch_size)


def model_of(spec: SweepSpec) -> ModelArgs:
    """The model ``spec``'s flags give (as ``pretrain_gpt.py`` parses them)."""
    return check_point(spec, Layout(micro_batch_size=spec.micro_batch_size[0])).model


def twin_spec(spec: SweepSpec) -> SweepSpec:
    """``spec`` with the dense twin of its model, at ep 1; ValueError for a dense model."""
    twin = dense_twin(model_of(spec))
    model_flags = twin.model_flags(spec.model_flags)
    return dataclasses.replace(spec, model_flags=model_flags, ep=(1,))


def spec_of(spec: SweepSpec, point: Point) -> SweepSpec:
    """The spec ``point`` runs: ``spec``, or for a dense twin :func:`twin_spec`."""
    return twin_spec(spec) if point.dense_twin else spec


def add_dense_twins(spec: SweepSpec, expansion: Expansion) -> None:
    """Give every point of ``expansion`` (a model with experts) its dense twin: the twin's
    model under the point's layout at ep 1, one point per distinct layout, after the
    others. A twin layout the job refuses is dropped, and its points have no twin."""
    expansion.twin = dense_twin(model_of(spec))
    dense = twin_spec(spec)
    twins: dict[str, Point] = {}
    for i, point in enumerate(expansion.points):
        layout = dataclasses.replace(point.layout, ep=1, etp=None)
        try:
            check_point(dense, layout)
        except ValueError as error:
            reason = f"dense twin: {error}"
            expansion.dropped.append(Dropped(layout, f"dense twin of {point.name}", reason))
            continue
        twin = dataclasses.replace(point_for(dense, layout), dense_twin=True)
        twins.setdefault(twin.name, twin)
        expansion.points[i] = dataclasses.replace(point, twin=twin.name)
    expansion.points.extend(twins.values())


def expand(spec: SweepSpec) -> Expansion:
    """The cross product of ``spec``'s axes, split into runnable and dropped points."""
    out = Expansion()
    axes = itertools.product(
        spec.tp,
        spec.cp,
        spec.cp_comm_type,
        spec.pp,
        spec.vpp,
        spec.schedule,
        spec.micro_batch_size,
        spec.recompute,
        spec.zero_stage,
        spec.sequence_parallel,
        spec.ep,
    )
    seen: set[tuple] = set()
    layouts: set[Layout] = set()
    for tp, cp, comm_type, pp, vpp, schedule, mbs, recompute, zero, sp, ep in axes:
        if cp == 1:
            comm_type = CP_COMM_TYPES[0]  # no communication to vary: one point, the default
        point = (tp, cp, comm_type, pp, vpp, schedule, mbs, recompute, zero, sp, ep)
        if point in seen:
            continue
        seen.add(point)
        context = f" cp{cp} {comm_type}" if cp > 1 else ""
        context += f" ep{ep}" if ep > 1 else ""
        description = (
            f"tp{tp}{context} pp{pp} vpp{vpp} {schedule or 'default'} mb{mbs} "
            f"{recompute or 'norecompute'} z{zero}{' sp' if sp else ''}"
        )
        if spec.world_size % (tp * cp * pp):
            names = "tp × cp × pp" if cp > 1 else "tp × pp"
            reason = f"world size {spec.world_size} is not divisible by {names} = {tp * cp * pp}"
            out.dropped.append(Dropped(None, description, reason))
            continue
        try:
            layout = Layout(
                tp=tp,
                pp=pp,
                dp=spec.world_size // (tp * cp * pp),
                vpp=vpp,
                micro_batch_size=mbs,
                schedule=schedule,
                sequence_parallel=sp,
                recompute=recompute,
                zero_stage=zero,
                cp=cp,
                cp_comm_type=comm_type,
                ep=ep,
            )
        except ValueError as error:
            out.dropped.append(Dropped(None, description, str(error)))
            continue
        try:
            config = check_point(spec, layout)
        except ValueError as error:
            out.dropped.append(Dropped(layout, layout.name, str(error)))
            continue
        # a schedule that places its own chunks (the V) runs the count it needs
        runs = dataclasses.replace(layout, vpp=config.virtual_pipeline_model_parallel_size or 1)
        if runs in layouts:
            reason = f"runs as {runs.name} (the schedule's own chunk count), already a point"
            out.dropped.append(Dropped(layout, layout.name, reason))
            continue
        layouts.add(runs)
        out.points.append(point_for(spec, runs))
    if out.points and model_of(spec).num_experts is not None:
        add_dense_twins(spec, out)
    return out


_NONE_WORDS = ("none", "default", "")


def _optional(value: Any) -> Any:
    return None if isinstance(value, str) and value.lower() in _NONE_WORDS else value


def _as_tuple(name: str, value: Any) -> tuple:
    items = tuple(value) if isinstance(value, list | tuple) else (value,)
    if name in ("schedule", "recompute"):
        items = tuple(_optional(v) for v in items)
    if name in ("model_flags", "data_flags", "run_flags"):
        items = tuple(str(v) for v in items)
    return items


_INTEGERS = ("global_batch_size", "train_iters", "nproc", "nnodes", "seed", "repeats")
_INTEGERS += ("profile_iteration", "tp", "pp", "vpp", "micro_batch_size", "zero_stage", "cp")
_INTEGERS += ("ep",)
_WORDS = ("model", "hardware", "schedule", "recompute", "cp_comm_type")


def _kind_error(name: str, item: Any) -> str | None:
    """What is wrong with ``item`` as a value of setting ``name``, or None."""
    if name in _INTEGERS and (isinstance(item, bool) or not isinstance(item, int)):
        return "is not an integer"
    if name == "timeout_s" and (isinstance(item, bool) or not isinstance(item, int | float)):
        return "is not a number of seconds"
    if name in _WORDS and not isinstance(item, str):
        return "is not a string"
    if name == "sequence_parallel" and not isinstance(item, bool):
        return "is not true or false"
    return None


def check_settings(values: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first unknown setting or value of the wrong kind."""
    known = {f.name for f in fields(SweepSpec)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown sweep settings {unknown}; known: {sorted(known)}")
    for name, value in values.items():
        items = value if isinstance(value, list | tuple) else [value]
        for item in items if value is not None else []:
            wrong = _kind_error(name, item)
            if wrong is not None:
                raise ValueError(f"{name} = {value!r}: {item!r} {wrong}")
    if values.get("repeats", 1) < 1:
        raise ValueError(f"repeats must be >= 1, got {values['repeats']}")


def spec_from_mapping(values: Mapping[str, Any]) -> SweepSpec:
    """A spec from plain values (a parsed TOML table or flags): lists become tuples,
    ``"none"``/``"default"`` become None for schedules and recompute; unknown keys and
    values of the wrong kind fail (:func:`check_settings`)."""
    check_settings(values)
    known = {f.name: f for f in fields(SweepSpec)}
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        is_tuple = str(known[name].type).startswith("tuple")
        kwargs[name] = _as_tuple(name, value) if is_tuple else value
    if kwargs.get("model"):
        from megapp.planning.models import load_model

        preset = load_model(kwargs["model"])
        kwargs["model_flags"] = (*preset.flags, *kwargs.get("model_flags", ()))
    if "model_flags" not in kwargs:
        raise ValueError('a sweep needs model_flags or a model preset (model = "tiny")')
    return SweepSpec(**kwargs)


def load_spec(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML sweep file (top-level keys are :class:`SweepSpec` fields),
    checked by :func:`check_settings`; every failure is a ValueError naming the file."""
    try:
        with open(path, "rb") as handle:
            values = tomllib.load(handle)
        check_settings(values)
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    except ValueError as error:  # tomllib's syntax errors are ValueErrors too
        raise ValueError(f"{path}: {error}") from None
    return values
