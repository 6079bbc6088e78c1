"""Mixture-of-experts GPT under the pipeline schedules beyond 1F1B, against the
single-process run.

Expert layers change what a pipeline carries (each microbatch's auxiliary losses join its
backward, the experts' weights may defer their gradients to a split backward's W), so
every schedule family trains pp 2 × ep 2 (dp 2, four ranks) to the same five steps as the
single-process model: interleaved and looped 1F1B, GPipe, the split-backward zero-bubble
schedules and the V schedules. The held quantities and tolerances are those of
``test_moe_training``.
"""

from __future__ import annotations

import pytest

from megapp.testing import distributed
from tests.support import MOE_CONFIG, check_against_reference, train_layout

# The full suite only: the fast tier holds every schedule on the dense GPT and experts
# under 1F1B.
pytestmark = pytest.mark.slow
CASES = [
    # (world, pp, vpp, schedule, model config beyond MOE_CONFIG)
    pytest.param(4, 2, 2, "interleaved-1f1b", {}, id="interleaved"),
    pytest.param(4, 2, None, "zb-h1", {}, id="zb-h1"),
    pytest.param(4, 2, 2, "zb-v", {}, id="zb-v"),
    pytest.param(
        4,
        2,
        2,
        "dualpipev",
        {"share_embeddings_and_output_weights": False},
        id="dualpipev",
    ),
    pytest.param(4, 2, None, "gpipe", {}, id="gpipe"),
    pytest.param(4, 2, 2, "looped-bfs", {}, id="looped-bfs"),
    pytest.param(4, 2, None, "zb-h2", {}, id="zb-h2"),
]


@pytest.mark.parametrize("world_size, pp, vpp, schedule, config", CASES)
@distributed(timeout=240)
def test_moe_schedule_matches_single_process(world_size, pp, vpp, schedule, config):
    config = {**MOE_CONFIG, **config}
    chunks, losses, norms, first_grads = train_layout(1, pp, vpp, ep=2, schedule=schedule, **config)
    check_against_reference(chunks, losses, norms, first_grads, config)
