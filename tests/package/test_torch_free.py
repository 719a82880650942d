"""What the submission side and the workers' helpers need imports without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "statement",
    [
        "from slurm_elastic.exit_codes import ExitCode, is_run_ok, describe",
        "from slurm_elastic.signals import parse_signal, preempt_signal_name",
        "from slurm_elastic.envvars import VARIABLES",
        "from slurm_elastic.config import load_config",
        "from slurm_elastic.slurm.control import SlurmControl",
        "from slurm_elastic.submit import submit, plan_submission",
        "from slurm_elastic.submit.node import run_spec",
        "from slurm_elastic import notice, events",
        # the agent starts its workers' interpreters before it imports torch
        "from slurm_elastic.agent import ExitCode, warm_workers",
    ],
)
def test_imports_without_torch(statement: str) -> None:
    code = f"import sys\n{statement}\nassert 'torch' not in sys.modules, sorted(sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_exit_code_helpers() -> None:
    from slurm_elastic.exit_codes import ExitCode, describe, is_run_ok

    assert [c for c in ExitCode if is_run_ok(c)] == [
        ExitCode.FINISHED,
        ExitCode.PREEMPTED_REQUEUED,
    ]
    assert describe(6) == "RENDEZVOUS_FAILED"
    assert describe(137) == "?"


def test_the_agent_exports_the_same_exit_codes() -> None:
    from slurm_elastic.agent import ExitCode as AgentExitCode
    from slurm_elastic.exit_codes import ExitCode

    assert AgentExitCode is ExitCode


def test_signal_parsing_forms() -> None:
    import signal

    from slurm_elastic.errors import ConfigError
    from slurm_elastic.signals import parse_signal, preempt_signal_name

    assert parse_signal("usr2") is parse_signal("SIGUSR2") is parse_signal(12)
    assert parse_signal(signal.SIGUSR1) is signal.SIGUSR1
    assert preempt_signal_name("sigusr1") == "USR1"
    with pytest.raises(ConfigError, match="'preempt_signal' = 'STOP': must be a catchable"):
        preempt_signal_name("STOP")
    with pytest.raises(ConfigError, match="'NOPE' is not a known signal"):
        parse_signal("NOPE")
