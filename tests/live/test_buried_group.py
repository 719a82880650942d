"""A failed gloo group's teardown does not wait for an operation still running on it.

Seen in tests/e2e/test_slurm_e2e.py's fault-tolerant case (2026-12-05; stacks in
docs/live.md, Limits): after a worker was killed, a survivor re-formed in place, then
hung for the group's whole timeout where its old DDP wrapper was dropped: the reducer
held the failed group, whose destructor joined gloo's thread, still in an operation of
the failed step (a send that shutting the connections down did not end). Now the
failed group is kept (``links.bury``) until its operations have timed out.

Real processes and a real gloo group over a real TCPStore; the silent peer is a live
process that never joins the collective (tests/live/buried_group_worker.py).
"""

from __future__ import annotations

import subprocess
import sys
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from slurm_elastic.live import links
from tests.helpers import wait_for

WORKER = Path(__file__).with_name("buried_group_worker.py")

pytestmark = pytest.mark.timeout(180)


def test_tearing_down_a_failed_group_does_not_wait_for_its_operations(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    done = tmp_path / "done"
    outs = [tmp_path / f"rank{r}.out" for r in (0, 1)]
    procs = []
    try:
        for rank, out in enumerate(outs):
            with open(out, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(store.port), str(rank), str(done)],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        # the operation waits 20 s for rank 1; before, the teardown waited with it
        line = wait_for(
            lambda: next((x for x in outs[0].read_text().splitlines() if "TOOK" in x), None),
            60,
            f"rank 0's teardown\n{outs[0].read_text() if outs[0].exists() else ''}",
        )
        assert float(line.split()[1]) < 5.0, line
    finally:
        done.touch()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


class _Remains:
    pass


def test_buried_objects_are_released_at_the_first_prune_after_their_time() -> None:
    remains = _Remains()
    ref = weakref.ref(remains)
    links.bury(remains, 0.3)
    del remains
    assert links.prune() >= 1 and ref() is not None  # kept: its time has not come
    wait_for(lambda: links.prune() >= 0 and ref() is None, 10, "the release after 0.3 s")
