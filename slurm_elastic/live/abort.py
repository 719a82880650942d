"""Ending a collective that waits on a node the rendezvous already evicted.

A node that dies *silently* (frozen: SIGSTOP, a hung kernel, a network partition) resets
no socket: the survivors' gloo collective waits for its full timeout (``timeout_s``,
300 s by default), although the rendezvous evicts the node after its liveness window and
the survivors' agents form the next round within a second. gloo has no abort (its
backend's ``abort``/``shutdown`` are no-ops; a ``Work.wait(timeout)`` raises while the
operation keeps running; see the project notes on torch 2.13).

What ends it: shutting down this process's own TCP connections of the blocked group.
gloo's transport then reads end-of-stream on each pair, exactly as when a peer is
SIGKILLed, and the collective raises ``Connection closed by peer`` at once; the loop's
existing failure path rolls back to the last in-memory commit and re-forms in place
(the processes, the model and the optimizer stay). The peers that are still alive see
their connections to this process closed too, so one survivor's abort frees the others.

:class:`StallGuard` decides when, on a daemon thread of each worker (the main thread is
blocked in C++ with the GIL released):

1. the agent wrote an assignment for a newer round *after its round lost a member*
   (:attr:`~slurm_elastic.live.roster.Assignment.loss_round`, newer than the group's
   round: a member left or was evicted; a later round for a newcomer carries it on), and
2. the main thread has not passed a step boundary for longer than
   ``max(min_stall_s, stall_factor x the longest of the recent steps)``.

The thread looks at the assignment only once 2 holds, and sleeps until then (at most
1 s at a time): while steps come it wakes about once a second, not every ``poll_s``
(each wake takes the GIL from the training loop's thread).

Both are needed: a graceful join or leave also brings a newer round, but the survivors
keep stepping through it (2 is false); a long step during a join is not stalled on a
lost member (1 is false). Only connections created while the group was formed
(:func:`connected_sockets` before and after ``init_process_group``) are shut down, and
only while the group is armed: :meth:`StallGuard.disarm` (called before the group is torn
down) waits for an abort in progress, so a later group's connections are never touched.

gloo only: an NCCL collective runs on the GPU and is not ended by closing sockets (its
watchdog aborts the communicator at ``timeout_s``); the guard stays off for NCCL.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from slurm_elastic import events
from slurm_elastic.channel import NodeChannel
from slurm_elastic.live import roster

__all__ = [
    "StallGuard",
    "connected_sockets",
    "connection_lost",
    "shut_down_sockets",
    "tcp_connections",
]

log = logging.getLogger(__name__)

# Step durations remembered for the stall threshold.
_RECENT_STEPS = 32
# While steps come, the thread sleeps until the next one is overdue, at most this long.
_MAX_SLEEP_S = 1.0
# tcpi_state of an established connection (linux/tcp_states.h: TCP_ESTABLISHED).
_TCP_ESTABLISHED = 1


def _socket_fds() -> dict[int, int]:
    """``{socket inode: fd}`` of this process's sockets (from ``/proc/self/fd``)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(target[8:-1])] = int(name)
    return found


def connected_sockets() -> frozenset[int]:
    """The inodes of this process's sockets (compare before and after a group forms)."""
    return frozenset(_socket_fds())


