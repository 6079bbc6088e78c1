"""Write the report of an ablation sweep: ``python tools/ablation_report.py runs/ablation``
(:mod:`megapp.ablation.report` says what it holds)."""

import sys

from megapp.ablation.report import main

if __name__ == "__main__":
    sys.exit(main())
