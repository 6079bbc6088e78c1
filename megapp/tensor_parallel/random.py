"""Named RNG streams for tensor parallelism, and activation checkpointing that replays them.

Dropout must agree across tensor-parallel ranks where activations are replicated (outside TP
regions) and differ where they are split (inside, e.g. attention probabilities ``[b, n/tp, s, s]``
of a rank's heads). Megatron's scheme, kept here:

* the default generators (CPU, and the CUDA ones) are seeded with
  ``default_seed = seed + 100·pp_rank``: identical on the TP ranks of one pipeline stage,
  different between stages (which hold different layers);
* the tracker stream ``"model-parallel-rng"`` is seeded with
  ``default_seed + 2718 + tp_rank``: different on every TP rank; fork it around dropout inside a
  TP region;
* the tracker stream ``"data-parallel-rng"`` is seeded with ``default_seed`` (the same on every
  TP rank, as the default generators), for code that wants a named replicated stream.

A stream is a saved generator state: ``{"cpu": ByteTensor}`` plus ``"cuda"`` (the current
device's generator) when CUDA is available. ``fork(name)`` swaps it into the default generators
and swaps it back out, so the stream continues where it stopped and the default generators are
untouched by it.

:func:`checkpoint` drops a function's activations and recomputes them in backward under the
forward's generator states and tracker streams, so the recomputed dropout masks are the same.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from megapp.autograd.saved import notify_kept

__all__ = [
    "DATA_PARALLEL_RNG_TRACKER_NAME",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "RNGStatesTracker",
    "checkpoint",
    "get_rng_tracker",
    "model_parallel_manual_seed",
]

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's constant; any positive offset works
_PIPELINE_SEED_STRIDE = 100

RNGState = dict[str, torch.Tensor]


def _generator_state() -> RNGState:
    """The default CPU generator's state and, with CUDA, the current device's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_generator_state(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seeded_state(seed: int) -> RNGState:
    """The generator state ``manual_seed(seed)`` would give, without touching the defaults."""
    state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if torch.cuda.is_available():
        outer = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state["cuda"] = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(outer)
    return state


class RNGStatesTracker:
    """Named RNG streams that :meth:`fork` swaps into the default generators.

    Usage::

        tracker.add("model-parallel-rng", seed)
        with tracker.fork("model-parallel-rng"):
            probs = torch.nn.functional.dropout(probs, p)  # this rank's own mask
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every stream and seed."""
        self._states: dict[str, RNGState] = {}
        self._seeds: set[int] = set()
        self._active: list[str] = []  # names forked now, innermost last

    def is_initialized(self) -> bool:
        return bool(self._states)

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` in the state ``manual_seed(seed)`` gives.

        Names and seeds must be unique: two streams from one seed would repeat each other.
        """
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        self._seeds.add(seed)
        self._states[name] = _seeded_state(seed)

    def get_states(self) -> dict[str, RNGState]:
        """``{name: {"cpu": ByteTensor[, "cuda": ByteTensor]}}``, e.g. for a training checkpoint."""
        return {name: dict(state) for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace every stream by ``states`` (as :meth:`get_states` returns them)."""
        for name, state in states.items():
            if not isinstance(state, Mapping) or not isinstance(state.get("cpu"), torch.Tensor):
                raise ValueError(
                    f"RNG stream {name!r}: expected a {{'cpu': ByteTensor, ...}} mapping, "
                    f"got {type(state).__name__}"
                )
            if torch.cuda.is_available() and "cuda" not in state:
                # Without it the stream would silently share the default CUDA generator.
                raise ValueError(
                    f"RNG stream {name!r} has no 'cuda' state (saved without CUDA?); reseed "
                    "with model_parallel_manual_seed() instead"
                )
        self._states = {name: dict(state) for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the body with stream ``name`` as the default generators, then swap it back out.

        Forks nest. Forking the stream that is already current (the innermost fork) just
        continues it; forking one that an outer fork has swapped out raises, since its saved
        state is stale until that outer fork ends.
        """
        if name not in self._states:
            raise ValueError(
                f"RNG stream {name!r} was never added (streams: {sorted(self._states)}); "
                "call model_parallel_manual_seed() or add() first"
            )
        if self._active and self._active[-1] == name:
            yield
            return
        if name in self._active:
            raise RuntimeError(
                f"RNG stream {name!r} is forked by an outer context that another stream's "
                f"fork has since replaced ({' > '.join(self._active)}); it cannot be re-entered"
            )
        outer = _generator_state()
        _set_generator_state(self._states[name])
        self._active.append(name)
        try:
            yield
        finally:
            self._active.pop()
            self._states[name] = _generator_state()  # the stream continues from here next time
            _set_generator_state(outer)

    def _snapshot(self) -> tuple[dict[str, RNGState], list[str]]:
        return self.get_states(), list(self._active)

    def _restore(self, snapshot: tuple[dict[str, RNGState], list[str]]) -> None:
        states, active = snapshot
        self._states = {name: dict(state) for name, state in states.items()}
        self._active = list(active)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that :func:`model_parallel_manual_seed` seeds."""
    return _TRACKER


def model_parallel_manual_seed(
    seed: int, tp_rank: int | None = None, pp_rank: int | None = None
) -> dict[str, int]:
    """Seed the default generators and the tracker streams for this rank.

    ``default_seed = seed + 100·pp_rank`` seeds the default CPU and CUDA generators and the
    ``"data-parallel-rng"`` stream; ``default_seed + 2718 + tp_rank`` seeds
    ``"model-parallel-rng"``. Ranks not given are read from :mod:`megapp.parallel_state` when it
    is initialized, else 0. The tracker is reset first. Returns the seeds by stream name
    (``"default"`` for the default generators).
    """
    from megapp import parallel_state  # a runtime import: parallel_state is optional here

    initialized = parallel_state.model_parallel_is_initialized()
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if initialized else 0
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if initialized else 0
    default_seed = seed + _PIPELINE_SEED_STRIDE * pp_rank
    model_parallel_seed = default_seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank
    torch.manual_seed(default_seed)  # CPU and every CUDA device
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(DATA_PARALLEL_RNG_TRACKER_NAME, default_seed)
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)
    return {
        "default": default_seed,
        DATA_PARALLEL_RNG_TRACKER_NAME: default_seed,
        MODEL_PARALLEL_RNG_TRACKER_NAME: model_parallel_seed,
    }


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


def _all_generator_states() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU generator and every CUDA device's generator (a function may use any device)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda


def _set_all_generator_states(states: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class _Handle:
    """Stands in for one saved tensor; the recomputed tensor lives as long as it does."""

    __slots__ = ("__weakref__", "index")

    def __init__(self, index: int):
        self.index = index


class _Recomputation:
    """What a checkpointed call needs to run again in backward exactly as it ran forward."""

    def __init__(self, function: Callable, args: tuple, kwargs: dict):
        self.function, self.args, self.kwargs = function, args, kwargs
        self.generators = _all_generator_states()
        self.tracker = get_rng_tracker()._snapshot()
        self.autocast = [
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _autocast_devices()
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.handles: list[weakref.ref[_Handle]] = []
        # Keyed weakly by handle: autograd frees a handle once its node no longer needs it, and
        # the recomputed tensor goes with it, so memory falls as backward walks the region.
        self.recomputed: weakref.WeakKeyDictionary[_Handle, torch.Tensor] | None = None

    def pack(self, tensor: torch.Tensor) -> _Handle:
        handle = _Handle(len(self.handles))
        self.handles.append(weakref.ref(handle))
        return handle  # the tensor itself is dropped: it will be recomputed

    def unpack(self, handle: _Handle) -> torch.Tensor:
        if self.recomputed is None:
            self._recompute()
        assert self.recomputed is not None
        return self.recomputed[handle]

    @contextlib.contextmanager
    def _forward_rng(self) -> Iterator[None]:
        """Put back every generator and tracker stream as the forward found them; restore after."""
        tracker = get_rng_tracker()
        outer_generators, outer_tracker = _all_generator_states(), tracker._snapshot()
        _set_all_generator_states(self.generators)
        tracker._restore(self.tracker)
        try:
            yield
        finally:
            tracker._restore(outer_tracker)
            _set_all_generator_states(outer_generators)

    def _recompute(self) -> None:
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> int:
            saved.append(tensor.detach())
            return len(saved) - 1

        with contextlib.ExitStack() as stack:
            stack.enter_context(self._forward_rng())
            stack.enter_context(torch.enable_grad())  # backward runs with grad mode off
            for device, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(device, dtype, enabled, cache_enabled=self.autocast_cache)
                )
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, saved.__getitem__))
            self.function(*self.args, **self.kwargs)
        if len(saved) != len(self.handles):
            raise RuntimeError(
                f"checkpoint: the recomputation saved {len(saved)} tensors for backward but the "
                f"forward saved {len(self.handles)}; the checkpointed function must do the same "
                "work every time it runs (and must not modify its inputs in place)"
            )
        self.recomputed = weakref.WeakKeyDictionary()
        for ref, tensor in zip(self.handles, saved, strict=True):
            handle = ref()
            if handle is not None:  # a node already freed needs nothing
                self.recomputed[handle] = tensor
        self.function = self.args = self.kwargs = None  # type: ignore[assignment]


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping none of its activations; recompute in backward.

    The tensors autograd would save inside ``function`` are dropped; the first time backward
    needs one, ``function`` runs again under the forward's CPU and CUDA generator states, tracker
    streams (and forks in progress) and autocast settings, so dropout draws the same masks and the
    gradients are bit-identical to running without checkpointing. The generators and streams are
    put back afterwards: recomputation consumes no randomness.

    Non-reentrant: the outputs are ``function``'s own, returned as they are (any structure,
    non-tensors included); args may be anything; tensors that do not require grad are fine (the
    parameters inside still get gradients); ``torch.autograd.grad`` works. Only the inputs and
    the RNG/autocast states are kept, so ``function`` must not modify its inputs in place.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)  # nothing would be saved, so nothing to recompute
    recomputation = _Recomputation(function, args, kwargs)
    notify_kept(*args, *kwargs.values())  # the inputs are what a checkpoint keeps
    with torch.autograd.graph.saved_tensors_hooks(recomputation.pack, recomputation.unpack):
        return function(*args, **kwargs)
