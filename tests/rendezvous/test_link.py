"""The link between a watcher and the agent it watches (``rendezvous/link.py``).

Real sockets and real processes: a watched agent killed with SIGKILL, an impostor on the
published port, a listener that never answers. Only a verified connection that ends is
evidence; everything else leaves the decision to the heartbeat window.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from slurm_elastic.rendezvous import link as link_mod
from slurm_elastic.rendezvous import link_probe
from slurm_elastic.rendezvous.link import RECORD, ProcessLink, Target
from tests.helpers import wait_for

_CTX = mp.get_context("fork")


@pytest.fixture
def links() -> Iterator[list[ProcessLink]]:
    made: list[ProcessLink] = []
    yield made
    for link in made:
        link.close()


def _new(made: list[ProcessLink], **kwargs: object) -> ProcessLink:
    link = ProcessLink(**kwargs)  # type: ignore[arg-type]
    made.append(link)
    return link


def _serve_link(conn: Connection) -> None:
    link = ProcessLink()
    conn.send(link.record)
    time.sleep(600)  # killed by the test


def test_a_killed_agents_link_is_reported_lost_at_once(links: list[ProcessLink]) -> None:
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_serve_link, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30)
        record = parent.recv()
        woken: list[float] = []
        watcher = _new(links, on_lost=lambda: woken.append(time.monotonic()))
        target = Target("127.0.0.1", record)
        watcher.watch({"victim": target})
        wait_for(lambda: watcher.verified() == {"victim"}, timeout=10, what="a verified link")
        assert watcher.lost() == []
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(lambda: woken, timeout=5, what="the loss reported")
        assert woken[0] - killed < 1.0, woken[0] - killed
        assert watcher.lost() == [("victim", target)]
        assert watcher.lost() == [], "a loss is reported once"
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def test_a_closed_link_ends_its_watchers_connection(links: list[ProcessLink]) -> None:
    watched = _new(links)
    watcher = _new(links)
    target = Target("127.0.0.1", watched.record)
    watcher.watch({"a": target})
    wait_for(lambda: watcher.verified() == {"a"}, timeout=10, what="a verified link")
    watched.close()
    wait_for(lambda: watcher.verified() == set(), timeout=5, what="the link ended")
    assert watcher.lost() == [("a", target)]


def test_unwatching_drops_the_connection_without_a_loss(links: list[ProcessLink]) -> None:
    watched = _new(links)
    watcher = _new(links)
    watcher.watch({"a": Target("127.0.0.1", watched.record)})
    wait_for(lambda: watcher.verified() == {"a"}, timeout=10, what="a verified link")
    watcher.watch({})
    wait_for(lambda: watcher.verified() == set(), timeout=5, what="the link dropped")
    watched.close()
    time.sleep(0.3)  # nothing can arrive: nothing watches it any more
    assert watcher.lost() == []


def _impostor(listener: socket.socket, reply: bytes | None) -> None:
    """Accept one connection on ``listener``; read the nonce, send ``reply``, close."""
    listener.settimeout(10)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(10)
        conn.recv(16)
        if reply is not None:
            conn.sendall(reply)
        time.sleep(0.2)


@pytest.mark.parametrize("reply", [b"\0" * 32, None], ids=["wrong_answer", "no_answer"])
def test_a_listener_that_cannot_answer_is_never_evidence(
    links: list[ProcessLink], reply: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone else on the published port (the agent died and another process took the
    port): its end proves nothing about the node, so nothing is reported."""
    import threading

    monkeypatch.setattr(link_mod, "HANDSHAKE_S", 0.5)
    listener = socket.create_server(("127.0.0.1", 0))
    record = RECORD.pack(listener.getsockname()[1], os.urandom(16))
    woken: list[float] = []
    watcher = _new(links, on_lost=lambda: woken.append(1.0))
    server = threading.Thread(target=_impostor, args=(listener, reply), daemon=True)
    server.start()
    watcher.watch({"a": Target("127.0.0.1", record)})
    server.join(15)
    listener.close()
    time.sleep(1.0)  # past the handshake limit and the impostor's close
    assert watcher.verified() == set()
    assert watcher.lost() == [] and woken == []


