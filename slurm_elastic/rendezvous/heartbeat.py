"""Dead-node detection by heartbeat *counters*, watched around a ring.

Torch's keep-alive writes the writer's wall-clock time into the shared state and every
reader compares it with its own clock, so clock skew shifts detection, and every node
rewrites the whole state each interval. Here instead:

* every member increments a counter in its own file ``hb/<node>`` every interval
  (written in place: one ``open`` per beat); after the counter, a seated member's file
  holds its link record (:mod:`.link`: a killed agent is found at once through it,
  while this window decides every silent loss);
* every member watches only its ring *successors* (members sorted by name): it walks
  them in order and stops after ``successors`` of them that look alive, so a member
  reads ``successors`` files per observation in the steady state (more only while some
  are failing), whatever the number of nodes; it observes once per interval while all
  of them beat and twice while one looks stalled (:attr:`HeartbeatMonitor.calm`);
* a watched node is dead when its counter has not changed for ``miss_limit`` of the
  *watcher's* intervals, measured with the watcher's monotonic clock. Remote clocks
  are never compared, only observed changes.

A watcher only remembers nodes it watched at its previous pass: a node that comes
back into its watch set gets a fresh baseline, so it is never declared dead from an
old observation. When a dead node is evicted the ring closes over it and its watcher
moves on to the next successors, so any surviving member eventually evicts every dead
one after it.

:class:`HeartbeatMonitor` is pure logic plus two file operations, with an injectable
clock and reader so its edge cases are tested without sleeping.
"""

from __future__ import annotations

import logging
import re
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_elastic.rendezvous.filesystem import RendezvousDir
from slurm_elastic.rendezvous.link import RECORD

__all__ = ["HeartbeatMonitor", "Tick", "WatchSchedule", "node_file_name"]

log = logging.getLogger(__name__)

_COUNTER = struct.Struct(">Q")


def node_file_name(node: str) -> str:
    """Return the heartbeat file name of node ``node`` (a safe path component)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", node)[:200]


def _link_record(raw: bytes) -> bytes:
    """The link record after the counter of a heartbeat file, ``b""`` when absent."""
    end = _COUNTER.size + RECORD.size
    return bytes(raw[_COUNTER.size : end]) if len(raw) >= end else b""


@dataclass
class _Observation:
    value: int | None
    changed_at: float
    seen_at: float


class HeartbeatMonitor:
    """Beat for one node and judge the liveness of its ring successors.

    Args:
        directory: the era's ``hb`` directory (a checked :class:`RendezvousDir`; a path is
            opened and checked).
        node: this node's name (its heartbeat file name derives from it).
        interval_s: the beat and observation interval.
        miss_limit: unchanged intervals after which a watched node is dead.
        successors: how many live-looking successors each member watches.
        clock: a monotonic clock (injectable for tests).
        reader: reads a node's counter, None when absent (injectable for tests).
    """

    def __init__(
        self,
        directory: RendezvousDir | Path,
        node: str,
        *,
        interval_s: float,
        miss_limit: int,
        successors: int = 2,
        clock: Callable[[], float] = time.monotonic,
        reader: Callable[[str], int | None] | None = None,
    ) -> None:
        self._dir = (
            directory
            if isinstance(directory, RendezvousDir)
            else RendezvousDir.open_tree(directory)
        )
        self.node = node
        self._interval = interval_s
        self._miss_limit = miss_limit
        self._successors = max(1, successors)
        self._clock = clock
        self._reader = reader or self._read_counter
        self._counter = 0
        self._seen: dict[str, _Observation] = {}
        self._calm = False
        #: Written after the counter in every beat: this agent's link record (.link).
        self.link_record = b""
        self._records: dict[str, bytes] = {}

    @property
    def window_s(self) -> float:
        """How long a counter may stand still before its node is declared dead."""
        return self._interval * self._miss_limit

    @property
    def calm(self) -> bool:
        """Whether the next observation may wait a whole interval, not half of one.

        True when every node of the last observation beat lately and none is dead, and
        the window is at least 4 intervals. A node that stops then looks suspect 1.5 to
        2.5 intervals after its last beat, from when its watcher observes every half
        interval again: a verdict still lags the window by at most half an interval,
        while a calm ring costs half the reads (heartbeat files and ``head``).
        """
        return self._calm

    def beating(self, node: str) -> bool:
        """Whether ``node``'s counter moved lately, as this watcher last observed it.

        Lately: within two intervals, or half the window if that is shorter. False for
        a node this watcher does not watch now.
        """
        obs = self._seen.get(node)
        if obs is None:
            return False
        return self._clock() - obs.changed_at < min(2 * self._interval, self.window_s / 2)

    def beat(self) -> None:
        """Increment and write this node's counter (one ``open``)."""
        self._counter += 1
        try:
            self._dir.write_in_place(
                node_file_name(self.node), _COUNTER.pack(self._counter) + self.link_record
            )
        except OSError as exc:  # a missed beat is survivable; a crash of the thread is not
            log.warning("could not write heartbeat %s: %s", self._dir, exc)

    def reset(self) -> None:
        """Forget every observation (after this watcher paused, e.g. left and rejoined)."""
        self._seen.clear()
        self._calm = False

    def remove(self) -> None:
        """Delete this node's heartbeat file (graceful leave)."""
        try:
            self._dir.remove(node_file_name(self.node))
        except OSError as exc:
            log.debug("could not remove heartbeat file: %s", exc)

    def _read_file(self, node: str) -> bytes | None:
        try:
            raw = self._dir.read(node_file_name(node), limit=64)
        except OSError:
            return None
        if raw is None or len(raw) < _COUNTER.size:
            return None
        return raw

    def _read_counter(self, node: str) -> int | None:
        raw = self._read_file(node)
        if raw is None:
            self._records.pop(node, None)
            return None
        self._records[node] = _link_record(raw)
        return int(_COUNTER.unpack_from(raw)[0])

    def counter(self, node: str) -> int | None:
        """``node``'s counter as its heartbeat file holds it now (None: no file)."""
        return self._reader(node)

    def record_of(self, node: str) -> bytes:
        """``node``'s link record as last read by an observation (``b""``: none)."""
        return self._records.get(node, b"")

    def read_record(self, node: str) -> bytes:
        """``node``'s link record as its heartbeat file holds it now (``b""``: none)."""
        raw = self._read_file(node)
        return b"" if raw is None else _link_record(raw)

    def observe(self, members: Sequence[str]) -> list[str]:
        """Watch this node's successors among ``members``; return the dead ones.

        Args:
            members: every member of the rendezvous (any order; this node included
                or not). The ring is their sorted order.

        Returns:
            The watched nodes whose counter stood still for the whole window.
        """
        ring = sorted(set(members) | {self.node})
        start = ring.index(self.node)
        return self.observe_ring(ring[start + 1 :] + ring[:start])

    def observe_ring(self, successors: Iterable[str]) -> list[str]:
        """Watch the nodes after this one in ring order; return the dead ones.

        Args:
            successors: the other members in ring order starting after this node
                (consumed lazily: only as far as needed, usually ``successors`` items).

        Returns:
            The watched nodes whose counter stood still for the whole window.
        """
        now = self._clock()
        suspect_after = self._interval * 1.5
        # A pause: an interval more than the gap the last observation asked for.
        paused_after = self._interval * (2.0 if self._calm else 1.5)
        seen: dict[str, _Observation] = {}
        dead: list[str] = []
        healthy = suspect = 0
        for node in successors:
            if node == self.node or node in seen:
                continue
            value = self._reader(node)
            previous = self._seen.get(node)
            if previous is not None and now - previous.seen_at > paused_after:
                previous = None  # this watcher paused: start afresh, never judge across it
            if previous is None:
                obs = _Observation(value, now, now)
            elif previous.value != value:
                # The change happened between the two observations: take the midpoint,
                # an unbiased estimate made with this watcher's clock only.
                obs = _Observation(value, (previous.seen_at + now) / 2, now)
            else:
                obs = _Observation(value, previous.changed_at, now)
            seen[node] = obs
            still = now - obs.changed_at
            if still >= self.window_s:
                dead.append(node)
            elif still < suspect_after:
                healthy += 1
                if healthy >= self._successors:
                    break
            else:
                suspect += 1
        self._calm = self._miss_limit >= 4 and not dead and not suspect
        self._seen = seen
        self._records = {n: r for n, r in self._records.items() if n in seen}
        return dead


