"""The compute of a schedule whose backwards split into ``I`` and ``W`` (the zero-bubble family).

:class:`SplitBackwardCompute` adds the two halves to
:class:`~megapp.pipeline_parallel.compute.StageCompute`. Every action runs under
:func:`~megapp.autograd.deferred.split_forward`, so megapp's linears build deferrable
nodes; a microbatch whose forward built some uses the store (``I`` computes all but
their weight gradients), one whose forward built none (any other module) the graph
split (``I`` computes the input gradients only). A microbatch-chunk counts as held from
its forward until its ``W``. A whole ``B`` (DualPipeV's) runs as in any schedule.
"""

from __future__ import annotations

from megapp.autograd.deferred import (
    DeferredWeightGrads,
    ForwardRecord,
    GraphSplit,
    collect_weight_grads,
    split_forward,
)
from megapp.autograd.saved import run_backward
from megapp.pipeline_parallel.compute import StageCompute
from megapp.pipeline_parallel.schedules import Action, Op


class SplitBackwardCompute(StageCompute):
    """:class:`~megapp.pipeline_parallel.compute.StageCompute` with ``I`` and ``W``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # Per (microbatch, chunk): whether its forward built deferrable matmuls, then,
        # between its I and its W, the weight-gradient work left.
        self.uses_store: dict[tuple[int, int], bool] = {}
        self.deferred: dict[tuple[int, int], DeferredWeightGrads | GraphSplit] = {}
        self.record: ForwardRecord | None = None
        self.handlers[Op.INPUT_GRAD] = self.input_grad
        self.handlers[Op.WEIGHT_GRAD] = self.weight_grad

    def run(self, action: Action) -> None:
        # Every action, not only forwards: a recomputation inside backward must build
        # the same nodes, and save the same tensors, as the forward did.
        with split_forward() as self.record:
            super().run(action)

    def forward(self, action: Action) -> None:
        super().forward(action)
        self.uses_store[(action.microbatch, action.chunk)] = self.record.deferrable > 0

    def backward(self, action: Action) -> None:
        self.uses_store.pop((action.microbatch, action.chunk), None)
        super().backward(action)

    def input_grad(self, action: Action) -> None:
        """``I``: the inputs' gradients, sent back at once, and every parameter gradient
        that is not left to ``W`` (see the module docstring)."""
        key = (action.microbatch, action.chunk)
        inputs, outputs, grads = self.gradients_in(action)
        if self.uses_store.pop(key):
            store = DeferredWeightGrads()
            with collect_weight_grads(store):
                run_backward(outputs, grads)
            self.deferred[key] = store
        else:
            floating = [t for t in inputs if t.is_floating_point()]
            self.deferred[key] = GraphSplit.input_half(outputs, grads, floating)
        self.send_input_grads(action, inputs)

    def weight_grad(self, action: Action) -> None:
        """``W``: the weight gradients ``I`` left, accumulated through autograd."""
        self.before_backward(action)
        self.deferred.pop((action.microbatch, action.chunk)).run()
        self.in_flight -= 1