def test_nothing_listening_is_never_evidence(links: list[ProcessLink]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connecting is refused
    watcher = _new(links)
    watcher.watch({"a": Target("127.0.0.1", RECORD.pack(port, os.urandom(16)))})
    time.sleep(0.5)
    assert watcher.verified() == set() and watcher.lost() == []


def test_failed_connections_are_retried_with_growing_delays(links: list[ProcessLink]) -> None:
    """A target that takes every connection and closes it unanswered (a peer whose link
    is not up yet, or an overloaded one) is retried after RETRY_S, then twice that, up
    to half the window: with a fixed delay, 4,096 simulated agents retried in a storm
    that failed the next handshakes. Lower bounds only: load can only lengthen a gap."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    record = RECORD.pack(listener.getsockname()[1], os.urandom(16))
    watcher = _new(links, silent_after_s=10.0)  # the cap: 5 s, beyond this test's gaps
    watcher.watch({"a": Target("127.0.0.1", record)})
    accepted: list[float] = []
    try:
        while len(accepted) < 4:
            conn, _ = listener.accept()  # raises after 20 s without a connection
            accepted.append(time.monotonic())
            conn.close()  # never answers the nonce: the handshake fails
    finally:
        listener.close()
    gaps = [b - a for a, b in itertools.pairwise(accepted)]
    floor = link_mod.RETRY_S * 0.95  # the clock's and the select's granularity
    assert gaps[0] >= floor and gaps[1] >= 2 * floor and gaps[2] >= 4 * floor, gaps
    assert watcher.verified() == set() and watcher.lost() == []


def test_the_listener_answers_only_with_its_secret(links: list[ProcessLink]) -> None:
    """A client gets the HMAC of its own nonce, never the secret; a silent client is
    disconnected after the handshake limit."""
    watched = _new(links)
    port, secret = RECORD.unpack(watched.record)
    nonce = os.urandom(16)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(nonce)
        got = b""
        while len(got) < 32:
            chunk = s.recv(32)
            assert chunk
            got += chunk
    assert got == link_mod.answer(secret, nonce)
    assert secret not in got
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        started = time.monotonic()
        assert s.recv(1) == b""  # closed by the listener
        assert time.monotonic() - started < link_mod.HANDSHAKE_S + 2.0


def test_no_listener_socket_is_inherited_by_a_child(links: list[ProcessLink]) -> None:
    """Workers forked by the agent must not keep its link open after it died."""
    link = _new(links)
    port = RECORD.unpack(link.record)[0]
    inheritable = [
        fd
        for fd in map(int, os.listdir("/proc/self/fd"))
        if _is_socket_on(fd, port) and os.get_inheritable(fd)
    ]
    assert inheritable == []


def _is_socket_on(fd: int, port: int) -> bool:
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return s.getsockname()[1:2] == (port,)
    except (OSError, IndexError, TypeError):
        return False
    finally:
        s.close()


# -- silence: pings unanswered for the window (frozen, or cut off) --------------------


def _serving_process() -> tuple[mp.process.BaseProcess, bytes]:
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_serve_link, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(30)
    return proc, parent.recv()


def test_an_answering_link_is_never_silent(links: list[ProcessLink]) -> None:
    proc, record = _serving_process()
    try:
        watcher = _new(links, silent_after_s=0.6, ping_s=0.1)
        watcher.watch({"a": Target("127.0.0.1", record)})
        wait_for(lambda: watcher.verified() == {"a"}, timeout=10, what="a verified link")
        deadline = time.monotonic() + 3.0  # five windows of answered pings
        while time.monotonic() < deadline:
            assert watcher.silent() == [] and watcher.lost() == []
            assert watcher.verified() == {"a"}
            time.sleep(0.1)
        assert watcher.reached_within(0.5), "the answers are evidence of this side's network"
        assert not watcher.reached_within(0.5, besides=["a"])
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def test_a_frozen_agents_link_goes_silent_after_the_window(links: list[ProcessLink]) -> None:
    """SIGSTOP: the connection stays open (no end, no reset), only the answers stop."""
    proc, record = _serving_process()
    try:
        woken: list[float] = []
        watcher = _new(
            links, on_lost=lambda: woken.append(time.monotonic()), silent_after_s=1.0, ping_s=0.1
        )
        target = Target("127.0.0.1", record)
        watcher.watch({"a": target})
        wait_for(lambda: watcher.verified() == {"a"}, timeout=10, what="a verified link")
        stopped = time.monotonic()
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: woken, timeout=10, what="the silence reported")
        # The window counts from the last answer, which came up to a ping before the stop.
        assert 1.0 - 0.1 - 0.05 <= woken[0] - stopped < 2.5, woken[0] - stopped
        assert watcher.silent() == [("a", target)]
        assert watcher.lost() == [], "silence is not an end"
        assert watcher.verified() == set(), "a silent connection is dropped (and retried)"
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: watcher.verified() == {"a"}, timeout=10, what="verified again")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def _watch_and_report(conn: Connection, record: bytes) -> None:
    watcher = ProcessLink(silent_after_s=0.6, ping_s=0.1)
    watcher.watch({"a": Target("127.0.0.1", record)})
    while True:
        cmd = conn.recv()
        conn.send((sorted(watcher.verified()), watcher.silent()))
        if cmd == "last":
            return


def test_a_watcher_that_was_itself_paused_reports_no_silence() -> None:
    """A starved or stopped watcher must not judge the time it did not run."""
    proc, record = _serving_process()
    parent, child = _CTX.Pipe()
    watcher = _CTX.Process(target=_watch_and_report, args=(child, record), daemon=True)
    watcher.start()
    try:

        def verified() -> bool:
            parent.send("ask")
            assert parent.poll(10)
            return bool(parent.recv()[0] == ["a"])

        wait_for(verified, timeout=10, what="the watcher's verified link")
        os.kill(watcher.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        time.sleep(2.0)  # more than three windows: what is judged is this pause
        os.kill(watcher.pid, signal.SIGCONT)  # type: ignore[arg-type]
        time.sleep(0.5)  # a few of its loops after the pause (pings answered)
        parent.send("last")
        assert parent.poll(10)
        names, silent = parent.recv()
        assert silent == [] and names == ["a"], (names, silent)
    finally:
        for p in (proc, watcher):
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            p.join(10)


def test_a_probe_reaches_a_live_link_and_a_refusing_host() -> None:
    proc, record = _serving_process()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    try:
        reached = link_probe.probe(
            {
                "live": Target("127.0.0.1", record),
                "refused": Target("127.0.0.1", RECORD.pack(closed_port, os.urandom(16))),
            },
            timeout_s=5,
        )
        assert reached == {"live", "refused"}
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
