"""One real worker of a 3-rank gloo round, for tests/live/test_failed_group.py.

Usage: failed_group_worker.py RANK PORT TIMEOUT_S DIR

Joins the way the loop joins in place (LiveWorld's own store connection, group init and
DDP wrap), commits, writes ``DIR/ready<RANK>``, then:

* rank 0 stays silent (a frozen or cut-off node: alive, its connections open, it never
  enters another collective);
* rank 2 enters an ``all_reduce`` (it waits for rank 0 too), writes ``DIR/entered2``,
  and waits for the test to SIGKILL it;
* rank 1 (the survivor under test) starts an asynchronous ``all_reduce`` (the vote cast
  at a step's entry: it waits for the silent rank 0), writes ``DIR/entered1``, then
  waits in a ``broadcast`` from rank 2, which fails when rank 2 is killed. It recovers
  as the loop does (:meth:`LiveWorld.recover`, which raises at once here: no agent
  assigns a next round), drops the vote, and writes ``DIR/result.json``: what the
  failure was, and how long the recovery and the failed group's end took.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_elastic.errors import ReformTimeoutError
from slurm_elastic.live.world import is_peer_failure
from tests.live.gloo_round import assignment, live_world


def main() -> None:
    rank, port, timeout_s, out = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        Path(sys.argv[4]),
    )
    live = live_world(timeout_s)
    a = assignment(rank, 3, port)
    live._join(a, live._connect(a))
    live.wrap()
    live.commit(0)
    dist.barrier()
    (out / f"ready{rank}").write_text("")
    if rank == 0:
        time.sleep(600)  # silent: the test kills it at the end
        return
    if rank == 2:
        pending = dist.all_reduce(torch.ones(1), async_op=True)
        (out / "entered2").write_text("")
        time.sleep(600)  # SIGKILLed by the test
        del pending
        return
    vote = dist.all_reduce(torch.ones(1), async_op=True)  # waits for the silent rank 0
    (out / "entered1").write_text("")
    try:
        dist.broadcast(torch.zeros(1), src=2)  # fails when the test kills rank 2
        failure: dict[str, object] = {"type": None, "peer_failure": False}
    except RuntimeError as exc:
        failure = {"type": type(exc).__name__, "peer_failure": is_peer_failure(exc)}
    waiting = not vote.is_completed()  # the precondition: it waits for rank 0
    started = time.monotonic()
    raised = None
    try:
        live.recover(str(failure["type"]))
    except ReformTimeoutError as exc:
        raised = type(exc).__name__
    # The vote's collective still waited for the silent rank 0; it must end now (on
    # gloo's thread) rather than at the group's timeout: whichever reference to the
    # failed group goes last, its destructor joins that thread.
    while not vote.is_completed() and time.monotonic() - started < timeout_s / 2:
        time.sleep(0.01)
    ended_s = time.monotonic() - started
    vote_failed = None  # still waiting
    if vote.is_completed():
        try:
            vote.wait()
            vote_failed = False
        except RuntimeError:
            vote_failed = True
    result = {
        **failure,
        "raised": raised,
        "vote_waiting": waiting,
        "vote_ended_s": ended_s,
        "vote_failed": vote_failed,
    }
    (out / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown of torch's objects is not under test


if __name__ == "__main__":
    main()
