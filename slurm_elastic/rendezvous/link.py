"""Proof that a watched agent is gone: a verified TCP connection to it, closed.

The heartbeat ring (:mod:`.heartbeat`) declares a node dead only once its counter has
stood still for the whole window (``heartbeat_interval x heartbeat_miss_limit``, 5 s by
default), because silence proves nothing sooner. Most losses are not silent, though: an
agent that is SIGKILLed, killed by the OOM killer, crashes, or whose job step is
cancelled dies on a host whose kernel is still up, and that kernel closes the process's
sockets at once. A connection held to that process then reads end-of-stream (or a
reset) within a round trip. That is proof, and it needs no window.

How, per agent (one :class:`ProcessLink`):

* A listening TCP socket (any free port, every address: the advertised name may resolve
  to another local address than the one peers reach) and a random 16-byte secret. Both
  go into the agent's heartbeat file after its counter (:attr:`ProcessLink.record`);
  that directory is private to the run's user, so only the run's agents can read the
  secret.
* A watcher holds one connection to each ring successor that it watches
  (:meth:`ProcessLink.watch`, called by the heartbeat thread with the successors it
  reads anyway). It sends a 16-byte nonce; the successor answers
  ``HMAC-SHA256(secret, "slurm_elastic link" || nonce)``. Only the process that wrote
  the record can answer: the connection is then *verified*.
* A verified connection that reads end-of-stream or an error means the successor's
  process has exited (or closed its link: it does so only after it left the
  rendezvous). :meth:`ProcessLink.lost` returns it with the record it was verified
  against; the heartbeat thread evicts the node if it is still a member *and* its
  heartbeat file still holds that record (a node that left and joined again has a new
  record, so an old connection's end never evicts it).

Silence on a verified connection is a second, weaker kind of evidence. The watcher sends
a one-byte ping every ``ping_s`` and the watched agent answers each with one byte. A
verified connection unanswered for ``silent_after_s`` (the heartbeat window) is
*silent*: :meth:`ProcessLink.silent` returns it (and the connection is dropped and
retried). Silence alone does not say whether the watched node froze (its heartbeat
stops too: the heartbeat window decides) or the network between the two broke while
both run (a partition: its heartbeat on the shared filesystem goes on). The handler
tells the two apart; :meth:`ProcessLink.reached_within` says whether anybody's traffic
reached this link lately (evidence that this side's network works). A watcher whose own
thread was held up (a starved process) shifts its clocks by the gap: it never judges
silence across its own pause.

Nothing else is evidence: a refused or unanswered connect, a wrong answer, a connection
that was never verified, or unexpected bytes only drop the connection (it is retried
after :data:`RETRY_S`, doubling with each consecutive failure up to half the heartbeat
window, with jitter); the heartbeat window still decides those cases, and every silent
loss (a frozen process, a powered-off host). An outsider who connects to a
listener gets a nonce's answer at most and is disconnected after :data:`HANDSHAKE_S`;
the listener holds at most :data:`MAX_INCOMING` connections. Sockets are not inherited
by the workers (Python sockets are close-on-exec), so an agent whose workers outlive it
still closes its links when it dies.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import logging
import os
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "ANSWER_BYTES",
    "HANDSHAKE_S",
    "MAX_INCOMING",
    "NONCE_BYTES",
    "RECORD",
    "RETRY_S",
    "ProcessLink",
    "Target",
]

log = logging.getLogger(__name__)

#: The record in a heartbeat file after the counter: the link's port and secret.
RECORD = struct.Struct(">H16s")
NONCE_BYTES = 16
ANSWER_BYTES = 32
_DOMAIN = b"slurm_elastic link"
#: A connection must complete its handshake within this (both directions).
HANDSHAKE_S = 2.0
#: A failed connect, a wrong answer or a dropped connection is retried after this.
RETRY_S = 1.0
#: At most this many incoming connections are held (a node has ~2 watchers).
MAX_INCOMING = 64
_PING = b"?"
_PONG = b"!"


@functools.cache
def _dualstack() -> bool:
    """Whether this host has dual-stack IPv6 (asked once: the test opens a socket)."""
    return socket.has_dualstack_ipv6()


def answer(secret: bytes, nonce: bytes) -> bytes:
    """The answer to ``nonce`` of the link whose secret is ``secret``."""
    return hmac.new(secret, _DOMAIN + nonce, hashlib.sha256).digest()


@dataclass(frozen=True)
class Target:
    """A watched agent's link: where it listens and the record it published."""

    addr: str
    record: bytes

    @property
    def port(self) -> int:
        return int(RECORD.unpack(self.record)[0])

    @property
    def secret(self) -> bytes:
        return bytes(RECORD.unpack(self.record)[1])


