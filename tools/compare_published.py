"""Published Megatron runs against megapp's planner: ``python tools/compare_published.py``
(:mod:`megapp.ablation.published` says how each run is predicted)."""

import sys

from megapp.ablation.published import main

if __name__ == "__main__":
    sys.exit(main())