@dataclass(frozen=True)
class Tick:
    """What one tick of the watcher does: always observe; ``beat`` also; ``probe``: read
    past ``head`` too."""

    beat: bool
    probe: bool


class WatchSchedule:
    """When the watcher thread beats and observes.

    Ticks are half an interval apart; every 2nd beats (one beat per interval, as the
    window assumes) and every 4th probes past ``head``. Every tick observes, except that
    after a calm observation (:attr:`HeartbeatMonitor.calm`) the next tick without a
    beat is skipped: a calm watcher wakes once per interval. :meth:`hurry` takes the
    skipped tick back (a link reported something to judge). The first tick is the first
    beat's, one interval after the start: before its first observation a watcher has
    nothing suspect to follow up, so it starts as a calm one goes on. (It observed half an
    interval earlier before: a verdict on a node already dead at the start now comes half
    an interval later, and a starting agent makes one observation fewer while its round
    forms, when every agent reads the shared filesystem most.)

    Args:
        interval_s: the beat interval.
        clock: a monotonic clock (injectable for tests).
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._half = interval_s / 2
        self._clock = clock
        self._ticks = 1
        self._skipped = False
        # The caller has just beaten: the first tick (a beat and an observation) is one
        # interval later.
        self._due = clock() + interval_s

    def wait_s(self) -> float:
        """Seconds until the next tick is due (0: now)."""
        return max(0.0, self._due - self._clock())

    def tick(self) -> Tick | None:
        """The tick that is due now, None before it is (the next is then planned from
        now: a held-up watcher does not catch up in a burst)."""
        now = self._clock()
        if now < self._due:
            return None
        self._ticks += 1
        self._skipped = False
        self._due = now + self._half
        return Tick(beat=self._ticks % 2 == 0, probe=self._ticks % 4 == 0)

    def observed(self, calm: bool) -> None:
        """Report the observation of the tick just taken: calm skips the next beatless
        tick."""
        if calm and self._ticks % 2 == 0:
            self._ticks += 1
            self._due += self._half
            self._skipped = True

    def hurry(self) -> None:
        """Take back a skipped tick: observe again half an interval after the last."""
        if self._skipped:
            self._skipped = False
            self._ticks -= 1
            self._due -= self._half
