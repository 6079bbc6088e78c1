"""Measured peak memory of layouts against the planner's: ``python tools/check_memory_model.py
[--layout "tp=2, pp=2, dp=2"]`` (:mod:`megapp.ablation.memory_check` says what it runs)."""

import sys

from megapp.ablation.memory_check import main

if __name__ == "__main__":
    sys.exit(main())
