"""GPTModel trained under every pipeline schedule against the single-process run.

The same five clipped AdamW steps as ``test_gpt_layouts`` (whose tolerances and
reasons apply), with the split-backward and V-shaped schedules, tensor and sequence
parallelism, recompute and the distributed optimizer. A V puts the first and last
stage on rank 0: the tied embedding's two copies are summed there.
"""

from __future__ import annotations

import pytest

from megapp.testing import distributed
from tests.test_gpt_layouts import check_against_reference, train_layout

FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}
SELECTIVE = {"recompute_granularity": "selective"}
CASES = [
    # (world, tp, pp, vpp, schedule, distributed optimizer, config)
    (
        8,
        2,
        2,
        None,
        "zb-h1",
        True,
        {"sequence_parallel": True, "recompute_granularity": "selective"},
    ),
    (8, 2, 2, 2, "zb-v", True, {"sequence_parallel": True, **FULL_RECOMPUTE}),
    (4, 1, 4, 2, "zb-v", False, {"position_embedding_type": "rope"}),
    (8, 1, 4, None, "zb-h2", True, {"activation": "swiglu"}),
    (4, 1, 2, 2, "dualpipev", True, {"share_embeddings_and_output_weights": False}),
    (4, 1, 4, 2, "zb-h1", False, SELECTIVE),
    (4, 1, 2, 2, "looped-bfs", False, {}),
]


@pytest.mark.parametrize("world_size, tp, pp, vpp, schedule, distopt, config", CASES)
@distributed(timeout=240)
def test_schedule_matches_single_process(world_size, tp, pp, vpp, schedule, distopt, config):
    chunks, losses, norms, first_grads = train_layout(
        tp, pp, vpp, schedule=schedule, distributed_optimizer=distopt, **config
    )
    check_against_reference(chunks, losses, norms, first_grads, config)
