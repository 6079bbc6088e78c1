"""A failed or stuck pipeline rank makes its peers fail within the timeout, not hang."""

import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapp.pipeline_parallel import forward_backward
from megapp.testing import DistributedTestError, World


def _pipeline_with_a_failing_last_stage():
    rank = dist.get_rank()

    def step(iterator, chunk, inputs):
        if rank == 1:
            raise ValueError("stage 1 could not build its batch")
        return torch.ones(4, requires_grad=True) * 2, None

    start = time.monotonic()
    try:
        forward_backward(step, None, nn.Identity(), 2, timeout=2.0)
    finally:
        if rank == 0:
            assert time.monotonic() - start < 20


def test_a_failing_rank_makes_its_peer_fail_with_context():
    world = World(2)  # its own world: the failed ranks leave unmatched messages behind
    try:
        with pytest.raises(DistributedTestError) as info:
            world.run(_pipeline_with_a_failing_last_stage, timeout=60)
    finally:
        world.close()
    message = str(info.value)
    assert "rank 1 (error)" in message and "stage 1 could not build its batch" in message
    assert "rank 0 (error)" in message  # not hung: it gave up after the timeout
    # rank 1 took microbatch 0's activation, then failed; rank 0 waits for its gradient, or
    # already fails while posting that receive a step ahead (before F1) if rank 1 is gone
    assert re.search(r"pipeline rank 0 before (B0|F1) failed waiting for:", message)
    assert "receive of the gradient of microbatch 0" in message
