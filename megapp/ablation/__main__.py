"""``python -m megapp.ablation --config sweep.toml --out DIR``: run an ablation sweep."""

import sys

from megapp.ablation.command import main

sys.exit(main(prog="-m megapp.ablation"))
