"""Count, stand in for and replay the collectives a piece of code issues through
torch.distributed: the instruments of the tensor-parallel and ZeRO benchmarks in
``tools/benchmarks/``.

* :func:`intercept` routes every collective through a handler while a block runs;
* :class:`Recorder` is a handler that records each call (:class:`Op`: kind, bytes, shape);
* :func:`no_communication` is a handler that does locally what the collective leaves in its
  outputs, with the same shapes: the compute without the communication;
* :func:`replayer` issues recorded collectives alone: the communication without the compute;
* :func:`wire_bytes` / :func:`gloo_bytes` turn a payload into the bytes one rank sends, and
  :func:`written_bytes` reads what the process really wrote (Linux ``/proc/self/io``).

"Payload" is the full, unsharded tensor of a collective: the all-reduced tensor, an
all-gather's output, a reduce-scatter's input.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# torch.distributed functions that communicate. Every one found is wrapped while counting,
# so a collective the analysis does not expect still shows up (as an unexpected kind).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
)
# Kind of each collective: all-reduce (AR), all-gather (AG), reduce-scatter (RS).
KIND = {
    "all_reduce": "AR",
    "all_gather": "AG",
    "all_gather_into_tensor": "AG",
    "all_gather_single": "AG",
    "_all_gather_base": "AG",
    "reduce_scatter": "RS",
    "reduce_scatter_tensor": "RS",
    "reduce_scatter_single": "RS",
    "_reduce_scatter_base": "RS",
}

_local = threading.local()  # depth > 0 inside a shim: nested collectives pass through


@contextlib.contextmanager
def intercept(handler: Callable) -> Iterator[None]:
    """Route every collective in COLLECTIVES through ``handler(name, original, bound)``.

    Patched in ``torch.distributed``, ``distributed_c10d`` and in every loaded ``megapp``
    module that holds its own reference (``from torch.distributed import all_reduce`` or
    ``_gather = dist.all_gather_single``). A collective called from inside another one
    (torch 2.13's ``all_gather_into_tensor`` calls ``all_gather_single``) goes straight to
    the original, so each call counts once, under the name of the function called.
    """
    originals = {}
    for name in COLLECTIVES:
        for module in (dist, c10d):
            fn = getattr(module, name, None)
            if fn is not None:
                originals.setdefault(fn, name)
    shims = {fn: _shim(name, fn, handler) for fn, name in originals.items()}
    modules = [dist, c10d] + [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "megapp" or name.startswith("megapp."))
    ]
    saved = []
    for module in modules:
        for attr, value in list(vars(module).items()):
            try:
                shim = shims.get(value)
            except TypeError:  # unhashable
                continue
            if shim is not None:
                saved.append((module, attr, value))
                setattr(module, attr, shim)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _shim(name, original, handler):
    signature = inspect.signature(original)

    def shim(*args, **kwargs):
        if getattr(_local, "depth", 0):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _local.depth = 1
        try:
            return handler(name, original, bound)
        finally:
            _local.depth = 0

    return shim


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass
class Op:
    phase: str  # "fwd" or "bwd"
    name: str  # the torch.distributed function called
    kind: str  # AR, AG, RS, or the name for anything else
    payload: int  # bytes of the full tensor (see the module docstring)
    shard: int  # bytes of the per-rank part (= payload for an all-reduce)
    world: int  # ranks in the group
    shape: list[int] = field(default_factory=list)  # shape of the full tensor
    dtype: str = ""


def _payload(name: str, a: dict) -> tuple[int, int, torch.Tensor | None]:
    """(full-tensor bytes, per-rank bytes, full tensor) of one call's bound arguments."""
    kind = KIND.get(name)
    if kind == "AR":
        return _nbytes(a["tensor"]), _nbytes(a["tensor"]), a["tensor"]
    if name == "all_gather":
        return _nbytes(a["tensor_list"]), _nbytes(a["tensor"]), None
    if name == "reduce_scatter":
        return _nbytes(a["input_list"]), _nbytes(a["output"]), None
    if kind == "AG":  # (output_tensor | output, input_tensor | input)
        out, inp = (v for k, v in a.items() if isinstance(v, torch.Tensor))
        return _nbytes(out), _nbytes(inp), out
    if kind == "RS":  # (output, input)
        return _nbytes(a["input"]), _nbytes(a["output"]), a["input"]
    total = sum(_nbytes(v) for v in a.values())
    return total, total, None


def wire_bytes(kind: str, payload: int, world: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` full-tensor bytes (ring)."""
    if world == 1:
        return 0.0
    if kind == "AR":
        return 2 * (world - 1) / world * payload
    if kind in ("AG", "RS"):
        return (world - 1) / world * payload
    return float("nan")


def gloo_bytes(kind: str, payload: int, world: int) -> float:
    """Bytes one rank sends on gloo, whose reduce-scatter is an all-reduce and a slice
    (pytorch/pytorch#118911), twice a ring reduce-scatter."""
    return wire_bytes("AR" if kind == "RS" else kind, payload, world)


class Recorder:
    """Counts every collective (and passes it through to torch.distributed)."""

    def __init__(self):
        self.phase = "fwd"
        self.ops: list[Op] = []

    def __call__(self, name, original, bound):
        a = bound.arguments
        payload, shard, full = _payload(name, a)
        group = a.get("group")
        self.ops.append(
            Op(
                self.phase,
                name,
                KIND.get(name, name),
                payload,
                shard,
                dist.get_world_size(group),
                list(full.shape) if full is not None else [],
                str(full.dtype).removeprefix("torch.") if full is not None else "",
            )
        )
        return original(*bound.args, **bound.kwargs)


class _Done:
    """Stands in for the Work of an async collective that has already finished."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def no_communication(name: str, original: Callable, bound: inspect.BoundArguments) -> object:
    """Do locally what a collective leaves in its outputs, with the same shapes."""
    a = bound.arguments
    kind = KIND.get(name)
    if kind == "AR":
        pass  # in place: keep the local partial
    elif name == "all_gather":
        for t in a["tensor_list"]:
            t.copy_(a["tensor"])
    elif name == "reduce_scatter":
        a["output"].copy_(a["input_list"][dist.get_rank(a.get("group"))])
    elif kind == "AG":
        out, inp = (v for k, v in a.items() if isinstance(v, torch.Tensor))
        out.view(-1, *inp.shape).copy_(
            inp.unsqueeze(0).expand(out.numel() // inp.numel(), *inp.shape)
        )
    elif kind == "RS":
        out, inp = a["output"], a["input"]
        out.copy_(inp.view(-1, *out.shape)[dist.get_rank(a.get("group"))])
    else:
        raise RuntimeError(f"no local stand-in for torch.distributed.{name}")
    return _Done() if a.get("async_op") else None


def written_bytes() -> int | None:
    """Bytes this process has passed to write-family syscalls (Linux ``/proc/self/io``
    ``wchar``): gloo's TCP sends, so the bytes a rank really put on loopback."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def replayer(ops: list[Op], group: dist.ProcessGroup | None) -> Callable[[], float] | None:
    """A function that issues the recorded collectives over ``group`` alone (same functions,
    shapes and order, no compute) and returns its time, or None if a kind cannot be replayed.
    """
    tp = dist.get_world_size(group) if group is not None else 1
    if tp == 1 or not ops:
        return lambda: 0.0
    calls = []
    for op in ops:
        fn = getattr(dist, op.name)
        full = torch.randn(op.shape, dtype=getattr(torch, op.dtype or "float32"))
        shard = full.chunk(tp)[0].contiguous() if op.shape else None
        if op.kind == "AR" and op.shape:
            calls.append(lambda fn=fn, full=full: fn(full, group=group))
        elif op.kind == "AG" and op.shape and op.name != "all_gather":
            calls.append(lambda fn=fn, full=full, shard=shard: fn(full, shard, group=group))
        elif op.kind == "RS" and op.shape and op.name != "reduce_scatter":
            calls.append(lambda fn=fn, full=full, shard=shard: fn(shard, full, group=group))
        else:
            return None

    def run() -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - start

    return run
