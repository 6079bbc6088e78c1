"""Autograd mechanisms below both the layers and the pipeline engine: what a backward
keeps, rebuilds or frees (:mod:`~megapp.autograd.saved`) and weight gradients deferred
apart from input gradients (:mod:`~megapp.autograd.deferred`)."""
