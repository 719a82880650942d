"""The TCP connections of this process's current gloo group (its pairs), and what they tell.

One set per process, as the process group is: :class:`~slurm_elastic.live.world.LiveWorld`
records them when a group forms (and after it wraps the model: an HSDP mesh adds
subgroups) and forgets them when the group goes. They tell a lost peer from a bug
(:func:`is_peer_failure`), and they end the collectives still in flight on a group that
failed (:func:`abandon`).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from slurm_elastic.errors import PeerLostError
from slurm_elastic.live.abort import connection_lost, shut_down_sockets, tcp_connections

__all__ = ["abandon", "bury", "forget", "is_gloo", "is_peer_failure", "prune", "record"]

#: the established connections of the current gloo group (empty: none, or not gloo)
_connections: frozenset[int] = frozenset()
#: failed groups' objects, each kept until its monotonic deadline (see :func:`bury`)
_buried: list[tuple[float, object]] = []


def is_gloo(backend: str) -> bool:
    """Whether ``backend`` is gloo (its connections are this process's sockets)."""
    return "gloo" in backend.lower()


def record(inodes: frozenset[int]) -> None:
    """The current group's sockets: its established TCP connections are kept."""
    global _connections
    _connections = tcp_connections(inodes)


def forget() -> None:
    """The current group is gone: its connections are no one's business any more."""
    global _connections
    _connections = frozenset()


def abandon() -> int:
    """The current group failed: shut down its connections, so that every collective
    still in flight on it ends now. Returns how many were shut down.

    A failed step can leave more than the collective that raised in flight: the
    step-boundary vote cast at the step's entry, or a DDP bucket, on gloo's other
    thread. One waiting on a silent peer (frozen, cut off) would wait out the group's
    ``timeout_s``, and the group's destructor joins the thread running it while holding
    the GIL (so nothing else in the worker runs meanwhile, not even the stall guard).
    Shutting the connections down ends it as a peer's death would (``live/abort.py``);
    the group is not used again. Not always: a send waiting for its peer's
    ready-to-receive can wait out its timeout all the same (seen in
    ``tests/e2e/test_slurm_e2e.py``'s fault-tolerant case, 2026-12-05), so the failed
    group's objects are kept (:func:`bury`) rather than destroyed on the way.
    """
    return shut_down_sockets(_connections)


def bury(remains: object, timeout_s: float) -> None:
    """Keep a failed gloo group's process groups referenced for ``timeout_s``: the
    group's operations' own timeout, after which none of them can still run.

    The last reference to a gloo group runs its destructor, which joins the threads
    of its operations while holding the GIL. After a failure one of them can still
    wait (see :func:`abandon`): a worker whose old DDP wrapper (its reducer held the
    group) was dropped after the new group formed hung there until that operation timed
    out (``timeout_s``; its peers blocked in their next collective meanwhile; the stacks:
    docs/live.md, Limits). Kept here, the groups outlive the wrapper (whose
    reducer goes at once, its autograd hooks with it) and are released by :func:`prune`
    at a step boundary once their time has passed: a group's handles, no tensor.
    """
    _buried.append((time.monotonic() + timeout_s, remains))


def prune() -> int:
    """Release what :func:`bury` kept whose time has passed; return how many remain."""
    if not _buried:
        return 0
    now = time.monotonic()
    kept = [entry for entry in _buried if entry[0] > now]
    if len(kept) < len(_buried):
        _buried[:] = kept  # the released objects' destructors run here: nothing waits
    return len(_buried)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective or store (a peer gone), not a bug.

    By the exception's type, never its message:

    * torch's ``DistError`` family: ``DistNetworkError`` (a store connection failed: the
      store's host is gone, or a connect timed out), ``DistStoreError`` (a store wait
      timed out: a peer never wrote its key, e.g. its gloo address during
      ``init_process_group``), ``DistBackendError`` (NCCL's errors);
    * :class:`~slurm_elastic.errors.PeerLostError` (:meth:`LiveWorld._join`: a gloo group
      that could not form);
    * a plain ``RuntimeError`` (exactly that type, no subclass) while a connection of the
      current gloo group is lost. torch 2.13 and 2.14.1 raise gloo's transport errors as
      plain ``RuntimeError`` from ``Work.wait()`` (``dist.all_reduce``/``broadcast``/
      ``all_gather``/``barrier``, and DDP's reducer inside ``loss.backward()``): a peer
      that died ("Connection closed by peer", "Connection reset by peer") and an
      operation that timed out ("Timed out waiting ... for recv"). That is the type a
      shape mismatch has too; what tells them apart is the transport: gloo closes the
      pair of a failed operation before it raises (measured for all three in
      ``tests/live/test_peer_failure.py``), a bug leaves every connection established.
    """
    if isinstance(exc, (dist.DistError, PeerLostError)):
        return True
    return type(exc) is RuntimeError and connection_lost(_connections)
