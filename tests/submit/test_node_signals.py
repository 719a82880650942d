"""A notice that reaches a submitit task before its agent's handlers exist is handed over.

submitit's job-side code installs its own preempt handler (checkpoint-and-requeue of the
whole job). ``run_node`` first resets it and *holds* notices until the agent takes them
(``signals.take_early_notices``), as the templates' agents do. Runs in a fresh
interpreter (signal handlers are process-wide), with a real signal sent to itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import os, signal
    ran = []
    signal.signal(signal.SIGUSR2, lambda *a: ran.append("submitit"))  # submitit's handler
    from slurm_elastic.submit.node import _reset_submitit_signals
    from slurm_elastic import signals
    _reset_submitit_signals()
    os.kill(os.getpid(), signal.SIGUSR2)  # the notice, before the agent exists
    taken = signals.take_early_notices({signal.SIGUSR2})
    print("submitit ran" if ran else "submitit did not run")
    print("taken:", [s.name for s in taken])
    """
)


def test_a_notice_before_the_agent_is_held_for_it_not_acted_on_by_submitit() -> None:
    env = {**os.environ, "SUBMITIT_EXECUTOR": "slurm"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "submitit did not run" in out.stdout, out.stdout
    assert "taken: ['SIGUSR2']" in out.stdout, out.stdout
