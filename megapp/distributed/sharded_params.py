"""ZeRO-3 weights: each data-parallel rank keeps its slice; a layer's are gathered to use.

The buffer is cut into buckets that never span two units (a transformer layer, or the
rest of the chunk: embedding, final norm, output layer), each bucket with a storage of
its own. At rest a bucket's storage is freed (``resize_(0)``: the parameters stay views
of it, so autograd's saved weights see it again once refilled) and this rank keeps only
its slice, in a persistent store that the optimizer updates. A unit's buckets are
gathered (one all-gather each) when it is about to run and freed after:

- forward: a pre-hook gathers, a post-hook frees;
- backward: a hook on the unit's output gradient gathers again before the unit's
  backward, and the unit is freed when every one of its parameters has its gradient;
- the rest of the chunk (:data:`OUTER`) is gathered around the chunk's forward and, when a
  backward follows, kept until its gradients are in.

Prefetch: when a layer is gathered for its forward, the next layer's all-gather starts
asynchronously (the previous layer's for backward), so it runs while this layer computes.
A layer recomputed inside backward prefetches its successor too, which has already run
its backward; the end of backward (:meth:`reset`) frees such unused prefetches.

Use counts make nested uses (a recomputed layer runs its forward inside backward;
microbatches overlap in pipeline schedules) gather once and free after the last user.

Between uses a parameter keeps its shape over a storage of zero bytes, so it is a
:class:`~megapp.distributed.released.ReleasedParameter` then: its shape, dtype and
gradient can be read, but any op on its values raises an error that names the chunk's
``full_weights()`` (:meth:`ShardedParams.gathered`), where they are whole. Inside that
block ``state_dict()`` returns copies, which outlive the gathered storage.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from megapp import comm
from megapp.comm import Group
from megapp.distributed.buffers import Bucket, ParamAndGradBuffer
from megapp.distributed.released import label, mark_released, mark_whole

# The unit of a chunk's parameters outside its layers (embedding, final norm, output layer).
# Its forward is the whole chunk's, so it stays whole from forward to backward (as FSDP2
# keeps its root): freeing it would only re-gather it at once for the output layer's
# backward.
OUTER = "outer"


class ShardedParams:
    """The weights of one chunk's buffer under ZeRO-3 (see the module docstring).

    Args:
        buffer: built with ``unit_of`` and ``bucket_storage``.
        dp_group: the ranks over which each bucket's weights are sliced.
        units: unit key -> the module whose forward uses that unit's parameters; units
            that hold none of ``buffer``'s parameters are left out (a chunk's experts sit
            in only some of its layers).
        unit_of: the unit key of each parameter (as the buffer was cut).
    """

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        dp_group: Group,
        units: dict[object, nn.Module],
        unit_of,
    ) -> None:
        self.buffer, self.dp_group = buffer, dp_group
        self.dp_size, self.dp_rank = comm.world_size(dp_group), comm.rank(dp_group)
        held = {unit_of(p) for p in buffer.params}
        used = {key: module for key, module in units.items() if key in held}
        self.buckets_of: dict[object, list[Bucket]] = {key: [] for key in used}
        self.params_of: dict[object, list[nn.Parameter]] = {key: [] for key in used}
        for bucket in buffer.buckets:
            key = unit_of(bucket.params[0])
            self.buckets_of[key].append(bucket)
            self.params_of[key].extend(bucket.params)
        self.shards = {id(b): self._own(b).clone() for b in buffer.buckets}
        self.users = dict.fromkeys(used, 0)
        self.in_flight: dict[object, list[comm.Pending]] = {}
        layers = sorted(k for k in used if k != OUTER)
        self.next = dict(itertools.pairwise(layers))
        self.previous = {later: earlier for earlier, later in self.next.items()}
        self.arrived = dict.fromkeys(used, 0)
        self.unit_of_param = {id(p): unit_of(p) for p in buffer.params}
        self._hooks = []
        self._name_params(units)
        for bucket in buffer.buckets:
            self._free(bucket)
        for key, module in used.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(key)))
            self._hooks.append(module.register_forward_hook(self._post_forward(key)))
        for p in buffer.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _name_params(self, units: dict[object, nn.Module]) -> None:
        """Name each parameter for the errors, and make ``state_dict()`` copy the weights
        (views of them would outlive the gathered storage)."""
        sharded = {id(p) for p in self.buffer.params}
        seen: set[int] = set()
        for root in units.values():
            for module_name, module in root.named_modules():
                if id(module) in seen:  # a layer is also inside the chunk's root
                    continue
                seen.add(id(module))
                own = [n for n, p in module.named_parameters(recurse=False) if id(p) in sharded]
                for n in own:
                    label(getattr(module, n), f"{module_name}.{n}" if module_name else n)
                if own:
                    self._hooks.append(module.register_state_dict_post_hook(_copy_weights(own)))

    def _own(self, bucket: Bucket) -> torch.Tensor:
        lo, hi = bucket.shard(self.dp_rank, self.dp_size)
        return bucket.param_data[lo - bucket.start : hi - bucket.start]

    def shard_of(self, bucket: Bucket) -> torch.Tensor:
        """This rank's persistent slice of ``bucket``'s weights."""
        return self.shards[id(bucket)]

    # ----- gather and free -------------------------------------------------
    def gather(self, key: object, prefetch: object = None) -> None:
        """Make ``key``'s weights whole (waiting for a prefetch of them, if any), and start
        gathering ``prefetch``'s."""
        if self.users[key] == 0:
            self.prefetch(key)
            for work in self.in_flight.pop(key):
                work.wait()
            for bucket in self.buckets_of[key]:
                for p in bucket.params:
                    mark_whole(p)
        self.users[key] += 1
        if prefetch is not None:
            self.prefetch(prefetch)

    def prefetch(self, key: object) -> None:
        """Start gathering ``key``'s weights unless they are whole or on their way."""
        if self.users[key] or key in self.in_flight:
            return
        works = []
        for bucket in self.buckets_of[key]:
            _allocate(bucket.param_data)
            works.append(
                comm.all_gather_into(
                    bucket.param_data, self.shards[id(bucket)], self.dp_group, async_op=True
                )
            )
        self.in_flight[key] = works

    def release(self, key: object) -> None:
        self.users[key] -= 1
        if self.users[key] == 0:
            for bucket in self.buckets_of[key]:
                self._free(bucket)

    def _free(self, bucket: Bucket) -> None:
        bucket.param_data.untyped_storage().resize_(0)
        for p in bucket.params:
            mark_released(p)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every weight whole while the block runs (checkpoints, tests); what the block
        writes into the weights is kept (each rank's slice is read back)."""
        for key in self.users:
            self.gather(key)
        try:
            yield
        finally:
            with torch.no_grad():
                for bucket in self.buffer.buckets:
                    self.shards[id(bucket)].copy_(self._own(bucket))
            for key in self.users:
                self.release(key)

    # ----- hooks -----------------------------------------------------------
    def _pre_forward(self, key: object):
        def hook(module: nn.Module, args) -> None:
            self.gather(key, prefetch=self.next.get(key))

        return hook

    def _post_forward(self, key: object):
        def hook(module: nn.Module, args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            backward = (
                torch.is_grad_enabled()
                and isinstance(tensor, torch.Tensor)
                and tensor.requires_grad
            )
            if backward and key == OUTER:
                return output  # kept whole for backward: its gradients free it
            self.release(key)
            if backward:
                tensor.register_hook(self._before_backward(key))
            return output

        return hook

    def _before_backward(self, key: object):
        def hook(grad: torch.Tensor) -> None:
            self.gather(key, prefetch=self.previous.get(key))
            return None

        return hook

    def _on_grad(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a split backward's I deferred this weight: nothing came
            return
        key = self.unit_of_param[id(param)]
        self.arrived[key] += 1
        if self.arrived[key] == len(self.params_of[key]):
            self.arrived[key] = 0
            self.release(key)

    def reset(self) -> None:
        """Free everything still gathered (a unit some parameter sent no gradient to, or a
        prefetch nobody used)."""
        for key in list(self.in_flight):
            for work in self.in_flight.pop(key):
                work.wait()
            for bucket in self.buckets_of[key]:
                self._free(bucket)
        for key in self.users:
            if self.users[key]:
                self.users[key] = 1
                self.release(key)
            self.arrived[key] = 0

    def weight_bytes(self) -> int:
        """Bytes of weight storage held now: the slices and whatever is gathered."""
        held = sum(t.numel() * t.element_size() for t in self.shards.values())
        for bucket in self.buffer.buckets:
            held += bucket.param_data.untyped_storage().nbytes()
        return held


def _copy_weights(names: list[str]):
    """A ``state_dict`` post-hook: the entries of ``names`` become copies, unless they are
    the parameters themselves (``keep_vars=True``)."""

    def hook(module: nn.Module, state: dict, prefix: str, metadata) -> None:
        for name in names:
            key = prefix + name
            if key in state and not isinstance(state[key], nn.Parameter):
                state[key] = state[key].clone()

    return hook


def _allocate(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(tensor.numel() * tensor.element_size())


def layer_units(module: nn.Module):
    """``(units, unit_of)`` for a chunk: each ``decoder.layers[i]`` a unit, the rest one
    more ("outer", used by the chunk's own forward)."""
    units: dict[object, nn.Module] = {OUTER: module}
    keys: dict[int, object] = {}
    for name, param in module.named_parameters():
        parts = name.split(".")
        key: object = OUTER
        if len(parts) > 3 and parts[0] == "decoder" and parts[1] == "layers":
            key = ("layer", int(parts[2]))
            units[key] = module.decoder.layers[int(parts[2])]
        keys[id(param)] = key
    return units, lambda p: keys[id(p)]
