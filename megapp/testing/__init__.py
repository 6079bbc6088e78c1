"""Test helpers: run a test body on every rank of a reused gloo world.

    @pytest.mark.parametrize("tp", [1, 2])
    @distributed(world_size=4)
    def test_something(tp):
        ...  # runs on 4 ranks with torch.distributed initialized (gloo)

If the test takes a ``world_size`` argument (e.g. from ``parametrize``), that
many ranks run it and ``world_size=`` may be left out of the decorator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megapp.testing.world import DistributedTestError, World, get_world, shutdown_worlds

__all__ = ["DistributedTestError", "World", "distributed", "get_world", "shutdown_worlds"]


def distributed(world_size: int | None = None, *, timeout: float = 60.0) -> Callable:
    """Make a module-level test run its body on every rank of a shared world.

    A failure on any rank fails the test with that rank's traceback; a rank
    that hangs fails it after ``timeout`` seconds with every rank's stack.
    """

    def decorate(body: Callable) -> Callable:
        @functools.wraps(body)
        def test(*args: Any, **kwargs: Any) -> None:
            size = kwargs.get("world_size", world_size)
            if size is None:
                name = body.__qualname__
                raise TypeError(
                    f"{name}: give distributed(world_size=...) or a world_size argument"
                )
            get_world(size).run_by_name(
                body.__module__, body.__qualname__, args, kwargs, timeout=timeout
            )

        test.__distributed_body__ = body  # what the workers call
        return test

    return decorate
