"""Exit when the launcher is gone.

torchrun's agent starts the workers and stops them when one fails. If the agent itself is
killed (``kill -9``, a lost node), its workers are orphaned: they would keep computing, or
wait in a collective until the timeout, holding GPUs. A daemon thread notices that the
parent process changed and ends the worker with one line on stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def exit_with_launcher(prog: str, poll_s: float = 1.0) -> bool:
    """Under torchrun, watch the agent and exit with status 1 once it is gone.

    Returns whether a watch was started (not for a plain ``python`` launch or SLURM's
    srun, which stops its tasks itself).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    launcher = os.getppid()
    rank = os.environ.get("RANK", "?")

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        print(
            f"{prog}: error: rank {rank}: its launcher (torchrun, pid {launcher}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="megapp-launcher-watch", daemon=True).start()
    return True
