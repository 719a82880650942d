"""The links of one member: which participants it watches, and which of them are gone.

:class:`MemberLinks` joins the heartbeat ring (:mod:`.heartbeat`: who this member
watches, and their published link records) with the link itself (:mod:`.link`: the
verified connections). It is used by the handler's watcher thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from slurm_elastic.rendezvous.decisions import Readable
from slurm_elastic.rendezvous.heartbeat import HeartbeatMonitor
from slurm_elastic.rendezvous.link import RETRY_S, ProcessLink, Target
from slurm_elastic.rendezvous.link_probe import probe
from slurm_elastic.rendezvous.state import PARTICIPANTS, Node

__all__ = ["MemberLinks"]

log = logging.getLogger(__name__)


class MemberLinks:
    """This member's link and the participants it holds links to.

    Args:
        node: this member.
        monitor: its heartbeat monitor (reads the records; publishes this link's).
        on_lost: called on the link's thread when a verified link ended.
        run_id: for the log.
    """

    def __init__(
        self, node: Node, monitor: HeartbeatMonitor, on_lost: Callable[[], None], run_id: str
    ) -> None:
        self._node = node
        self._monitor = monitor
        self._on_lost = on_lost
        self._run_id = run_id
        self._link: ProcessLink | None = None
        self._failed = False
        self._linked: dict[str, Node] = {}  # the nodes the link watches, by name
        self._unreached: dict[str, tuple[Node, float]] = {}  # silent since (monotonic)

    def watch(self, view: Readable, nodes: dict[str, Node]) -> None:
        """Hold links to the participants among ``nodes`` (those this member watches).

        Only while this member is seated in a complete round: a lost participant breaks
        training, while a waiting node or a spare can wait for its heartbeat window. The
        link starts (and its record is published with a beat) the first time it is.
        """
        if not (view.complete and view.where(self._node) == PARTICIPANTS):
            self._unreached = {}  # judged again from the next complete round on
            if self._link is not None:
                self._link.watch({})
                self._link.silent()  # silences of the connections just dropped: stale
            return
        if self._link is None and not self._failed:
            try:
                window = self._monitor.window_s
                self._link = ProcessLink(
                    on_lost=self._on_lost,
                    silent_after_s=window,
                    # Ten pings per window (0.5 s at the default 5 s): silence is judged
                    # on the whole window, and half a window holds five (a partition's
                    # evidence). A link's steady cost is its pings: 1.5 ms of CPU per
                    # second at 4 Hz, 0.74 at 2 Hz (measured; negligible on a node,
                    # but 4,096 agents simulated on 2 cores spent 3 cores on them).
                    ping_s=window / 10,
                )
            except OSError as exc:  # the heartbeat window still detects every loss
                self._failed = True
                log.warning(
                    "rendezvous %r: no link listener (%s); a killed node is evicted "
                    "after the heartbeat window only",
                    self._run_id,
                    exc,
                )
                return
            self._monitor.link_record = self._link.record
            self._monitor.beat()
        if self._link is None:
            return
        targets: dict[str, Target] = {}
        for name, node in nodes.items():
            record = self._monitor.record_of(name)
            if record and view.where(node) == PARTICIPANTS:
                targets[name] = Target(node.addr, record)
        self._linked = {name: nodes[name] for name in targets}
        self._link.watch(targets)

    def gone(self, view: Readable) -> list[Node]:
        """The watched members whose verified link ended since the last call.

        Only a node that is still a member of ``view`` and whose heartbeat file still
        holds the record the link was verified against: a node that left (its file is
        removed first) or left and joined again (a new record) is not gone.
        """
        if self._link is None:
            return []
        dead = []
        for name, target in self._link.lost():
            node = self._linked.get(name)
            if node is None or view.where(node) is None:
                continue
            if self._monitor.read_record(name) != target.record:
                continue
            dead.append(node)
        return dead

    def silent(self, view: Readable) -> list[Node]:
        """The watched members whose verified link went unanswered for the heartbeat
        window since the last call (and that are still members, under the same record)."""
        if self._link is None:
            return []
        found = []
        for name, target in self._link.silent():
            node = self._linked.get(name)
            if node is None or view.where(node) is None:
                continue
            if self._monitor.read_record(name) != target.record:
                continue
            found.append(node)
        return found

    def unreachable(self, view: Readable) -> list[Node]:
        """The watched members that run but that this member cannot reach (a partition).

        A member whose verified link went silent (:meth:`silent`) while its heartbeat on
        the shared filesystem goes on. A silent member whose heartbeat stopped too froze
        (the heartbeat window decides it); one reached again, or no longer a member, is
        forgotten. The verdict needs evidence that the fault is not on this side: traffic
        from another agent reached this member within half the window (after the
        silence began); without any, this
        member waits one more window (two members that only watch each other cannot
        tell which side was cut; one of them is evicted then).
        """
        now = time.monotonic()
        for node in self.silent(view):
            self._unreached.setdefault(node.name, (node, now))
        if not self._unreached:
            return []
        window = self._monitor.window_s
        verified = self.verified()
        found = []
        for name, (node, since) in list(self._unreached.items()):
            if view.where(node) is None or name in verified or not self._monitor.beating(name):
                del self._unreached[name]
                continue
            # Evidence: traffic within half the window, i.e. well after the silence began.
            fresh = self.reached_within(window / 2, frozenset(self._unreached))
            if now - since >= window or fresh:
                found.append(node)
        return found

    @property
    def suspects(self) -> bool:
        """Whether a watched member's link went silent and awaits a verdict."""
        return bool(self._unreached)

    def wait_reachable(self, members: list[Node], deadline: float) -> None:
        """Return once this node reaches one of ``members`` that runs (or none runs).

        For a node evicted while it ran: cut off from its peers, it must not join again
        (the round would form with a node nobody reaches); it waits for the network.
        Reached: a member's link answered, or its host refused the connection. A member
        runs while its heartbeat counter moves; members with no link record (not seated
        in a complete round) are not asked.

        Raises:
            RendezvousTimeoutError: ``deadline`` (monotonic) passed first.
        """
        told = False
        counters: dict[str, int | None] = {}
        while True:
            targets = {}
            for node in members:
                record = self._monitor.read_record(node.name)
                if record and node != self._node:
                    targets[node.name] = Target(node.addr, record)
            if counters:  # from the second try on: only members whose heartbeat moved
                targets = {
                    n: t for n, t in targets.items() if self._monitor.counter(n) != counters[n]
                }
            if not targets or probe(targets):
                if told:
                    log.info("rendezvous %r: the network is back; joining", self._run_id)
                return
            counters = {n: self._monitor.counter(n) for n in targets}
            if not told:
                told = True
                log.warning(
                    "rendezvous %r: this node was evicted and reaches none of the running "
                    "members (%s): waiting for the network before joining again",
                    self._run_id,
                    ", ".join(sorted(targets)),
                )
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous {self._run_id!r}: this node reaches none of the members "
                    f"({', '.join(sorted(targets))}); check its network"
                )
            time.sleep(RETRY_S)

    def reached_within(self, seconds: float, besides: frozenset[str]) -> bool:
        """Whether another agent's traffic reached this member's link lately (its own
        network works), not counting the links to ``besides``."""
        link = self._link
        return link is not None and link.reached_within(seconds, besides=besides)

    def verified(self) -> frozenset[str]:
        """The nodes this member holds a verified link to now (names)."""
        link = self._link
        return frozenset(link.verified()) if link is not None else frozenset()

    def close(self) -> None:
        """Close the link (after leaving: its end is then no evidence against us)."""
        link, self._link = self._link, None
        self._linked = {}
        self._unreached = {}
        self._monitor.link_record = b""
        if link is not None:
            link.close()
