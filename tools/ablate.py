"""Run an ablation sweep: ``python tools/ablate.py --config sweep.toml --out runs/ablation``
(``--help`` for every flag; :mod:`megapp.ablation.command` says what a sweep records)."""

import sys

from megapp.ablation.command import main

if __name__ == "__main__":
    sys.exit(main())
