"""A worker whose training finished and whose session closed, then died of a signal in
its interpreter's exit (torch's gloo teardown aborts now and then: "terminate called
without an active exception", SIGABRT), is counted as finished by its agent; one that
died before closing is a failure. Real agents and workers; the abort itself is the seam
(tests/live/exit_abort_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from tests.live.conftest import LiveRun

WORKER = Path(__file__).resolve().parent / "exit_abort_worker.py"


@pytest.mark.parametrize(
    ("when", "expected"),
    [("after_close", ExitCode.FINISHED), ("before_close", ExitCode.FAILED)],
)
def test_an_abort_in_the_exit_after_a_finished_session_is_not_a_failure(
    tmp_path: Path, nodes: list[LiveRun], when: str, expected: ExitCode
) -> None:
    run = LiveRun(tmp_path, f"abort-{when}", "1", "a", "--abort", when, steps=6,
                  step_time=0.0, script=WORKER)  # fmt: skip
    nodes.append(run)
    code = run.wait(180)
    log = run.log()
    assert code == expected, log
    assert ("counted as finished" in log) == (expected == ExitCode.FINISHED), log
    assert "exitcode: -6" in log or "SIGABRT" in log, log  # the worker did abort
