"""A ZeRO-3 parameter between its layer's uses, guarded against reads of its values.

ZeRO-3 frees a layer's gathered weights after each use (``resize_(0)`` of the bucket's
storage): the parameters keep their full shape, so the layer, the optimizer and autograd's
saved weights see them again once the storage is refilled, but in between their values are
not on this rank. Reading them then would read freed memory. While released, a parameter's
class is :class:`ReleasedParameter`: shape, dtype, gradient and hooks answer as for any
parameter, and every op that touches the values raises ``RuntimeError`` naming the
parameter and ``full_weights()``. Swapping the class back when the weights are whole costs
nothing on the path that uses them.
"""

from __future__ import annotations

import torch
from torch import nn

# What a released parameter still answers: its metadata and gradient, never its values.
_METADATA_PROPERTIES = frozenset(
    "shape dtype device ndim layout requires_grad grad grad_fn is_leaf "  # noqa: SIM905
    "is_cuda is_cpu is_meta is_sparse is_quantized is_nested names itemsize nbytes output_nr "
    "retains_grad _version _backward_hooks _post_accumulate_grad_hooks _cdata".split()
)
_SETTABLE_PROPERTIES = frozenset(("grad", "requires_grad"))
_METADATA_METHODS = frozenset(
    "size dim numel nelement element_size stride storage_offset "  # noqa: SIM905
    "is_contiguous is_floating_point is_complex untyped_storage data_ptr get_device __hash__ "
    "__len__ register_hook register_post_accumulate_grad_hook requires_grad_ is_shared "
    "is_pinned _is_view".split()
)
_NAME = "_released_name"


def _op_name(func) -> str:
    if type(func).__name__ == "method-wrapper":  # a property's __get__ or __set__
        return getattr(func.__self__, "__name__", "")
    return getattr(func, "__name__", "")


def _reads_metadata_only(func) -> bool:
    if type(func).__name__ == "method-wrapper":
        allowed = _METADATA_PROPERTIES if func.__name__ == "__get__" else _SETTABLE_PROPERTIES
        return _op_name(func) in allowed
    return _op_name(func) in _METADATA_METHODS


def _first_released(values) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, ReleasedParameter):
            return value
        if isinstance(value, (list, tuple, dict)):
            found = _first_released(value.values() if isinstance(value, dict) else value)
            if found is not None:
                return found
    return None


def _describe(param: torch.Tensor | None) -> str:
    if param is None:
        return "(a released one)"
    name = param.__dict__.get(_NAME)
    where = f"{name}, " if name else ""
    return f"{where}shape {list(param.shape)}, {param.dtype}"


class ReleasedParameter(nn.Parameter):
    """A ZeRO-3 parameter between its layer's uses: this rank holds only its slice of the
    weights, and the parameter's full shape sits over a storage of zero bytes. Metadata and
    the gradient stay readable; any op on the values raises ``RuntimeError``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_metadata_only(func):
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        released = _first_released((*args, *kwargs.values()))
        if _op_name(func) == "__repr__":
            return f"ReleasedParameter({_describe(released)})"
        raise _released_error(_op_name(func) or repr(func), released)

    # Views of the storage that torch hands out without a torch function: refused too.
    def as_subclass(self, cls):
        raise _released_error("as_subclass", self)

    def __dlpack__(self, *args, **kwargs):
        raise _released_error("__dlpack__", self)


def _released_error(op: str, released: torch.Tensor | None) -> RuntimeError:
    return RuntimeError(
        f"{op} needs the values of the parameter {_describe(released)}, which ZeRO-3 "
        "releases between its layer's uses (this rank keeps only its slice); read or "
        "write it inside DistributedDataParallel.full_weights() "
        "(megapp.distributed.full_weights(chunks) for several chunks)"
    )


def label(param: nn.Parameter, name: str) -> None:
    """Name ``param`` in the errors it raises while released."""
    param.__dict__[_NAME] = name


def mark_released(param: nn.Parameter) -> None:
    """``param``'s storage was just freed: guard its values."""
    if type(param) is nn.Parameter:  # a subclass keeps its own class (and no guard)
        param.__class__ = ReleasedParameter


def mark_whole(param: nn.Parameter) -> None:
    """``param``'s values are whole again."""
    if type(param) is ReleasedParameter:
        param.__class__ = nn.Parameter
