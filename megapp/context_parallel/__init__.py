"""Context parallelism: the sequence split over ranks, attention across them.

- :mod:`~megapp.context_parallel.layout`: which tokens each cp rank holds (the
  load-balanced causal split), splitting, gathering and position ids;
- :mod:`~megapp.context_parallel.ring`: ring attention (``comm_type="p2p"``);
- :mod:`~megapp.context_parallel.all_gather`: keys and values all-gathered;
- :mod:`~megapp.context_parallel.a2a`: Ulysses all-to-all of sequence and heads;
- :mod:`~megapp.context_parallel.blocks`: the attention arithmetic they share;
- :func:`attention`: the front that checks inputs and picks one of them.

See docs/context_parallel.md.
"""

from megapp.context_parallel.attention import COMM_TYPES, attention
from megapp.context_parallel.layout import gather, merge, positions, split

__all__ = ["COMM_TYPES", "attention", "gather", "merge", "positions", "split"]
