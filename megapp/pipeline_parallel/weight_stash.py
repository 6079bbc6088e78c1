"""Weight stashing: the older weight versions an asynchronous schedule's microbatches use.

In PipeDream and PipeDream-2BW (:mod:`megapp.pipeline_parallel.asynchronous`) a rank
may step its optimizer between a microbatch's forward and its backward, or run a
forward on weights a step older than its current ones. The backward must see exactly
the weights the forward saw, so :class:`WeightStash` keeps a frozen copy of every
version some microbatch still needs, and runs that microbatch's forward (and its
backward, where a recomputation reruns the forward) with the copy in place of the
module's parameters.

The copy stands in as a leaf whose gradient is handed on to the live parameter the
moment autograd has it, so gradients arrive where the optimizer and the data-parallel
reduction expect them, no sooner or later than the live parameter's own would, and an
optimizer step may change the live weights in place. A
microbatch that runs on the current weights and finishes its backward before the
next step uses the parameters themselves, copying nothing. A version is copied when a
microbatch first needs it (at the latest, just before the step that replaces it) and
dropped after the backward of its last microbatch: the rank holds the versions and
copies :func:`~megapp.pipeline_parallel.asynchronous.stash_profile` counts.

2BW's first iteration of a run uses the weights before the previous run's last step
(version -1): the stash keeps that copy between runs. A fresh stash (a new job, or one
resumed from a checkpoint) has none and runs that iteration on the current weights, as
the very first iteration does.

:class:`StashingCompute` is the engine's compute for these schedules: every action on the
weights its microbatch's forward used, and the optimizer steps (``U``) among them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from megapp.pipeline_parallel.asynchronous import in_flight_across_steps
from megapp.pipeline_parallel.compute import StageCompute
from megapp.pipeline_parallel.schedules import Action, Op, Schedule

Slot = tuple[nn.Module, str]  # a parameter's place: the module that holds it and its name


def _stand_in(frozen: torch.Tensor, live: nn.Parameter) -> torch.Tensor:
    """A leaf on ``frozen``'s storage whose gradient, as soon as autograd has it, goes on
    to ``live`` (and through ``live``'s own hooks, e.g. the data-parallel reduction)."""
    leaf = frozen.detach().requires_grad_()

    def deliver(tensor: torch.Tensor) -> None:
        grad, tensor.grad = tensor.grad, None
        torch.autograd.backward(live, grad)

    leaf.register_post_accumulate_grad_hook(deliver)
    return leaf


class _ChunkWeights:
    """One model chunk's trainable parameters, each once, and every place it sits."""

    def __init__(self, chunk: nn.Module):
        self.params: list[nn.Parameter] = []
        self.slots: list[list[Slot]] = []
        index: dict[int, int] = {}
        for module in chunk.modules():
            for name, param in module._parameters.items():
                if param is None or not param.requires_grad:
                    continue
                if id(param) not in index:
                    index[id(param)] = len(self.params)
                    self.params.append(param)
                    self.slots.append([])
                self.slots[index[id(param)]].append((module, name))

    def copy(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @contextlib.contextmanager
    def replaced(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The chunk with ``tensors`` in its parameters' places (written into each module's
        parameter table directly, as ``torch.func.functional_call`` does: ``setattr``
        accepts only a Parameter there)."""
        for slots, tensor in zip(self.slots, tensors, strict=True):
            for module, name in slots:
                module._parameters[name] = tensor
        try:
            yield
        finally:
            for slots, param in zip(self.slots, self.params, strict=True):
                for module, name in slots:
                    module._parameters[name] = param


class WeightStash:
    """The weight versions of one pipeline rank's chunks that its microbatches still need.

    Keep one per rank for the whole training run and pass it to every
    :func:`~megapp.pipeline_parallel.forward_backward` of an asynchronous schedule; the
    engine calls :meth:`begin` once per run, and the rest per action.
    """

    def __init__(self) -> None:
        self.carried: list[list[torch.Tensor]] | None = None  # version -1 of the next run
        self.copies: dict[int, list[list[torch.Tensor]]] = {}
        self.peak_versions = self.peak_copies = 0

    def begin(self, schedule: Schedule, rank: int, chunks: Sequence[nn.Module]) -> None:
        """Prepare a run of ``schedule`` on ``rank``, whose chunks are ``chunks``."""
        self.schedule, self.rank = schedule, rank
        self.chunks = [_ChunkWeights(c) for c in chunks]
        self.current = 0
        self.stand_ins: dict[tuple[int, int], list[torch.Tensor]] = {}
        carries = any(v < 0 for v in schedule.versions[rank])
        self.copies = {}
        if carries and self.carried is not None:
            self.copies[-1] = self.carried
        self.carried = None
        self.first_run_alias = carries and -1 not in self.copies
        actions = schedule.actions[rank]
        steps = sum(a.op is Op.UPDATE for a in actions)
        # the version the next run starts from, one step before this run's last weights
        self.keep = steps - 1 if carries else None
        self.users = Counter(self._version(a.microbatch) for a in actions if a.op is Op.FORWARD)
        self.straddles = in_flight_across_steps(actions)
        self.peak_versions, self.peak_copies = 1, 0
        self._count()

    def _version(self, microbatch: int) -> int:
        version = self.schedule.version(self.rank, microbatch)
        return 0 if version < 0 and self.first_run_alias else version

    def _ensure_copy(self, version: int) -> None:
        if version in self.copies:
            return
        if version != self.current:
            raise RuntimeError(
                f"weights version {version} is needed on pipeline rank {self.rank} but was "
                f"not kept (the current version is {self.current})"
            )
        self.copies[version] = [c.copy() for c in self.chunks]
        self._count()

    def _count(self) -> None:
        held = set(self.copies) | {self.current}
        self.peak_versions = max(self.peak_versions, len(held))
        self.peak_copies = max(self.peak_copies, len(self.copies))

    def forward_weights(self, microbatch: int, chunk: int) -> list[torch.Tensor] | None:
        """What stands in for ``chunk``'s parameters in ``microbatch``'s forward and
        backward; None: the parameters themselves."""
        key, version = (microbatch, chunk), self._version(microbatch)
        if version == self.current and key not in self.straddles:
            return None
        self._ensure_copy(version)
        live = self.chunks[chunk].params
        frozen = self.copies[version][chunk]
        stand_ins = [_stand_in(f, p) for f, p in zip(frozen, live, strict=True)]
        self.stand_ins[key] = stand_ins
        return stand_ins

    @contextlib.contextmanager
    def using(self, microbatch: int, chunk: int) -> Iterator[None]:
        """Run ``microbatch``'s action on ``chunk`` with the weights its forward used."""
        stand_ins = self.stand_ins.get((microbatch, chunk))
        if stand_ins is None:
            yield
            return
        with self.chunks[chunk].replaced(stand_ins):
            yield

    def after_backward(self, microbatch: int, chunk: int) -> None:
        """``microbatch``'s backward on ``chunk`` is done: drop what nothing needs now."""
        self.stand_ins.pop((microbatch, chunk), None)
        version = self._version(microbatch)
        self.users[version] -= 1
        self._drop_unused(version)

    def before_update(self) -> None:
        """Keep the current weights if a microbatch still needs them after this step."""
        if self.users[self.current] > 0 or self.current == self.keep:
            self._ensure_copy(self.current)

    def after_update(self) -> None:
        """The optimizer has made the next version."""
        self.current += 1
        self._drop_unused(self.current - 1)
        self._count()

    def _drop_unused(self, version: int) -> None:
        if version != self.keep and self.users[version] <= 0 and version != self.current:
            self.copies.pop(version, None)

    def finish(self) -> None:
        """The run is over: hand the version the next run starts from to it."""
        if self.keep is not None:
            self.carried = self.copies.get(self.keep)
        self.copies = {}
        self.stand_ins = {}


class StashingCompute(StageCompute):
    """:class:`~megapp.pipeline_parallel.compute.StageCompute` for an asynchronous schedule:
    each microbatch on the weights version the schedule gives it, and the optimizer steps
    ``U`` (through :attr:`~megapp.pipeline_parallel.compute.PipelineHooks.update`).

    ``stash``: the rank's weight versions, kept between runs (a fresh one if None).
    """

    def __init__(self, *, stash: WeightStash | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        schedule = self.schedule
        if schedule.splits_backward:
            raise ValueError(f"{schedule.name}: weight stashing needs whole backwards (B)")
        if self.hooks.update is None:
            raise ValueError(
                f"{schedule.name} steps the optimizer among its actions: pass "
                "PipelineHooks(update=...)"
            )
        self.stash = stash if stash is not None else WeightStash()
        self.stash.begin(schedule, self.pp_rank, self.chunks)
        self.handlers[Op.UPDATE] = self.update

    def run(self, action: Action) -> None:
        if action.op is Op.UPDATE:
            self.update(action)
            return
        if action.op is Op.FORWARD:
            self.stash.forward_weights(action.microbatch, action.chunk)
        with self.stash.using(action.microbatch, action.chunk):
            super().run(action)

    def backward(self, action: Action) -> None:
        super().backward(action)
        self.stash.after_backward(action.microbatch, action.chunk)

    def update(self, action: Action) -> None:
        """``U``: the optimizer step the schedule puts here, keeping the weights that
        microbatches in flight still need."""
        self.stash.before_update()
        self.hooks.update(action.microbatch)
        self.stash.after_update()

    def finish(self) -> None:
        self.stash.finish()
        self.weight_versions = self.stash.peak_versions
        self.weight_copies = self.stash.peak_copies
