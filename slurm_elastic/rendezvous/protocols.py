"""Protocols of the rendezvous seen from the agent.

Torch's ``RendezvousHandler`` has no way to leave a run without closing it; ours does
(:meth:`slurm_elastic.rendezvous.handler.SlurmRendezvousHandler.leave`). The agent
calls it through :class:`LeavableRendezvous` instead of probing attributes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

__all__ = ["LeavableRendezvous", "RoundReporting", "RoundWatching", "SeatKeeping"]


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


@runtime_checkable
class RoundWatching(Protocol):
    """A rendezvous that tells whether the round last joined is still whole.

    ``round_lost()`` is true once a member of that round left or was evicted, the round
    moved on, or the run was closed. The agent asks it while it waits on the round's
    store for the other members (rank assignment): a member that died after the round
    completed would otherwise be waited for until the store times out.
    """

    def round_lost(self) -> bool:
        """Whether the round last joined is broken."""
        ...

    def round_moved_on_in_place(self) -> bool:
        """Whether the round last joined moved on only because a member re-joined with
        the seats kept (``SeatKeeping``) for newcomers: this node is seated in the next
        round and no member was lost. ``round_lost()`` is true then too; the agent of
        workers that are still starting waits for them instead of restarting them."""
        ...


@runtime_checkable
class SeatKeeping(Protocol):
    """A rendezvous whose members can re-join with their seats kept.

    Inside ``keeping_seat()``, a re-join from this node's completed round reopens that
    round as the next one with all its members seated (newcomers get only the seats
    left), instead of torch's exit-then-join. For an in-place change only: the members'
    workers still train, so none of them may be left out by newcomers. A restart (the
    workers stopped, perhaps because a member died) uses torch's exit-then-join, so a
    dead member is never carried into the next round.
    """

    def keeping_seat(self) -> AbstractContextManager[None]:
        """A context in which ``next_rendezvous()`` keeps this round's members seated."""
        ...
