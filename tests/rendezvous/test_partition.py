"""A partitioned member: it runs and reaches the shared filesystem, but not its peers.

Real network namespaces (one per "node", veth pairs on a bridge, as the netns Slurm
cluster has), real handlers and gloo (harness.py). The partition is real: the node's link
is set down, so its packets are dropped without a reset, while its heartbeat goes on
writing to the shared directory. Its peers evict it once their pings to it go
unanswered for the heartbeat window (the heartbeat alone does not keep it in); while it
is cut off it does not join again; once the link is back it does.

Needs root and ``ip netns`` (CI has both: it runs the netns cluster); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_elastic.envvars import EVENTS_DIR_ENV
from tests.helpers import wait_for
from tests.rendezvous.harness import NodeProc, check_world

WINDOW = {"heartbeat_interval": "0.5", "heartbeat_miss_limit": "4"}  # 2 s
WINDOW_S = 2.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_works() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    try:
        _ip("netns", "list")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"'ip netns' does not work here: {exc}"
    return None


@dataclass
class Net:
    """Three namespaces on one bridge; ``cut(i)``/``mend(i)`` set node i's link."""

    tag: str
    subnet: str

    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def veth(self, i: int) -> str:
        return f"{self.tag}v{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{11 + i}"

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "down")

    def mend(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")


@pytest.fixture
def net() -> Iterator[Net]:
    why = _netns_works()
    if why and os.environ.get("CI"):  # CI runs as root with iproute2: a missing install
        pytest.fail(f"the partition test cannot cut links in CI: {why}")
    if why:
        pytest.skip(reason=f"cannot cut a node's link on this machine: {why}")
    rnd = os.getpid() % 200 + 20
    tag = f"sep{os.getpid() % 10000:04d}"
    net = Net(tag, f"10.217.{rnd}")
    bridge = f"{tag}br"
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{net.subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(3):
            _ip("netns", "add", net.ns(i))
            _ip(
                "link",
                "add",
                net.veth(i),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                net.ns(i),
            )
            _ip("link", "set", net.veth(i), "master", bridge, "up")
            _ip("-n", net.ns(i), "addr", "add", f"{net.addr(i)}/24", "dev", "eth0")
            _ip("-n", net.ns(i), "link", "set", "lo", "up")
            _ip("-n", net.ns(i), "link", "set", "eth0", "up")
        yield net
    finally:
        for i in range(3):
            subprocess.run(["ip", "netns", "del", net.ns(i)], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", net.veth(i)], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


@pytest.fixture
def nodes() -> Iterator[list[NodeProc]]:
    made: list[NodeProc] = []
    yield made
    for n in made:
        n.close()


def _evictions(root: Path) -> list[dict[str, object]]:
    found = []
    for path in (root / "events").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                record = json.loads(line)
                if record["kind"] == "rendezvous.evicted":
                    found.append(record)
    return found


def _formed(
    tmp_path: Path, net: Net, made: list[NodeProc], count: int, min_nodes: int
) -> tuple[list[NodeProc], list[str], list[dict[str, Any]]]:
    """``count`` nodes, one per namespace, in one world with verified links to each other."""
    env = {EVENTS_DIR_ENV: str(tmp_path / "events"), "GLOO_SOCKET_IFNAME": "eth0"}
    group = [
        NodeProc(
            tmp_path,
            "run",
            min_nodes,
            count,
            conf=WINDOW,
            env=env,
            local_addr=net.addr(i),
            netns=f"/run/netns/{net.ns(i)}",
        )
        for i in range(count)
    ]
    made.extend(group)
    names = [n.call("create")["node"] for n in group]
    for n in group:
        n.send("rdzv")
    first = [n.result(90) for n in group]
    check_world(first, count)
    for i, n in enumerate(group):
        others = sorted(m for j, m in enumerate(names) if j != i)
        wait_for(lambda n=n, o=others: n.call("linked") == o, timeout=20, what="verified links")
    return group, names, first


@pytest.mark.parametrize("victim_rank", [1, 0], ids=["non_zero_rank", "store_host"])
def test_a_partitioned_member_is_evicted_by_its_peers_and_rejoins_when_the_link_is_back(
    tmp_path: Path, net: Net, nodes: list[NodeProc], victim_rank: int
) -> None:
    group, names, first = _formed(tmp_path, net, nodes, 3, 2)
    v = next(i for i, r in enumerate(first) if r["rank"] == victim_rank)
    victim, survivors = group[v], [n for i, n in enumerate(group) if i != v]

    cut = time.monotonic()
    net.cut(v)
    for n in survivors:
        n.send("wait_change", WINDOW_S + 10)
    took = max(n.result(30) for n in survivors)
    # The window of unanswered pings, a tick of the watcher, the eviction's write.
    assert time.monotonic() - cut <= WINDOW_S + 4, time.monotonic() - cut
    evicted = _evictions(tmp_path)
    assert evicted, "nobody was evicted"
    assert {e["cause"] for e in evicted} == {"unreachable"}, evicted
    assert {name for e in evicted for name in e["nodes"]} == {names[v]}, evicted  # type: ignore[attr-defined]
    print(f"partitioned: evicted {took:.2f} s after the cut")

    for n in survivors:
        n.send("rdzv")
    check_world([n.result(60) for n in survivors], 2)

    # Cut off, the evicted node must not join again: its join waits for the network.
    victim.send("rdzv")
    t_wait = time.monotonic()
    while time.monotonic() - t_wait < 3 * WINDOW_S:  # a bounded check that nothing happens
        assert not victim.ready(), "the partitioned node completed a rendezvous"
        assert survivors[0].call("state")[2] == 2, "the partitioned node was admitted"
        time.sleep(0.2)

    net.mend(v)
    for n in survivors:
        n.send("wait_change", 60)
    for n in survivors:
        n.result(70)
    for n in survivors:
        n.send("rdzv")
    check_world([n.result(90) for n in [*survivors, victim]], 3)


def test_two_members_cut_apart_leave_one_world_and_meet_again(
    tmp_path: Path, net: Net, nodes: list[NodeProc]
) -> None:
    """Two members that only watch each other cannot tell which side was cut: after two
    windows one of them is evicted (either), the other trains alone (min 1), and they
    form a world of 2 again once the link is back."""
    pair, names, _ = _formed(tmp_path, net, nodes, 2, 1)

    cut = time.monotonic()
    net.cut(1)
    evicted = wait_for(lambda: _evictions(tmp_path), 4 * WINDOW_S + 5, "an eviction")
    assert time.monotonic() - cut <= 2 * WINDOW_S + 4, time.monotonic() - cut
    assert len(evicted) == 1 and evicted[0]["cause"] == "unreachable", evicted
    gone = names.index(evicted[0]["nodes"][0])  # type: ignore[index]
    kept, lost = pair[1 - gone], pair[gone]
    kept.send("rdzv")
    alone = kept.result(60)
    assert alone["world"] == 1, alone

    lost.send("rdzv")  # waits for the network
    net.mend(1)
    kept.send("wait_change", 60)
    kept.result(70)
    kept.send("rdzv")
    check_world([n.result(90) for n in (kept, lost)], 2)
    assert len(_evictions(tmp_path)) == 1, "the healthy side was evicted too"
