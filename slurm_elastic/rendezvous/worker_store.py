"""The workers' store: a fresh TCPStore per round, owned by the round's rank 0.

Torch 2.13 caches the rank-0 TCPStore and its address across rounds, so survivors of a
rank-0 loss point their workers at a dead store, a late joiner deadlocks waiting for a
key the cached rank 0 never writes, and a worker restart reuses a store full of the
previous attempt's addresses. Here every :meth:`WorkerStoreOwner.setup` (one per
``next_rendezvous``) drops the previous store; rank 0 starts a **new** server on an
ephemeral port (chosen by the kernel at ``bind``: no check-then-bind race) or on a
configured port, and publishes ``addr:port`` for that round in the era's ``store``
record; every other rank reads the record of *its* round, every round.

The same TCPStore, under a round prefix, is the agent's control-plane store (rank
assignment, exit barrier): it only lives as long as the round, and the rendezvous
state itself is never in it, so losing its host ends only that round.

The advertised address is, in order: ``local_addr``; the IPv4 address of
``interface``; ``SLURMD_NODENAME`` when it resolves; the host's FQDN.

Security: TCPStore has **no authentication**: anyone who can reach the port can read
and write keys (and so disturb or impersonate workers). Keep the job's network private.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from slurm_elastic.errors import RendezvousSetupError, RoundLostError
from slurm_elastic.rendezvous.bounded_call import StoreUnansweredError, call_bounded
from slurm_elastic.rendezvous.run_directory import Era

__all__ = ["RoundLostError", "WorkerStoreOwner", "interface_address", "resolve_local_addr"]

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
_CONNECT_SPREAD_S = 0.01


def interface_address(interface: str) -> str:
    """Return the IPv4 address of network interface ``interface`` (Linux).

    Raises:
        RendezvousSetupError: the interface does not exist or has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = struct.pack("256s", interface.encode()[:15])
            res = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)
        except OSError as exc:
            raise RendezvousSetupError(
                f"network interface {interface!r} has no IPv4 address ({exc}); pick one "
                "from `ip -brief addr` or set local_addr instead"
            ) from exc
    return socket.inet_ntoa(res[20:24])


def resolve_local_addr(
    local_addr: str | None, interface: str | None, environ: Mapping[str, str]
) -> str:
    """Return the address other nodes should use to reach this node."""
    if local_addr:
        return local_addr
    if interface:
        return interface_address(interface)
    node = environ.get("SLURMD_NODENAME")
    if node:
        try:
            socket.getaddrinfo(node, None)
            return node
        except OSError:
            log.debug("SLURMD_NODENAME %r does not resolve; using the FQDN", node)
    return socket.getfqdn()


class WorkerStoreOwner:
    """Creates, publishes and discovers the per-round TCPStore.

    Args:
        era: the era whose ``store`` record carries the address.
        node: this node's name (recorded with the address).
        addr: the address to advertise when this node is rank 0.
        port: the port to bind (0: ephemeral).
        timeout_s: the TCPStore operation timeout.
    """

    def __init__(self, era: Era, node: str, addr: str, port: int, timeout_s: float) -> None:
        self._era = era
        self._node = node
        self._addr = addr
        self._port = port
        self._timeout = timedelta(seconds=timeout_s)
        self._store: dist.Store | None = None

    def close(self) -> None:
        """Drop the current store (a server stops when its last reference goes)."""
        self._store = None

    def _serve(self) -> dist.TCPStore:
        for port in dict.fromkeys((self._port, 0)):
            try:
                return dist.TCPStore(
                    host_name=self._addr,
                    port=port,
                    is_master=True,
                    wait_for_workers=False,
                    multi_tenant=False,
                    timeout=self._timeout,
                    use_libuv=True,
                )
            except (RuntimeError, dist.DistNetworkError) as exc:
                if port == 0:
                    raise
                log.warning("store port %d unavailable (%s); using an ephemeral port", port, exc)
        raise AssertionError("unreachable")  # pragma: no cover

    def _client(
        self,
        rec: Mapping[str, object],
        round_: int,
        round_is_current: Callable[[], bool],
        deadline: float,
    ) -> dist.TCPStore:
        """A client of the store ``rec`` names. Bounded: a frozen rank 0 accepts the
        connection and never answers torch's ping, which has no timeout (bounded_call.py).

        Raises:
            StoreUnansweredError: no answer in time, or the round ended meanwhile.
        """
        connect_s = max(1.0, min(self._timeout.total_seconds(), deadline - time.monotonic()))
        client = call_bounded(
            lambda: dist.TCPStore(
                host_name=str(rec["addr"]),
                port=int(str(rec["port"])),
                is_master=False,
                timeout=timedelta(seconds=connect_s),
                use_libuv=True,
            ),
            limit_s=connect_s + 1.0,
            give_up=lambda: None if round_is_current() else f"round {round_} ended",
        )
        client.set_timeout(self._timeout)
        return client

    def setup(
        self,
        round_: int,
        rank: int,
        rank0_node: str,
        round_is_current: Callable[[], bool],
        deadline: float,
        members: str = "",
    ) -> tuple[dist.Store, RendezvousStoreInfo]:
        """Return ``(agent store, worker store address)`` for round ``round_``.

        ``members`` is a digest of the round's members and ranks as this node read
        them: rank 0 publishes its own with the address; another rank whose view
        differs (a member was removed between the round's completion and its read)
        does not use the round. So every node that returns a round agrees with its
        rank 0 on members and ranks.

        Raises:
            RoundLostError: the round stopped being current (caller re-joins).
            RendezvousTimeoutError: ``deadline`` (monotonic) passed.
        """
        self.close()
        prefix = f"slurm_elastic/round.{round_}"
        if rank == 0:
            server = self._serve()
            self._store = server
            self._era.publish_store(round_, self._node, self._addr, server.port, members)
            return dist.PrefixStore(prefix, server), RendezvousStoreInfo(self._addr, server.port)
        delay = 0.01
        last_check = time.monotonic()
        spread = True
        while True:
            rec = self._era.read_store()
            if rec is not None and rec["round"] == round_ and rec["node"] == rank0_node:
                if rec.get("members", members) != members:
                    raise RoundLostError(f"round {round_} changed members before this node read it")
                if spread and str(rec["addr"]) == self._addr:
                    # Agents that share rank 0's host (one machine's test or simulation)
                    # spread their connects, up to 0.5 s: each makes torch look up the
                    # store's name by reverse DNS (resolver.py), and a host's resolver that
                    # drops a burst of queries costs 5 s per lost one (measured here: 64
                    # at once). Agents on their own nodes (a cluster) make one lookup per
                    # host and connect at once: a formation does not wait on the spread.
                    spread = False
                    time.sleep(_CONNECT_SPREAD_S * ((rank - 1) % 50))
                try:
                    client = self._client(rec, round_, round_is_current, deadline)
                except (RuntimeError, dist.DistNetworkError, StoreUnansweredError) as exc:
                    log.warning(
                        "cannot reach round %d store at %s:%s (%s)",
                        round_,
                        rec["addr"],
                        rec["port"],
                        exc,
                    )
                    if not round_is_current():
                        raise RoundLostError(f"round {round_} ended") from exc
                else:
                    self._store = client
                    info = RendezvousStoreInfo(rec["addr"], rec["port"])
                    return dist.PrefixStore(prefix, client), info
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"rank 0 ({rank0_node}) of round {round_} did not publish its store in "
                    "time; check that node's agent log"
                )
            if now - last_check > 0.5:
                last_check = now
                if not round_is_current():
                    raise RoundLostError(f"round {round_} ended")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