@dataclass
class _Out:
    """A connection this link holds to a watched target."""

    name: str
    target: Target
    sock: socket.socket
    nonce: bytes
    started: float
    sent: bool = False
    got: bytearray = field(default_factory=bytearray)
    verified: bool = False
    heard: float = 0.0  # when the last answer (or the verification) arrived
    pinged: float = 0.0  # when the last ping went out


@dataclass
class _In:
    """A connection a watcher holds to this link."""

    sock: socket.socket
    started: float
    got: bytearray = field(default_factory=bytearray)
    answered: bool = False


class ProcessLink:
    """This agent's listener and its connections to the successors it watches.

    Args:
        on_lost: called (on the link's thread) after a verified connection ended or
            went silent.
        silent_after_s: a verified connection unanswered this long is silent (None:
            never judged).
        ping_s: how often a verified connection is pinged.
        clock: a monotonic clock.
    """

    def __init__(
        self,
        on_lost: Callable[[], None] | None = None,
        *,
        silent_after_s: float | None = None,
        ping_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if silent_after_s is not None and silent_after_s <= 2 * ping_s:
            raise ValueError(f"silent_after_s={silent_after_s} must exceed twice ping_s={ping_s}")
        self._on_lost = on_lost
        self._silent_after = silent_after_s
        self._ping_s = ping_s
        self._clock = clock
        self._silent: list[tuple[str, Target]] = []
        self._pinged_in = -1e18  # when a watcher's ping last reached this link
        self._loop_at = clock()
        self._planned = 0.0  # how long the link's thread last meant to wait
        self._secret = os.urandom(16)
        self._lock = threading.Lock()
        self._wanted: dict[str, Target] = {}
        self._lost: list[tuple[str, Target]] = []
        self._retry_at: dict[tuple[str, bytes], float] = {}
        # Consecutive failures per target (reset when verified): the retry backs off.
        self._failures: dict[tuple[str, bytes], int] = {}
        self._retry_cap = max(RETRY_S, (silent_after_s or 8.0) / 2)
        self._out: dict[str, _Out] = {}  # the link thread's only
        self._verified: set[str] = set()  # under the lock: read by other threads
        self._heard: dict[str, float] = {}  # under the lock: name -> last answer
        self._in: dict[socket.socket, _In] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._listener = self._listen()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._thread = threading.Thread(target=self._run, name="slurm-rdzv-link", daemon=True)
        self._thread.start()

    @staticmethod
    def _listen() -> socket.socket:
        """Listen on every address (the advertised name may resolve differently here,
        e.g. to Debian's 127.0.1.1): dual-stack where IPv6 exists, else IPv4."""
        if _dualstack():
            try:
                sock = socket.create_server(
                    ("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=MAX_INCOMING
                )
            except OSError:
                sock = socket.create_server(("", 0), backlog=MAX_INCOMING)
        else:
            sock = socket.create_server(("", 0), backlog=MAX_INCOMING)
        sock.setblocking(False)
        return sock

    @property
    def record(self) -> bytes:
        """The record to publish: this link's port and secret (:data:`RECORD`)."""
        return RECORD.pack(self._listener.getsockname()[1], self._secret)

    def watch(self, targets: Mapping[str, Target]) -> None:
        """Hold verified connections to exactly ``targets`` (node name -> its link)."""
        with self._lock:
            if dict(targets) == self._wanted:
                return
            self._wanted = dict(targets)
        self._wake()

    def lost(self) -> list[tuple[str, Target]]:
        """The targets whose verified connection ended since the last call."""
        with self._lock:
            found, self._lost = self._lost, []
        return found

    def silent(self) -> list[tuple[str, Target]]:
        """The targets whose verified connection went unanswered for ``silent_after_s``
        since the last call (each connection is dropped and retried)."""
        with self._lock:
            found, self._silent = self._silent, []
        return found

    def reached_within(self, seconds: float, *, besides: Iterable[str] = ()) -> bool:
        """Whether another agent's traffic reached this link in the last ``seconds``:
        a watcher's ping, or an answer on a verified connection to a target not named in
        ``besides``."""
        now = self._clock()
        skip = set(besides)
        with self._lock:
            if now - self._pinged_in <= seconds:
                return True
            return any(now - t <= seconds for n, t in self._heard.items() if n not in skip)

    def verified(self) -> set[str]:
        """The names of the targets held by a verified connection now (for tests)."""
        with self._lock:
            return set(self._verified)

    def close(self) -> None:
        """Close the listener and every connection; stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full buffer: a wake-up is pending anyway
            self._wake_w.send(b"x")

    # -- the link's thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                self._sync()
                self._planned = self._until_due()
                for key, events in self._sel.select(timeout=self._planned):
                    try:
                        self._handle(key.data, key.fileobj, events)  # type: ignore[arg-type]
                    except Exception as exc:  # the link must outlive one bad connection
                        log.debug("rendezvous link: %s: %s", type(exc).__name__, exc)
                self._expire()
                self._ping()
        except Exception as exc:  # never take the agent down: the heartbeat still decides
            log.warning("rendezvous link stopped: %s: %s", type(exc).__name__, exc)
        finally:
            for out in list(self._out.values()):
                self._drop_out(out)
            for sock in list(self._in):
                self._drop_in(sock)
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            self._sel.close()

    def _until_due(self) -> float:
        """Seconds until something is due: a ping, a silence or handshake deadline, a
        retry (new targets and closing wake the thread through :meth:`_wake`). At most a
        ping interval. An idle link costs only its pings (it also woke every 0.5 s
        before: 0.31 ms of CPU per second per link at 2.5 s pings, 0.12 now, measured
        with 200 links in one process)."""
        now = self._clock()
        due = now + self._ping_s
        for out in self._out.values():
            if out.verified:
                due = min(due, out.pinged + self._ping_s)
                if self._silent_after is not None:
                    due = min(due, out.heard + self._silent_after)
            else:
                due = min(due, out.started + HANDSHAKE_S)
        for conn in self._in.values():
            if not conn.answered:
                due = min(due, conn.started + HANDSHAKE_S)
        with self._lock:
            wanted = set(self._wanted)
        for (name, _), at in self._retry_at.items():
            if name in wanted and name not in self._out:
                due = min(due, at)
        return max(0.0, due - now)

    def _handle(self, data: object, sock: socket.socket, events: int) -> None:
        if data == "wake":
            while True:
                try:
                    if not self._wake_r.recv(4096):
                        return
                except BlockingIOError:
                    return
        elif data == "listen":
            self._accept()
        elif isinstance(data, _In):
            self._serve(data)
        elif isinstance(data, _Out):
            self._progress(data, events)

    def _sync(self) -> None:
        """Open connections to new targets, close those no longer wanted."""
        with self._lock:
            wanted = dict(self._wanted)
        now = self._clock()
        for name, out in list(self._out.items()):
            if wanted.get(name) != out.target:
                self._drop_out(out)
        for name, target in wanted.items():
            if name in self._out or self._retry_at.get((name, target.record), 0.0) > now:
                continue
            self._connect(name, target, now)
        self._retry_at = {
            k: t for k, t in self._retry_at.items() if t > now and wanted.get(k[0]) is not None
        }
        self._failures = {
            k: n for k, n in self._failures.items() if (w := wanted.get(k[0])) and w.record == k[1]
        }

    def _connect(self, name: str, target: Target, now: float) -> None:
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                target.addr, target.port, type=socket.SOCK_STREAM
            )[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            log.debug("rendezvous link to %s: %s", name, exc)
            self._retry_at[(name, target.record)] = now + self._backoff((name, target.record))
            return
        sock.setblocking(False)
        code = sock.connect_ex(sockaddr)
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self._retry_at[(name, target.record)] = now + self._backoff((name, target.record))
            return
        out = _Out(name, target, sock, os.urandom(NONCE_BYTES), now)
        self._out[name] = out
        self._sel.register(sock, selectors.EVENT_WRITE, out)

    def _ping(self) -> None:
        """Ping every verified connection; report those silent for ``silent_after_s``."""
        now = self._clock()
        late = now - self._loop_at - self._planned
        self._loop_at = now
        # Half a second or more past its planned wake-up: this thread was held up (a
        # starved or stopped process). Judge no silence across that pause.
        if late >= max(0.5, self._planned):
            for out in self._out.values():
                out.heard += late
        silent = []
        for out in list(self._out.values()):
            if not out.verified:
                continue
            if self._silent_after is not None and now - out.heard > self._silent_after:
                silent.append(out)
                continue
            if now - out.pinged >= self._ping_s:
                try:
                    out.sock.send(_PING)
                except BlockingIOError:
                    pass  # a full buffer: the answers are late anyway
                except OSError:
                    continue  # the read side reports the end
                out.pinged = now
        for out in silent:
            with self._lock:  # reported before it stops counting as verified
                self._silent.append((out.name, out.target))
            self._retry(out)
            log.info(
                "rendezvous link: the agent of %s answered nothing for %.1f s",
                out.name,
                now - out.heard,
            )
        if silent and self._on_lost is not None:
            self._on_lost()

    def _progress(self, out: _Out, events: int) -> None:
        if not out.sent:
            code = out.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code != 0:  # refused or unreachable: not evidence
                self._retry(out)
                return
            try:
                out.sock.sendall(out.nonce)  # 16 bytes into an empty buffer
            except OSError:
                self._retry(out)
                return
            out.sent = True
            self._sel.modify(out.sock, selectors.EVENT_READ, out)
            return
        try:
            chunk = out.sock.recv(ANSWER_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if out.verified:  # answers; or end-of-stream, a reset, or bytes nobody should send
            if chunk and chunk == _PONG * len(chunk):
                out.heard = self._clock()
                with self._lock:
                    self._heard[out.name] = out.heard
                return
            if chunk:
                self._retry(out)  # not our protocol: not evidence either
                return
            with self._lock:  # reported before it stops counting as verified
                self._lost.append((out.name, out.target))
            self._drop_out(out)
            log.info("rendezvous link: the agent of %s closed its connection", out.name)
            if self._on_lost is not None:
                self._on_lost()
            return
        if not chunk:
            self._retry(out)
            return
        out.got += chunk
        if len(out.got) < ANSWER_BYTES:
            return
        if hmac.compare_digest(bytes(out.got), answer(out.target.secret, out.nonce)):
            out.verified = True
            out.heard = self._clock()
            self._failures.pop((out.name, out.target.record), None)
            with self._lock:
                self._verified.add(out.name)
                self._heard[out.name] = out.heard
        else:
            log.debug("rendezvous link to %s: a wrong answer", out.name)
            self._retry(out)

    def _retry(self, out: _Out) -> None:
        self._drop_out(out)
        key = (out.name, out.target.record)
        self._retry_at[key] = self._clock() + self._backoff(key)

    def _backoff(self, key: tuple[str, bytes]) -> float:
        """The delay before the next connection to a target after a failure: RETRY_S,
        doubling with each consecutive failure up to half the window, stretched by up
        to half at random. Watchers that failed together (a starved or overloaded
        peer, a round that formed at once) retry apart instead of in one storm: 4,096
        agents simulated on 2 cores made two connections per link they needed, each
        failed handshake adding load that failed the next."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        return min(RETRY_S * 2**failures, self._retry_cap) * random.uniform(1.0, 1.5)

    def _drop_out(self, out: _Out) -> None:
        if self._out.get(out.name) is out:
            del self._out[out.name]
            with self._lock:
                self._verified.discard(out.name)
                self._heard.pop(out.name, None)
        self._unregister(out.sock)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        if len(self._in) >= MAX_INCOMING:
            sock.close()
            return
        sock.setblocking(False)
        conn = _In(sock, self._clock())
        self._in[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _serve(self, conn: _In) -> None:
        try:
            chunk = conn.sock.recv(NONCE_BYTES if not conn.answered else 64)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk and conn.answered and chunk == _PING * len(chunk):
            try:  # a few bytes into a socket the watcher drains
                conn.sock.send(_PONG * len(chunk))
            except BlockingIOError:
                return  # a watcher that does not read: its own problem
            except OSError:
                self._drop_in(conn.sock)
                return
            with self._lock:
                self._pinged_in = self._clock()
            return
        if not chunk or conn.answered:  # the watcher went away, or spoke out of turn
            self._drop_in(conn.sock)
            return
        conn.got += chunk
        if len(conn.got) >= NONCE_BYTES:
            try:
                conn.sock.sendall(answer(self._secret, bytes(conn.got[:NONCE_BYTES])))
            except OSError:
                self._drop_in(conn.sock)
                return
            conn.answered = True

    def _drop_in(self, sock: socket.socket) -> None:
        self._in.pop(sock, None)
        self._unregister(sock)

    def _unregister(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        sock.close()

    def _expire(self) -> None:
        """Drop handshakes that did not finish in time (never evidence)."""
        limit = self._clock() - HANDSHAKE_S
        for out in list(self._out.values()):
            if not out.verified and out.started < limit:
                self._retry(out)
        for sock, conn in list(self._in.items()):
            if not conn.answered and conn.started < limit:
                self._drop_in(sock)
