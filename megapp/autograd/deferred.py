"""Weight gradients computed apart from input gradients (a backward split into ``I`` and ``W``).

Below both the tensor-parallel layers and the pipeline engine: the layers build
deferrable nodes only while a split-backward schedule holds :func:`split_forward` open
(they read :data:`state` and call nothing here otherwise), and the engine's split-backward
compute runs the two halves. Two mechanisms, chosen per microbatch and chunk by what its
forward ran:

**The deferred store** (megapp's own linears). Under :func:`split_forward`,
:func:`linear` builds a node whose backward may defer the weight-gradient matmul, and
column-parallel matmuls report themselves through :func:`note_deferrable`. While an
``I`` runs, the compute also holds :func:`collect_weight_grads` open: such a backward
returns the input (and bias) gradient at once and pushes a closure ``dW = gᵀ x``
(holding the saved input and the output gradient) into a :class:`DeferredWeightGrads`,
instead of computing it. A ``B``, or a backward outside any ``I``, computes everything
as usual. ``W`` runs the closures and hands each gradient to autograd
(``torch.autograd.backward(weight, dW)``), whose normal accumulation fires
``register_post_accumulate_grad_hook`` hooks exactly as in a whole backward:
data-parallel buffers and ZeRO see no difference. Biases, norms, embeddings and
everything else get their gradients in ``I``; they are cheap.

**The graph split** (any other module, e.g. a plain ``nn.Linear``), as
``torch.distributed.pipelining`` does it. ``I`` runs autograd towards the stage's inputs
alone, with the graph kept; a pre-hook on every *boundary* node (one on the input
path with an edge into a subgraph that leads only to parameters) captures the
gradient flowing into it, which is complete there since every path from the outputs
to it lies on the input path. ``W`` restarts autograd from those captured gradients
towards the parameters; pre-hooks pin every boundary node to its captured gradient,
so a boundary reached again from another one is not counted twice. The cost: the
chunk's graph (its activations) lives until ``W``.

:func:`weight_grad_memory` measures how much of a forward's activations a deferred
``W`` keeps alive (the simulator's ``weight_grad_memory``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from megapp.autograd.saved import observe_saved


class ForwardRecord:
    """What a forward under :func:`split_forward` ran: how many deferrable matmuls."""

    def __init__(self) -> None:
        self.deferrable = 0


class DeferralState:
    """The switches. Plain attributes, not thread-local: on GPU the autograd engine runs
    backward on its own device threads."""

    record: ForwardRecord | None = None
    """Set while forwards build deferrable nodes (:func:`split_forward`)."""
    collecting: DeferredWeightGrads | None = None
    """Set while an ``I`` collects weight-gradient work (:func:`collect_weight_grads`)."""


state = DeferralState()
"""The layers read ``state.record`` to build a deferrable node only when one is wanted."""


@contextlib.contextmanager
def split_forward() -> Iterator[ForwardRecord]:
    """Forwards inside the block build nodes whose weight gradient may be deferred; the
    record counts them. Recomputation in backward must run under it too, so that it
    saves what the forward saved."""
    before, state.record = state.record, ForwardRecord()
    try:
        yield state.record
    finally:
        state.record = before


def deferring() -> bool:
    """Whether forwards now build deferrable nodes (a forward-time check, cheap)."""
    return state.record is not None


def note_deferrable() -> None:
    """Count one deferrable matmul in the current forward's record, if any."""
    if state.record is not None:
        state.record.deferrable += 1


@contextlib.contextmanager
def collect_weight_grads(store: DeferredWeightGrads) -> Iterator[None]:
    """Deferrable backwards inside the block push their weight gradients into ``store``."""
    before, state.collecting = state.collecting, store
    try:
        yield
    finally:
        state.collecting = before


def defer_weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor], *held) -> bool:
    """Push ``compute`` (which returns ``weight``'s gradient; ``held`` are the tensors it
    keeps) if an ``I`` is collecting; False means: compute the gradient now.

    ``weight`` must be the tensor the forward was given, not its saved copy: a tensor
    unpacked through saved-tensor hooks is a new leaf that reaches the parameter's
    gradient accumulator only while some graph keeps that accumulator alive."""
    if state.collecting is None:
        return False
    state.collecting.entries.append((weight, compute, held))
    return True


