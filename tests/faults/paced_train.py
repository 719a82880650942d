"""examples/train_ddp.py with two test seams the fault matrix needs (nothing else changes).

* **Pace**: ``--pace-file PATH``: the per-step ``--step-time`` sleep happens only while
  PATH exists. The test keeps training slow while it injects faults, then removes the
  file and the run finishes at full speed: a run is as long as its faults need, no
  longer, and no fault can hit a run that already ended.
* **Which example**: ``--train-module NAME`` (default ``train_ddp``) runs another
  example of ``examples/`` with train_ddp's command line and a module-level ``time``
  (the harness passes ``$FAULTS_TRAIN_MODULE``): the in-place example of issue #11 once
  merged.
* **Slow checkpoint write**: ``--hold-write-file PATH``: while PATH exists, rank 0's
  checkpoint writer creates ``PATH.writing`` and sleeps at the ``mid_data`` point of the
  write (half the state file written; the checkpoint code's private test seam
  ``slurm_elastic.checkpoint._faults``). The test SIGKILLs the worker there: a real kill
  during a real write, not a simulated one.

The training computation is untouched (the sleep and the hook do not touch tensors), so
the final parameters still equal an uninterrupted run's.
"""

from __future__ import annotations

import importlib
import os
import sys
import time as _time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from slurm_elastic.checkpoint import _faults


def _pop(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


class _PacedTime:
    """Stands in for the ``time`` module inside train_ddp: ``sleep`` obeys the pace file."""

    def __init__(self, pace_file: str | None) -> None:
        self.pace_file = pace_file

    @staticmethod
    def time() -> float:
        return _time.time()

    def sleep(self, seconds: float) -> None:
        if self.pace_file is None or os.path.exists(self.pace_file):
            _time.sleep(seconds)


def main() -> int:
    argv = sys.argv[1:]
    # which example to run: train_ddp (the restart path) or, once issue #11 is merged,
    # an in-place example with the same command line (--train-module)
    train_ddp = importlib.import_module(_pop(argv, "--train-module") or "train_ddp")
    pace = _pop(argv, "--pace-file")
    hold = _pop(argv, "--hold-write-file")
    train_ddp.time = _PacedTime(pace)  # type: ignore[assignment]
    if hold is not None:

        def hook(point: str) -> None:
            if point == "mid_data" and os.path.exists(hold):
                Path(f"{hold}.writing").write_text(str(os.getpid()))
                while os.path.exists(hold):
                    _time.sleep(0.05)

        _faults.install(hook)
    return train_ddp.main(argv)


if __name__ == "__main__":
    sys.exit(main())
