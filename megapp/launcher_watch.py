"""Exit when the launcher is gone.

torchrun's agent starts the workers and stops them when one fails. If the agent itself is
killed (``kill -9``, a lost node), its workers are orphaned: they would keep computing, or
wait in a rendezvous or a collective until a timeout, holding GPUs. A daemon thread
notices that the parent process changed and ends the worker with one line on stderr.

This module imports nothing but the standard library, so that ``pretrain_gpt.py`` starts
the watch on its first line, before the seconds that importing torch takes: a launcher
killed at any moment of a worker's life is noticed.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_watched: list[int] = []  # the launcher's pid, once a watch runs in this process


def _is_python(pid: int) -> bool | None:
    """Whether process ``pid`` runs a Python interpreter (None where /proc cannot say)."""
    try:
        name = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except PermissionError:  # another user's process, or init: its name says enough
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as comm:
                name = comm.read().strip()
        except OSError:
            return None
    except OSError:
        return None
    return any(word in name for word in ("python", "pypy", "torchrun"))


def _gone(prog: str, what: str) -> None:
    rank = os.environ.get("RANK", "?")
    line = f"{prog}: error: rank {rank}: {what}; exiting\n"
    if sys.stderr is not None:
        sys.stderr.flush()
    # one write of the whole line to fd 2: ranks sharing torchrun's stderr pipe may leave
    # at the same moment, and a line under PIPE_BUF written at once is never split
    os.write(2, line.encode())
    os._exit(1)


def exit_with_launcher(prog: str, poll_s: float = 0.2) -> bool:
    """Under torchrun, watch the agent and exit with status 1 once it is gone; at once if
    it is gone already (the process was adopted by a parent that is not Python, as
    torchrun's agent always is). Calling it again keeps the first watch.

    Returns whether a watch runs (not for a plain ``python`` launch or SLURM's srun, which
    stops its tasks itself).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if _watched:
        return True
    launcher = os.getppid()
    if _is_python(launcher) is False:
        _gone(prog, "its launcher (torchrun) died while it started")
    _watched.append(launcher)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        _gone(prog, f"its launcher (torchrun, pid {launcher}) is gone")

    threading.Thread(target=watch, name="megapp-launcher-watch", daemon=True).start()
    return True
