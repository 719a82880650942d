"""The notice as Slurm really delivers it: to *every* process of the node's step (issue #22
item 8), no Slurm (the real agent, real workers, real ``DataLoader`` worker processes).

A signal that is not batch-only (``scancel --signal=USR2 JOB`` without ``--batch``,
``--signal=USR2@lead`` without ``B:``) reaches the agent, its training
workers *and* their forked ``DataLoader`` workers at once. ``SIGUSR2``'s default action
is to terminate: a loader worker that has no handler dies, and the training process'
loop raises (``DataLoader worker ... is killed by signal``) before its next step
boundary, so the checkpoint the notice asks for is never written.

``examples/train_own_loop.py`` (the README's own-loop shape: an ``ElasticSession``, a
``DataLoader(num_workers=2)`` per epoch, no explicit handler installed; with
``worker_init_fn=notice.loader_worker_init``, and ``plain``: without, as in the README)
runs on one agent with two workers; the test sends ``SIGUSR2`` to every process of the agent's tree, as
slurmstepd does, and asserts: no loader worker could die of it (each catches or ignores
it) and none did (no such error in the log), both ranks checkpoint at their next step
boundary and the agent exits PREEMPTED (outside Slurm it has nothing to requeue); the
checkpoint verifies and holds the last step trained; a second agent of the same run
resumes from it and finishes with every sample once per epoch, no step redone, and the
parameters of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from slurm_elastic.checkpoint import CheckpointManager
from slurm_elastic.events import read_events
from tests.helpers import process_tree, survives_signal, wait_for
from tests.live.conftest import (
    REPO,
    LiveRun,
    assert_each_sample_once,
    ledger,
    redone_steps,
    steps_done,
)
from tests.live.test_own_loop import _assert_close_to_reference

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = REPO / "examples" / "train_own_loop.py"
STEPS = 240
LOADER_DEATH = ("killed by signal", "exited unexpectedly")


def loader_workers(agent: int) -> dict[int, list[int]]:
    """Each training worker of ``agent`` -> its processes (the loader's workers)."""
    tree = process_tree(agent)
    workers = [p for p in tree if _ppid(p) == agent]
    return {w: [p for p in process_tree(w) if p != w] for w in workers}


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def events(tmp: Path, run_id: str, kind: str) -> list[dict]:
    directory = tmp / "state" / "events" / run_id
    return [e for e in read_events(directory) if e["kind"] == kind] if directory.exists() else []


@pytest.mark.parametrize("loader", ["worker-init", "plain"])
def test_a_notice_to_every_process_still_checkpoints_and_loses_nothing(
    tmp_path: Path, nodes: list[LiveRun], loader: str
) -> None:
    run_id = "notice-all"
    args = ["--num-workers", "2", *(["--plain-loader"] if loader == "plain" else [])]
    a = LiveRun(tmp_path, run_id, "1", "a", *args, steps=STEPS, script=SCRIPT)
    nodes.append(a)
    pid = a.proc.pid
    # training, and both workers have their two loader workers (an epoch in progress)
    found = wait_for(
        lambda: (
            steps_done(tmp_path) >= 5
            and (w := loader_workers(pid))
            and len(w) == 2
            and all(len(v) == 2 for v in w.values())
            and w
        ),
        120,
        "two workers training with two DataLoader workers each",
        interval=0.05,
    )
    loaders = [p for v in found.values() for p in v]
    # what the notice will meet: a loader worker that neither catches nor ignores it dies
    exposed = [p for p in loaders if survives_signal(p, signal.SIGUSR2) is False]
    # every process of the tree, as slurmstepd signals the processes of a step
    for target in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGUSR2)
    code = a.wait(150)
    log = a.log()
    assert not [line for line in log.splitlines() if any(d in line for d in LOADER_DEATH)], (
        f"a DataLoader worker died of the notice\n{log[-4000:]}"
    )
    assert not exposed, f"DataLoader workers {exposed} could die of SIGUSR2 (default action)"
    assert code == ExitCode.PREEMPTED, log[-4000:]
    # both ranks saved on the notice, at their next step boundary: the last step trained
    preempted = events(tmp_path, run_id, "train.preempted")
    assert {e["rank"] for e in preempted} == {0, 1}, preempted
    last = steps_done(tmp_path)
    assert {e["step"] for e in preempted} == {last}, (preempted, last)
    saved = [e["step"] for e in events(tmp_path, run_id, "checkpoint.saved")]
    assert last in saved, saved
    loaded = CheckpointManager(tmp_path / "state" / "checkpoints" / run_id).load_latest()
    assert loaded is not None and loaded.step == last, loaded
    # a second agent of the run resumes from it: nothing lost, nothing redone
    b = LiveRun(tmp_path, run_id, "1", "b", *args, steps=STEPS, script=SCRIPT)
    nodes.append(b)
    assert b.wait(180) == ExitCode.FINISHED, b.log()[-4000:]
    records = ledger(tmp_path)
    assert min(r["step"] for r in records if r["pid"] not in found) == last + 1
    assert redone_steps(records) == 0
    assert_each_sample_once(records, STEPS)
    _assert_close_to_reference(tmp_path)
