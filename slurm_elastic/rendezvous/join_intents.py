"""Contention-free joining: per-node *join intents* merged by one writer per batch.

When N nodes arrive at once and each adds itself to the shared state with its own
compare-and-set, all but one lose each attempt, re-read and retry: the metadata
operations per node grow with N. Here a node that must be *added* (to the
participants, the waiting list or the spares: :func:`~.decisions.decide_join` decides
which) instead posts an intent file ``intents/<node>`` (one ``open``) and claims the
merge at the state's current generation with one exclusive ``mkdir`` of
``intents/.merge.<generation>``. The one winner lists the pending intents and merges
them all into the state with **one** compare-and-set (:func:`~.decisions.merge`: for
each node exactly what its own join would decide); the losers only poll ``head``
(nobody else lists the directory). Merged nodes see themselves in the state and
withdraw their intent (one ``unlink``). Nodes still pending after a merge claim the
next generation. A claimant that dies is replaced: a node pending for longer than the
takeover delay claims ``intents/.merge.<generation>.<slot>`` (one winner per slot of the
takeover delay) and merges (a compare-and-set race with a slow first winner at worst,
never a fork). Each winner removes the claims of older generations.
"""

from __future__ import annotations

import json
import logging

from slurm_elastic.rendezvous.filesystem import RendezvousDir
from slurm_elastic.rendezvous.heartbeat import node_file_name
from slurm_elastic.rendezvous.state import Node

__all__ = ["IntentBoard"]

log = logging.getLogger(__name__)


class IntentBoard:
    """The era's ``intents`` directory.

    Args:
        directory: the checked ``intents`` directory of the era.
    """

    def __init__(self, directory: RendezvousDir) -> None:
        self._dir = directory

    @staticmethod
    def name(node: Node) -> str:
        """The intent file name of ``node``."""
        return node_file_name(node.name)

    def post(self, node: Node) -> None:
        """Post ``node``'s intent to join (one ``open``)."""
        record = {"addr": node.addr, "pid": node.pid, "local_id": node.local_id}
        self._dir.write_in_place(self.name(node), json.dumps(record).encode())

    def withdraw(self, name: str) -> None:
        """Remove the intent ``name`` (missing is fine)."""
        try:
            self._dir.remove(name)
        except OSError as exc:
            log.debug("could not withdraw join intent %s: %s", name, exc)

    def names(self) -> list[str]:
        """The names of the posted intents (sorted; one listing)."""
        return sorted(n for n in self._dir.listdir() if not n.startswith("."))

    @staticmethod
    def _claim_name(generation: int, slot: int | None) -> str:
        return f".merge.{generation}" if slot is None else f".merge.{generation}.{slot}"

    def claim(self, generation: int, *, slot: int | None = None) -> bool:
        """Claim the merge of the intents pending at state ``generation`` (one ``mkdir``).

        Exactly one caller per generation wins; the others wait for the merge instead
        of listing the directory (N pending nodes each listing N intents is O(N^2)).
        ``slot``: a takeover's claim (one winner per generation and slot), made when
        the first winner has not merged within the takeover time.
        """
        return self._dir.claim(self._claim_name(generation, slot))

    def release_claims(self, below: int) -> None:
        """Remove the merge claims of generations older than ``below`` (one listing)."""
        for name in self._dir.listdir():
            if name.startswith(".merge."):
                try:
                    old = int(name[7:].split(".", 1)[0])
                except ValueError:
                    continue
                if old < below:
                    self._dir.rmdir(name)

    def read(self, name: str) -> Node | None:
        """The node of intent ``name``, or None when missing or malformed."""
        try:
            raw = self._dir.read(name, limit=4096)
            if not raw:
                return None
            rec = json.loads(raw)
            node = Node(rec["addr"], rec["pid"], rec["local_id"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("skipping join intent %s: %s", name, exc)
            return None
        return node if self.name(node) == name else None
