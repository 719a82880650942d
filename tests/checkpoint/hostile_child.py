"""A training process for the hostile-neighbour tests (run as a script, not collected).

Usage: hostile_child.py MODE DIR [ARGS...]; prints one JSON line with what happened.

* ``save DIR STEP...``: ``CheckpointManager.from_env(DIR, keep_last=3)`` saves each step
  (the run id comes from ``$SLURM_ELASTIC_RUN_ID``, as the agent sets it for workers).
* ``resume DIR``: what a (re)started training run does: ``load_latest()``; then it trains
  on and saves three more steps after the one it resumed from (10, 20, 30 when it starts
  fresh). A refused load is reported (``refused``) and a save is still tried, to show
  that it is refused too.
* ``enomem DIR HOW``: loads under an address-space limit (``RLIMIT_AS``: 88 MiB more than
  it has) that leaves room for everything but the checkpoint's data (128 MiB): a real
  ``ENOMEM``. ``HOW`` is ``load``
  (``load_latest``) or ``verify`` (``latest_verified``, every CRC32). A run that got
  ``None`` starts fresh and saves step 10, as a training script would.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

from slurm_elastic.checkpoint.manager import CheckpointManager
from slurm_elastic.errors import CheckpointError


def state_for(step: int, nbytes: int = 1 << 16) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(nbytes // 4, generator=gen), "step": step}


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def failure(exc: BaseException) -> dict[str, str]:
    return {"error": type(exc).__name__, "message": str(exc)}


def _vm_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    mode, directory, *args = sys.argv[1:]
    torch.set_num_threads(1)
    manager = CheckpointManager.from_env(directory, keep_last=3)
    if mode == "save":
        for step in map(int, args):
            manager.save(state_for(step), step)
        report(saved=[i.step for i in manager.list_checkpoints()])
        return
    if mode == "resume":
        try:
            loaded = manager.load_latest()
        except CheckpointError as exc:
            report(refused=failure(exc))
            try:
                manager.save(state_for(999), 999)
            except CheckpointError as save_exc:
                report(save_refused=failure(save_exc))
            sys.exit(3)
        start = loaded.step if loaded is not None else 0
        run = getattr(loaded.manifest, "run", None) if loaded is not None else None
        report(resumed=start, run=run)
        for step in (start + 10, start + 20, start + 30):
            manager.save(state_for(step), step)
        report(saved=[i.step for i in manager.list_checkpoints()])
        return
    if mode == "enomem":
        (how,) = args
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + (88 << 20), hard))
        try:
            result = manager.load_latest() if how == "load" else manager.latest_verified()
        except CheckpointError as exc:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            report(raised=failure(exc))
            return
        except OSError as exc:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            report(raised={"error": type(exc).__name__, "message": str(exc), "raw": True})
            return
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        if result is None:  # "a first run": a training script starts fresh and saves
            manager.save(state_for(10, 1 << 10), 10)
            report(fresh=True)
        else:
            report(found=result.step)
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
