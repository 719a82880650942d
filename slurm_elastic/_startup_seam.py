"""Test seam: pause a job's start-up at a named phase (private; off unless a test sets it).

The early-notice tests (``tests/faults/test_early_notice.py``) must send the notice at a
chosen phase of a task's start-up, not at whatever moment a poll happens to catch. With
``SLURM_ELASTIC_TEST_PAUSE_AT=<phase>`` and ``SLURM_ELASTIC_TEST_PAUSE_DIR=<dir>`` in the
job's environment, the process that reaches ``<phase>`` writes ``<dir>/<phase>.reached``
(its pid) and waits until ``<dir>/<phase>.go`` exists; the test sends the notice
between the two. The job script's phases (``setup``, ``exec``) are the same protocol in
shell (``sbatch_templates/elastic_array.sbatch``); the agent's are :data:`PHASES`.

Without the variable :func:`pause` returns at once: production never waits here. The
wait polls a file because it is a test's rendezvous with this process, not a product
delay; it gives up after :data:`MAX_PAUSE_S` so that a test that died cannot hold a job
forever. A notice handler that raises (the agent's) ends the wait early, as it would
end any other work of that phase.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from slurm_elastic.envvars import TEST_PAUSE_AT_ENV, TEST_PAUSE_DIR_ENV

__all__ = ["MAX_PAUSE_S", "PHASES", "pause"]

log = logging.getLogger(__name__)

#: The agent's phases: before its notice handler exists (``agent_start``), in a formed
#: round before its workers start (``rendezvous``), and with its workers just started
#: (``workers_start``); a worker's: ``ElasticSession.start`` before it registers with its
#: agent or joins its first group (``worker_open``).
PHASES = ("agent_start", "rendezvous", "workers_start", "worker_open")
MAX_PAUSE_S = 300.0
_POLL_S = 0.02


def pause(phase: str) -> None:
    """Wait at ``phase`` for the test's go-ahead when the test asked for this phase."""
    if os.environ.get(TEST_PAUSE_AT_ENV) != phase:
        return
    where = Path(os.environ.get(TEST_PAUSE_DIR_ENV) or ".")
    (where / f"{phase}.reached").write_text(f"{os.getpid()}\n")
    log.warning("test seam: paused at %s until %s exists", phase, where / f"{phase}.go")
    deadline = time.monotonic() + MAX_PAUSE_S
    while not (where / f"{phase}.go").exists() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
