"""The peak bytes of live tensor storage in a stretch of code, counted exactly on any device.

On GPU, ``torch.cuda.max_memory_allocated`` answers this; a CPU has no such counter.
:class:`LiveTensorMemory` counts it from the tensors themselves: every storage alive when it
starts (found through the garbage collector), plus every storage an operator creates while
it is active (a dispatch mode sees each operator's outputs, forward and backward), each
counted once however many views it has, and dropped when its last user frees it (a weak
reference to the storage tells). Storages their owners resize in place, outside any
operator (megapp's ZeRO-3 buckets, freed to zero bytes between uses), are read at their
current size after every operator.

The count is of tensor bytes, as ``max_memory_allocated`` counts allocations: allocator
rounding, the Python heap and buffers a communication library keeps to itself are not in it.

:func:`available_bytes` says how much a device has left to allocate, for the start-up check
that a model fits; :func:`refusing_out_of_memory` turns an allocation that fails anyway into
one line.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megapp.comm import one_line
from megapp.training.flag_groups import ArgumentsError

_SWEEP_EVERY = 512  # registrations between sweeps of freed storages, bounding the bookkeeping


class LiveTensorMemory(TorchDispatchMode):
    """``with LiveTensorMemory(resizable) as memory: ...`` then ``memory.peak`` (bytes).

    ``resizable``: storages that are resized in place by their owners (held alive by them);
    they are counted at their current size and left out of everything else.
    """

    def __init__(self, resizable: Sequence[torch.UntypedStorage] = ()) -> None:
        super().__init__()
        self.resizable = list(resizable)
        self.skip = {StorageWeakRef(s).cdata for s in self.resizable}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.counted = 0  # bytes of self.live, freed storages included until the next sweep
        self.peak = 0
        self.start = 0
        self.since_sweep = 0

    def __enter__(self) -> LiveTensorMemory:
        gc.collect()  # garbage freed later would count against the growth
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
                self.track(obj)
        self.sweep()
        self.start = self.current()
        self.peak = self.start
        return super().__enter__()

    def current(self) -> int:
        """Bytes live now (after a sweep; an upper bound between sweeps)."""
        return self.counted + sum(s.nbytes() for s in self.resizable)

    def track(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor with no storage of its own
            return
        ref = StorageWeakRef(storage)
        key = ref.cdata
        if key in self.skip:
            return
        known = self.live.get(key)
        if known is not None:
            if not known[0].expired():
                return
            self.counted -= known[1]  # its address was freed and reused
        size = storage.nbytes()
        self.live[key] = (ref, size)
        self.counted += size
        self.since_sweep += 1

    def sweep(self) -> None:
        """Forget storages that have been freed."""
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.counted -= self.live.pop(key)[1]
        self.since_sweep = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        if self.since_sweep >= _SWEEP_EVERY or self.current() > self.peak:
            self.sweep()  # the upper bound passed the peak: make it exact before it counts
            self.peak = max(self.peak, self.current())
        return out


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can still get: the GPU's free memory, or on CPU
    the machine's ``MemAvailable`` (shared by every process on it); None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts KiB
    except OSError:
        pass
    return None


@contextlib.contextmanager
def refusing_out_of_memory(device: torch.device, doing: str) -> Iterator[None]:
    """Turn an allocation that fails on ``device`` while ``doing`` into an
    :class:`ArgumentsError` saying what was asked and what is free."""
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in text:
            raise
        free = available_bytes(device)
        where = "this machine" if device.type == "cpu" else f"GPU {device.index}"
        has = f"{where} has {free / 2**30:.1f} GiB free" if free is not None else where
        raise ArgumentsError(
            f"out of memory {doing} ({one_line(error, 200)}); {has}; split the model over "
            "more ranks (--tensor-model-parallel-size, --pipeline-model-parallel-size), "
            "shard its optimizer states (--zero-stage) or shrink it"
        ) from None