def _tcp_state(fd: int) -> int | None:
    """The TCP state of the socket open at ``fd``; ``None`` for any other socket."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return None
    finally:
        sock.close()  # the duplicate only


def tcp_connections(inodes: frozenset[int]) -> frozenset[int]:
    """The established TCP connections among ``inodes`` (a group's pairs: listeners and
    other sockets are left out)."""
    return frozenset(
        inode
        for inode, fd in _socket_fds().items()
        if inode in inodes and _tcp_state(fd) == _TCP_ESTABLISHED
    )


def connection_lost(inodes: frozenset[int]) -> bool:
    """Whether one of the connections ``inodes`` (from :func:`tcp_connections`) is closed
    or no longer established: its peer closed or reset it, or its owner (gloo, after a
    failed or timed-out operation) closed it, or this process shut it down."""
    fds = _socket_fds()
    return any(inode not in fds or _tcp_state(fds[inode]) != _TCP_ESTABLISHED for inode in inodes)


def shut_down_sockets(inodes: frozenset[int]) -> int:
    """Shut down (both directions) the still open, connected TCP sockets among ``inodes``.

    The file descriptors stay open (their owner closes them); a listening or unconnected
    socket is left alone. Returns how many were shut down.
    """
    done = 0
    for inode, fd in _socket_fds().items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            sock.getpeername()  # ENOTCONN for a listener: not a connection
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            continue
        finally:
            sock.close()  # the duplicate only; shutdown() acted on the shared socket
    return done


class StallGuard:
    """Aborts this worker's blocked gloo collective once a lost member's round is assigned.

    Args:
        channel: the node channel (its assignments).
        local_rank: this worker's local rank (names its assignment file).
        min_stall_s: never abort a step that has run for less than this.
        stall_factor: nor one shorter than this many times the longest recent step.
        poll_s: how often the thread looks.
        stuck_s: after an abort, how long the main thread may stay in the collective
            before the worker exits (see :meth:`check`).
        clock: the monotonic clock.
        exit: ends the process (``os._exit``; a test's seam).

    The main thread calls :meth:`arm` when a group is formed, :meth:`beat` at every
    step boundary, and :meth:`disarm` before the group is torn down.

    Raises:
        ValueError: a bound that is not positive.
    """

    def __init__(
        self,
        channel: NodeChannel,
        local_rank: int,
        *,
        min_stall_s: float = 1.0,
        stall_factor: float = 3.0,
        poll_s: float = 0.05,
        stuck_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        for name, value in (
            ("min_stall_s", min_stall_s),
            ("stall_factor", stall_factor),
            ("poll_s", poll_s),
            ("stuck_s", stuck_s),
        ):
            if not value > 0:
                raise ValueError(f"StallGuard {name}={value!r}: must be > 0")
        self._channel = channel
        self._local_rank = local_rank
        self.min_stall_s = min_stall_s
        self.stall_factor = stall_factor
        self._poll_s = poll_s
        self.stuck_s = stuck_s
        self._clock = clock
        self._exit = exit
        self._aborted: tuple[float, int, int] | None = None  # when, round, new round
        self._lock = threading.Lock()
        self._watch: roster.AssignmentWatch | None = None
        self._sockets: frozenset[int] = frozenset()
        self._round = -1
        self._last_beat = 0.0
        self._steps: collections.deque[float] = collections.deque(maxlen=_RECENT_STEPS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: how many collectives this guard aborted
        self.aborts = 0

    # -- main thread ------------------------------------------------------------------------

    def arm(self, round_: int, sockets: frozenset[int]) -> None:
        """Watch the group of ``round_`` whose connections are ``sockets``."""
        with self._lock:
            self._round = round_
            self._sockets = sockets
            self._watch = roster.AssignmentWatch(
                self._channel, self._local_rank, round_, min_interval_s=0.0
            )
            self._aborted = None
            self._last_beat = self._clock()
            self._steps.clear()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="slurm-elastic-stall-guard", daemon=True
            )
            self._thread.start()

    def beat(self) -> None:
        """A step boundary passed (the group is alive)."""
        now = self._clock()
        with self._lock:
            if self._watch is not None:
                self._steps.append(now - self._last_beat)
            self._last_beat = now
            self._aborted = None

    def disarm(self) -> None:
        """Stop watching (before the group is torn down); waits for an abort under way."""
        with self._lock:
            self._watch = None
            self._sockets = frozenset()
            self._aborted = None

    def close(self) -> None:
        """Stop the thread."""
        self.disarm()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._poll_s + 1.0)
            self._thread = None

    def threshold_s(self) -> float:
        """How long a step must have run to count as stalled."""
        longest = max(self._steps, default=0.0)
        return max(self.min_stall_s, self.stall_factor * longest)

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.next_look_s()):
            try:
                self.check()
            except Exception as exc:  # the guard must never take the worker down
                log.warning("stall guard check failed: %s", exc)

    def next_look_s(self) -> float:
        """How long the thread sleeps before its next look: ``poll_s`` once a step is
        overdue (or after an abort), else until it would be, at most 1 s (or ``poll_s``
        if that is longer)."""
        longest = max(self._poll_s, _MAX_SLEEP_S)
        with self._lock:
            if self._aborted is not None:
                return self._poll_s
            if self._watch is None:
                return longest
            due = self._last_beat + self.threshold_s() - self._clock()
        return min(max(self._poll_s, due), longest)

    def check(self) -> bool:
        """One look (the thread's body); return whether it aborted the collective.

        After an abort the main thread must leave the step (it raises, the loop
        re-forms: :meth:`disarm`; or it reaches a step boundary: :meth:`beat`) within
        ``stuck_s``. gloo does not always fail an operation whose connections closed: a
        send waiting for its peer's ready-to-receive can wait out the whole
        ``timeout_s``, both when the abort found nothing left to shut down (a node
        thawed after its eviction: its peers had closed every connection) and when it
        shut connections down (a ring all-reduce's ``UnboundBuffer::waitSend``, seen in
        the Slurm e2e case). Then the worker exits (status 1): its agent restarts the
        node's workers, which join the next round as newcomers and take the state from
        their peers, instead of the whole job waiting ``timeout_s`` for this node. A
        worker busy outside collectives for longer than ``stuck_s`` after an abort (a
        long validation without a collective) exits too: it cannot be told from a
        stuck one, and rejoining costs a newcomer's start, not ``timeout_s``.
        """
        with self._lock:
            if self._aborted is not None:
                aborted_at, old_round, new_round = self._aborted
                if self._clock() - aborted_at > self.stuck_s:
                    self._aborted = None
                    self._stuck(old_round, new_round)  # exits (a test's seam returns)
                return False
            watch = self._watch
            if watch is None:
                return False
            stalled = self._clock() - self._last_beat
            threshold = self.threshold_s()
            if stalled <= threshold:
                return False  # the assignment is read only when a step is overdue
            newer = watch.poll()
            if newer is None or not (newer.after_loss or newer.loss_round > self._round):
                return False
            closed = shut_down_sockets(self._sockets)
            old_round = self._round
            self._watch = None  # once per group
            self._sockets = frozenset()
            # the main thread must leave the step within stuck_s (see above)
            self._aborted = (self._clock(), old_round, newer.round)
            self.aborts += 1
        log.warning(
            "no step for %.1f s (threshold %.1f s) and round %d lost a member (round %d "
            "assigned): aborting the blocked collective (%d connections shut down)",
            stalled,
            threshold,
            old_round,
            newer.round,
            closed,
        )
        events.emit(
            events.LiveCollectiveAborted(
                round=old_round, new_round=newer.round, stalled_s=stalled, connections=closed
            )
        )
        return True

    def _stuck(self, old_round: int, new_round: int) -> None:
        log.error(
            "the step of round %d did not end within %.1f s of its collective's abort "
            "(gloo left an operation waiting after its connections closed, or the step "
            "runs no collective for that long): exiting so the agent "
            "restarts this node's workers; they rejoin in round %d or later with the "
            "state of their peers",
            old_round,
            self.stuck_s,
            new_round,
        )
        events.emit(
            events.LiveWorkerStuck(round=old_round, new_round=new_round, stuck_s=self.stuck_s)
        )
        logging.shutdown()  # flush: the exit skips the interpreter's clean-up
        self._exit(1)
