"""Mixture of experts with expert parallelism.

- :mod:`~megapp.moe.config`: :class:`MoEConfig`, the layer's validated settings;
- :mod:`~megapp.moe.router`: logits, the choice of k experts (softmax or sigmoid scores);
- :mod:`~megapp.moe.aux_losses`: load-balancing and z-losses, attached for backward;
- :mod:`~megapp.moe.capacity`: expert capacity and which pairs are dropped;
- :mod:`~megapp.moe.permutation`: sorting pairs by expert and back, the all-to-all layout;
- :mod:`~megapp.moe.dispatch`: moving pairs to the experts' ranks (all-to-all, all-gather);
- :mod:`~megapp.moe.experts`: a rank's experts as grouped matmuls (or a loop);
- :mod:`~megapp.moe.shared_experts`: the always-on shared expert;
- :class:`MoELayer`: all of them, in place of the dense MLP.

See docs/moe.md.
"""

from megapp.moe.config import MoEConfig
from megapp.moe.layer import MoELayer, layer_losses

__all__ = ["MoEConfig", "MoELayer", "layer_losses"]
