"""Every random generator a training step draws from, as tensors a checkpoint can hold.

A resumed run continues exactly only if dropout masks and any host-side sampling
draw the same numbers as the uninterrupted run would: Python's ``random``,
NumPy's global generator, torch's CPU (and current CUDA) generator, and the
named streams of the tensor-parallel RNG tracker. Each rank has its own states,
so they are saved per rank and restored only under the same layout.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from megapp.tensor_parallel.random import get_rng_tracker


def capture() -> dict[str, torch.Tensor]:
    """This process's generator states, each a tensor."""
    version, internal, gauss = random.getstate()
    states = {
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    if kind != "MT19937":
        raise ValueError(f"cannot save NumPy's {kind} global generator")
    states["numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64)
    states["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, state in get_rng_tracker().get_states().items():
        for device, tensor in state.items():
            states[f"tracker/{name}/{device}"] = tensor.clone()
    return states


def restore(states: dict[str, torch.Tensor]) -> None:
    """Set every generator from :func:`capture`'s output."""
    python = states["python"].tolist()
    gauss = float(states["python_gauss"][0])
    random.setstate((python[0], tuple(python[1:]), None if math.isnan(gauss) else gauss))
    numpy = states["numpy"].tolist()
    keys = np.array(numpy[:-2], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, numpy[-2], numpy[-1], float(states["numpy_gauss"][0])))
    torch.set_rng_state(states["torch_cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tracker: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in states.items():
        if key.startswith("tracker/"):
            _, name, device = key.split("/")
            tracker.setdefault(name, {})[device] = tensor
    if tracker:
        get_rng_tracker().set_states(tracker)
