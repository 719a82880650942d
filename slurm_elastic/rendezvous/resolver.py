"""A start-up check for slow reverse DNS, which torch's TCPStore waits on per connection.

torch's c10d client socket connects to an IPv4 store host through an IPv6 socket (a
v4-mapped address, ``::ffff:a.b.c.d``) and formats the peer's address with
``getnameinfo`` *with* a name lookup, on every connection: every agent and every worker
connects to the round's store, so start-up waits on one reverse lookup per connection.
A v4-mapped address matches no IPv4 line of ``/etc/hosts``, so the lookup goes to DNS;
a resolver that is slow or drops a burst of queries costs its timeout (5 s by default,
twice) per connection. Measured on the benchmark machine: 200 concurrent lookups of
``::ffff:127.0.0.1``, 147 failed after 10 s; with a ``::ffff:127.0.0.1`` line in
``/etc/hosts`` all took under 10 ms, and 4,080 store connections took 3.9 s.

:func:`check_reverse_lookup_once` times one lookup of this node's v4-mapped address in
the background (once per process; it never delays start-up) and logs a warning naming
the fix when it is slow or fails for want of an answer.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SLOW_LOOKUP_S", "check_reverse_lookup_once", "mapped_address", "reverse_lookup_s"]

log = logging.getLogger(__name__)

#: A reverse lookup slower than this is reported (one lookup; a store serves thousands).
SLOW_LOOKUP_S = 0.5

_checked = False
_checked_lock = threading.Lock()

Lookup = Callable[[tuple[Any, ...], int], tuple[str, str]]


def mapped_address(addr: str) -> str | None:
    """The address torch's client sockets see for ``addr``: an IPv4 address (or a name
    that resolves to one) as ``::ffff:a.b.c.d``; an IPv6 address as is; None when the
    name does not resolve."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        try:
            infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
        except OSError:
            return None
        if not infos:
            return None
        ip = ipaddress.ip_address(str(infos[0][4][0]).split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv4Address):
        return f"::ffff:{ip}"
    return str(ip)


def reverse_lookup_s(address: str, lookup: Lookup = socket.getnameinfo) -> tuple[float, str | None]:
    """Seconds one reverse lookup of ``address`` (an IPv6 literal) takes, as torch makes
    it (a name is looked up, the port is numeric); and the resolver's error, if any:
    ``EAI_AGAIN`` means nobody answered, i.e. torch's connections wait too."""
    start = time.monotonic()
    error: str | None = None
    try:
        lookup((address, 0, 0, 0), socket.NI_NUMERICSERV)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            error = f"{exc.strerror} (EAI_AGAIN)"
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, error


def _report(addr: str, lookup: Lookup) -> None:
    mapped = mapped_address(addr)
    if mapped is None:
        return
    seconds, error = reverse_lookup_s(mapped, lookup)
    if seconds < SLOW_LOOKUP_S and error is None:
        return
    how = f"failed after {seconds:.1f} s: {error}" if error else f"took {seconds:.1f} s"
    log.warning(
        "reverse DNS of this node's address as torch's store connections see it (%s, for "
        "%s) %s. torch's TCPStore looks up the peer's name on every connection (every "
        "agent and worker connects to the round's store), so start-up may wait that long "
        "per connection. Fix: give these addresses fast PTR answers, or list them in "
        "/etc/hosts in this form (e.g. '%s %s'), or shorten the resolver's timeout "
        "(RES_OPTIONS='timeout:1 attempts:1').",
        mapped, addr, how, mapped, socket.gethostname(),
    )  # fmt: skip


def check_reverse_lookup_once(addr: str, *, lookup: Lookup = socket.getnameinfo) -> bool:
    """Start the background check for ``addr`` unless this process already did; return
    whether it started. Never blocks and never raises."""
    global _checked
    with _checked_lock:
        if _checked:
            return False
        _checked = True
    threading.Thread(
        target=_report, args=(addr, lookup), name="slurm-elastic-dns-check", daemon=True
    ).start()
    return True
