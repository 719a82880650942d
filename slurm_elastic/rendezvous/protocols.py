"""Protocols of the rendezvous seen from the agent.

Torch's ``RendezvousHandler`` has no way to leave a run without closing it; ours does
(:meth:`slurm_elastic.rendezvous.handler.SlurmRendezvousHandler.leave`). The agent
calls it through :class:`LeavableRendezvous` instead of probing attributes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["LeavableRendezvous", "RoundReporting"]


@runtime_checkable
class LeavableRendezvous(Protocol):
    """A rendezvous this node can leave while the others carry on.

    ``leave()`` removes this node from the current and waiting membership at once, so
    the survivors re-form without waiting for the heartbeat eviction window; it does not
    close the run. Raises torch's ``RendezvousError`` or ``OSError`` when the shared
    state cannot be updated (the caller logs and carries on: peers evict it later).
    """

    def leave(self) -> None:
        """Leave the run without closing it."""
        ...


@runtime_checkable
class RoundReporting(Protocol):
    """A rendezvous that says which round ``next_rendezvous()`` last returned.

    The number is the same on every node of the round; in-place workers use it to tell a
    new assignment from a stale one. ``None`` before the first round.
    """

    @property
    def current_round(self) -> int | None:
        """The round last joined, or ``None``."""
        ...
