"""pretrain_gpt.py on one rank of a job launched by hand, one rank of which gets stuck.

    python tests/stuck_rank_job.py MODE STUCK_RANK STUCK_CALL MARKER -- <pretrain_gpt.py flags>

Every rank runs ``pretrain_gpt.main``; rank STUCK_RANK, at its STUCK_CALL-th forward step,
writes the time to MARKER and then, by MODE, stops itself (``stop``: SIGSTOP), stops
calling collectives while staying alive (``sleep``) or dies (``kill``: SIGKILL). The
torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) comes from
the caller.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from megapp.testing.pretrain_world import pretrain_script

pretrain_gpt = pretrain_script()


def main() -> None:
    mode, stuck_rank, stuck_call, marker = sys.argv[1:5]
    flags = sys.argv[sys.argv.index("--") + 1 :]
    rank, calls = int(os.environ["RANK"]), 0
    forward_step = pretrain_gpt.forward_step

    def stuck_forward_step(*args, **kwargs):
        nonlocal calls
        calls += 1
        if rank == int(stuck_rank) and calls == int(stuck_call):
            Path(marker).write_text(f"{time.time()}\n")
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                time.sleep(3600)
        return forward_step(*args, **kwargs)

    pretrain_gpt.forward_step = stuck_forward_step
    pretrain_gpt.main(flags)


if __name__ == "__main__":
    main()
