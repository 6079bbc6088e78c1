"""The A100's compute share fitted on one published source, the rest held out:
``python tools/fit_published.py`` (:mod:`megapp.ablation.published_fit` says how)."""

import sys

from megapp.ablation.published_fit import main

if __name__ == "__main__":
    sys.exit(main())
