"""A killed member is evicted by its watcher's link, without waiting out the window.

Real processes, real handlers and gloo (harness.py). The heartbeat window here is long
(0.5 s x 40 = 20 s) so that an eviction within a couple of seconds can only be the
link's. A frozen member (SIGSTOP: its sockets stay open) and a member that leaves
gracefully are never evicted by a link.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.envvars import EVENTS_DIR_ENV
from tests.helpers import wait_for
from tests.rendezvous.harness import NodeProc, check_world, rdzv_all

LONG_WINDOW = {"heartbeat_interval": "0.5", "heartbeat_miss_limit": "40"}  # 20 s


@pytest.fixture
def nodes() -> Iterator[list[NodeProc]]:
    made: list[NodeProc] = []
    yield made
    for n in made:
        with_cont(n)
        n.close()


def with_cont(n: NodeProc) -> None:
    if n.proc.is_alive():
        os.kill(n.proc.pid, signal.SIGCONT)


def _spawn(made: list[NodeProc], count: int, root: Path, conf: dict[str, str]) -> list[NodeProc]:
    env = {EVENTS_DIR_ENV: str(root / "events")}
    new = [NodeProc(root, "run", 2, count, conf=conf, env=env) for _ in range(count)]
    made.extend(new)
    names = [n.call("create")["node"] for n in new]
    for n, name in zip(new, names, strict=True):
        n.name = name  # type: ignore[attr-defined]
    return new


def _linked(group: list[NodeProc]) -> None:
    """Wait until every member holds a verified link to every other (3 nodes, 2 successors)."""
    for n in group:
        others = sorted(m.name for m in group if m is not n)  # type: ignore[attr-defined]
        wait_for(lambda n=n, o=others: n.call("linked") == o, timeout=15, what="verified links")


def _evictions(root: Path) -> list[dict[str, object]]:
    found = []
    for path in (root / "events").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                record = json.loads(line)
                if record["kind"] == "rendezvous.evicted":
                    found.append(record)
    return found


@pytest.mark.parametrize("victim_rank", [1, 0], ids=["non_zero_rank", "store_host"])
def test_a_killed_member_is_evicted_by_its_link(
    tmp_path: Path, nodes: list[NodeProc], victim_rank: int
) -> None:
    group = _spawn(nodes, 3, tmp_path, LONG_WINDOW)
    first = rdzv_all(group)
    check_world(first, 3)
    _linked(group)
    victim = next(n for n, r in zip(group, first, strict=True) if r["rank"] == victim_rank)
    survivors = [n for n in group if n is not victim]
    killed = time.monotonic()
    victim.kill()
    for n in survivors:
        n.call("wait_change", 10)
    took = time.monotonic() - killed
    assert took < 2.0, f"eviction took {took:.2f} s; the heartbeat window is 20 s"
    second = rdzv_all(survivors)
    check_world(second, 2)
    evicted = _evictions(tmp_path)
    assert evicted and {e["cause"] for e in evicted} == {"link"}, evicted
    assert {name for e in evicted for name in e["nodes"]} == {victim.name}  # type: ignore[attr-defined]


def test_a_frozen_member_is_left_to_the_heartbeat_window(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    """SIGSTOP keeps its sockets open: no link ends, the window (4 s here) decides."""
    group = _spawn(nodes, 3, tmp_path, {"heartbeat_interval": "0.5", "heartbeat_miss_limit": "8"})
    check_world(rdzv_all(group), 3)
    _linked(group)
    frozen, survivors = group[2], group[:2]
    frozen.call("stop")
    wait_for(
        lambda: Path(f"/proc/{frozen.proc.pid}/stat").read_text().split()[2] == "T",
        timeout=5,
        what="the node stopped",
    )
    stopped = time.monotonic()
    took = survivors[0].call("wait_change", 20)
    assert took >= 3.0, f"evicted after {took:.2f} s: before the 4 s window"
    assert time.monotonic() - stopped < 12
    wait_for(lambda: _evictions(tmp_path), timeout=10, what="the eviction event")
    assert {e["cause"] for e in _evictions(tmp_path)} == {"heartbeat"}


def test_a_member_that_leaves_and_rejoins_is_never_evicted_by_its_old_link(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    group = _spawn(nodes, 3, tmp_path, LONG_WINDOW)
    check_world(rdzv_all(group), 3)
    _linked(group)
    leaver, survivors = group[2], group[:2]
    leaver.call("leave")  # closes its link after it left: no evidence against it
    for n in survivors:
        n.call("wait_change", 10)
    second = rdzv_all(group)  # the leaver joins again, with a new link
    check_world(second, 3)
    _linked(group)
    time.sleep(1.0)  # a few watcher ticks: a stale loss would have evicted it by now
    assert all(n.call("waiting") == 0 for n in group)
    assert _evictions(tmp_path) == []


def test_an_in_place_re_formation_after_a_loss_skips_the_grace(
    tmp_path: Path, nodes: list[NodeProc]
) -> None:
    """The survivors re-join keeping their seats (in place): all of them are seated by the
    first one back and nobody arrives, so the round does not wait ``reform_grace``
    (set to 3 s here) to gather arrivals."""
    conf = {**LONG_WINDOW, "reform_grace": "3", "last_call_timeout": "5"}
    group = _spawn(nodes, 3, tmp_path, conf)
    check_world(rdzv_all(group), 3)
    _linked(group)
    victim, survivors = group[2], group[:2]
    victim.kill()
    for n in survivors:
        n.call("wait_change", 10)
    for n in survivors:
        n.send("rdzv_seated")
    second = [n.result(30) for n in survivors]
    check_world(second, 2)
    took = max(r["took"] for r in second)
    assert took < 1.5, f"the re-formation took {took:.2f} s: it waited the 3 s grace"
