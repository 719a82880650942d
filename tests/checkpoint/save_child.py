"""Child process for the kill-mid-save tests (run as a script, not collected by pytest).

Usage: save_child.py DIR POINT MODE MARKER

Saves step 1 completely, then starts saving step 2 (``MODE`` = ``sync`` or ``async``) with a
testing hook that, at write-path point ``POINT``, creates ``MARKER`` and blocks forever, so
the test can SIGKILL this process at exactly that point.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.manager import CheckpointManager


def state_for(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    # 8 MiB of tensor data: several write() calls, so "mid_data" is really mid-way.
    return {"w": torch.randn(2048, 1024, generator=gen), "step": step}


def main() -> None:
    directory, point, mode, marker = sys.argv[1:5]
    torch.set_num_threads(1)

    armed = threading.Event()

    def hook(reached: str) -> None:
        if armed.is_set() and reached == point:
            Path(marker).write_text(reached)
            threading.Event().wait()  # wait to be SIGKILLed

    _faults.install(hook)  # the test seam: block at POINT, to be SIGKILLed there
    manager = CheckpointManager(directory, keep_last=3)
    manager.save(state_for(1), 1)
    armed.set()  # only now: step 1 must complete
    state = state_for(2)
    manager.save(state, 2, blocking=(mode == "sync"))
    if mode == "async":
        state["w"].add_(1.0)  # training goes on while the write is in flight
        manager.flush()


if __name__ == "__main__":
    main()
