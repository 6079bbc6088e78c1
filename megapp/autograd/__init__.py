"""Autograd mechanisms below both the layers and the pipeline engine: what a backward
keeps (:mod:`~megapp.autograd.saved`) and weight gradients deferred apart from input
gradients (:mod:`~megapp.autograd.deferred`)."""
