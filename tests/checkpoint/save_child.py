"""Child process for the kill-mid-save tests (run as a script, not collected by pytest).

Usage: save_child.py DIR POINT MODE MARKER

Saves step 1 completely, then (``MODE``):

* ``sync`` / ``async``: saves step 2 blocking / non-blocking;
* ``resave``: saves step 2, then saves step 2 again (a re-save of an existing step);
* ``retention``: with ``keep_last=1`` saves step 2, whose retention deletes step 1;
* ``fsize``: sets ``RLIMIT_FSIZE`` to 5 MiB with ``SIGXFSZ`` at its default action (Python
  ignores it by default) and saves 6 MiB as step 2: the kernel kills this process mid-write.

A fault hook (``slurm_elastic.checkpoint._faults``) creates ``MARKER`` at write-path point
``POINT`` and blocks forever, so the test can SIGKILL this process at exactly that point.
"""

from __future__ import annotations

import resource
import signal
import sys
import threading
from pathlib import Path

import torch

from slurm_elastic.checkpoint import _faults
from slurm_elastic.checkpoint.manager import CheckpointManager

MiB = 1 << 20


def state_for(step: int, nbytes: int = 8 * MiB) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    # 8 MiB of tensor data: several write() calls, so "mid_data" is really mid-way.
    return {"w": torch.randn(nbytes // 4096, 1024, generator=gen), "step": step}


def main() -> None:
    directory, point, mode, marker = sys.argv[1:5]
    torch.set_num_threads(1)

    armed = threading.Event()

    def hook(reached: str) -> None:
        if armed.is_set() and reached == point:
            Path(marker).write_text(reached)
            threading.Event().wait()  # wait to be SIGKILLed

    _faults.install(hook)  # the test seam: block at POINT, to be SIGKILLed there
    manager = CheckpointManager(directory, keep_last=1 if mode == "retention" else 3)
    if mode == "fsize":
        manager.save(state_for(1, MiB), 1)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (5 * MiB, 5 * MiB))
        manager.save(state_for(2, 6 * MiB), 2)
        sys.exit("the file-size limit did not stop the save")
    manager.save(state_for(1), 1)
    if mode == "resave":
        manager.save(state_for(2), 2)
    armed.set()  # only now: the saves above must complete
    state = state_for(2)
    manager.save(state, 2, blocking=(mode != "async"))
    if mode == "async":
        # training goes on while the write is in flight: an optimizer step changes the
        # saved tensor in place (its guard first waits for the staging copy)
        param = torch.nn.Parameter(state["w"])
        param.grad = torch.ones_like(param)
        torch.optim.SGD([param], lr=1.0).step()
        manager.flush()


if __name__ == "__main__":
    main()