class DeferredWeightGrads:
    """The weight-gradient work of one microbatch through one chunk, between ``I`` and ``W``."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, Callable[[], torch.Tensor], tuple]] = []

    def held_bytes(self, exclude: set[int] = frozenset()) -> int:
        """Bytes of the distinct storages the closures keep (``exclude``: storage pointers
        not to count, e.g. the parameters')."""
        seen = dict.fromkeys(exclude, 0)
        for _, _, held in self.entries:
            for t in held:
                storage = t.untyped_storage()
                seen.setdefault(storage.data_ptr(), storage.nbytes())
        return sum(seen.values())

    def run(self) -> None:
        """Compute every weight gradient, in the order ``I`` produced them (the same on
        every tensor-parallel rank, so gathers inside match), and accumulate each through
        autograd: hooks fire as in a whole backward. Each closure, with the tensors it
        holds, is dropped once its gradient is made, and each gradient once accumulated:
        ``W`` works with one weight's gradient at a time while its store shrinks."""
        entries, self.entries = self.entries[::-1], []
        while entries:
            weight, compute, _ = entries.pop()
            with torch.no_grad():  # as inside backward
                grad = compute()
            del compute
            torch.autograd.backward(weight, grad)
            del grad


def weight_grad_of_linear(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dW = gᵀ x`` over every leading dimension."""
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient is deferred while an ``I`` collects."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.has_bias = bias is not None
        ctx.param = weight  # the parameter itself: see defer_weight_grad
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs_x, needs_w, needs_b = ctx.needs_input_grad
        grad_x = grad.matmul(weight) if needs_x else None
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and needs_b else None
        grad_w = None
        kept = x.detach()  # without its graph, which would keep the chunk's input until W
        if needs_w and not defer_weight_grad(
            ctx.param, lambda: weight_grad_of_linear(grad, kept), grad, kept
        ):
            grad_w = weight_grad_of_linear(grad, x)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear``, or under :func:`split_forward` its deferrable twin."""
    if state.record is None:
        return F.linear(x, weight, bias)
    state.record.deferrable += 1
    return _DeferrableLinear.apply(x, weight, bias)


# ----- the graph split (any module) ----------------------------------------------------
def _node(t: torch.Tensor) -> Node:
    return get_gradient_edge(t).node


def _reach(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node from which one of them is reachable."""
    found, stack = set(starts), list(starts)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


class GraphSplit:
    """The weight half of one microbatch's backward through an arbitrary chunk.

    :meth:`input_half` runs ``I`` and returns the split; :meth:`run` is ``W``. Every leaf
    the outputs depend on other than the stage inputs (parameters, wherever they live)
    gets its gradient in ``W``; the inputs' gradients accumulate into their ``.grad``.
    """

    def __init__(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]):
        self.outputs, self.grads = tuple(outputs), tuple(grads)  # keep the graph alive
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.boundary: list[Node] = []
        self.starts: list[tuple[torch.Tensor, torch.Tensor]] = []  # roots off the input path
        self.params: tuple[torch.Tensor, ...] = ()

    @classmethod
    def input_half(
        cls,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
    ) -> GraphSplit:
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        split = cls([o for o, _ in pairs], [g for _, g in pairs])
        roots = [_node(o) for o, _ in pairs]
        inputs = [t for t in inputs if t.requires_grad]
        input_nodes = {_node(t) for t in inputs}
        parents: dict[Node, list[Node]] = defaultdict(list)
        seen, stack = set(roots), list(roots)
        while stack:
            node = stack.pop()
            for child, _ in node.next_functions:
                if child is not None:
                    parents[child].append(node)
                    if child not in seen:
                        seen.add(child)
                        stack.append(child)
        leaves = [n for n in seen if hasattr(n, "variable") and n not in input_nodes]
        on_input_path = _reach([n for n in input_nodes if n in seen], parents)
        to_params = _reach(leaves, parents) - on_input_path
        split.params = tuple(n.variable for n in leaves)
        split.boundary = [
            n
            for n in on_input_path
            if any(c in to_params for c, _ in n.next_functions if c is not None)
        ]
        split.starts = [
            pair
            for pair, root in zip(pairs, roots, strict=True)
            if root not in on_input_path and root in to_params
        ]
        if not inputs or not on_input_path:
            return split

        def capture(node: Node):
            def hook(grad_outputs):
                split.captured[node] = tuple(grad_outputs)

            return hook

        handles = [n.register_prehook(capture(n)) for n in split.boundary]
        try:
            _engine_backward(split.outputs, split.grads, inputs, keep_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        return split

    def run(self) -> None:
        """``W``: the parameters' gradients from what ``I`` captured, accumulated through
        autograd (hooks fire as usual); then the graph goes."""
        edges, grads = [], []
        for node, captured in self.captured.items():
            for index, g in enumerate(captured):
                if g is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(g)
        for output, g in self.starts:
            edges.append(get_gradient_edge(output))
            grads.append(g)

        def pin(captured: tuple | None):
            def hook(grad_outputs):
                return captured if captured is not None else (None,) * len(grad_outputs)

            return hook

        handles = [n.register_prehook(pin(self.captured.get(n))) for n in self.boundary]
        try:
            if edges and self.params:
                _engine_backward(edges, grads, self.params, keep_graph=False)
        finally:
            for handle in handles:
                handle.remove()
            self.outputs = self.grads = ()
            self.captured, self.boundary, self.starts = {}, [], []


def _engine_backward(roots, grads, inputs, keep_graph: bool) -> None:
    """Backward from ``roots`` (tensors, possibly with dropped storage, or gradient
    edges) into ``inputs`` only, accumulating into their ``.grad``."""
    torch.autograd.Variable._execution_engine.run_backward(
        tuple(roots),
        tuple(grads),
        keep_graph=keep_graph,
        create_graph=False,
        inputs=tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=True,
    )


# ----- measurement ---------------------------------------------------------------------
@dataclass(frozen=True)
class WeightGradMemory:
    """What a deferred ``W`` keeps of one forward: ``held`` bytes (saved inputs and output
    gradients of the deferred matmuls) against the forward's ``activations`` bytes (every
    distinct storage autograd saved, parameters excluded); ``share`` is their ratio, the
    simulator's ``weight_grad_memory``."""

    held: int
    activations: int

    @property
    def share(self) -> float:
        return self.held / self.activations if self.activations else 0.0


def weight_grad_memory(
    forward: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]
) -> WeightGradMemory:
    """Run ``forward`` (returning one tensor) under :func:`split_forward`, then its ``I``
    with a ones gradient, and measure what the store holds; then its ``W`` (so the
    parameters' gradients end up as after a whole backward)."""
    exclude = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with (
        split_forward(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        observe_saved(pack),
    ):
        out = forward()
    store = DeferredWeightGrads()
    with split_forward(), collect_weight_grads(store):
        out.backward(torch.ones_like(out))
    held = store.held_bytes(exclude)
    store.run()
    return WeightGradMemory(held, sum(saved.values()))
