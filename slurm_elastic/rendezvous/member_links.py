"""The links of one member: which participants it watches, and which of them are gone.

:class:`MemberLinks` joins the heartbeat ring (:mod:`.heartbeat`: who this member
watches, and their published link records) with the link itself (:mod:`.link`: the
verified connections). It is used by the handler's watcher thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from slurm_elastic.rendezvous.decisions import Readable
from slurm_elastic.rendezvous.heartbeat import HeartbeatMonitor
from slurm_elastic.rendezvous.link import ProcessLink, Target
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

    def watch(self, view: Readable, nodes: dict[str, Node]) -> None:
        """Hold links to the participants among ``nodes`` (those this member watches).

        Only while this member is seated in a complete round: a lost participant breaks
        training, while a waiting node or a spare can wait for its heartbeat window. The
        link starts (and its record is published with a beat) the first time it is.
        """
        if not (view.complete and view.where(self._node) == PARTICIPANTS):
            if self._link is not None:
                self._link.watch({})
            return
        if self._link is None and not self._failed:
            try:
                self._link = ProcessLink(on_lost=self._on_lost)
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

    def verified(self) -> frozenset[str]:
        """The nodes this member holds a verified link to now (names)."""
        link = self._link
        return frozenset(link.verified()) if link is not None else frozenset()

    def close(self) -> None:
        """Close the link (after leaving: its end is then no evidence against us)."""
        link, self._link = self._link, None
        self._linked = {}
        self._monitor.link_record = b""
        if link is not None:
            link.close()
