"""A one-shot reachability probe of other agents' links (for a node evicted while it ran).

:func:`probe` tries every target at once with the link's handshake
(:mod:`.link`): a target is reached when its link answers, or when its host refuses the
connection. :meth:`~slurm_elastic.rendezvous.member_links.MemberLinks.wait_reachable`
uses it before a node that was cut off joins again.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time
from collections.abc import Mapping

from slurm_elastic.rendezvous.link import ANSWER_BYTES, HANDSHAKE_S, NONCE_BYTES, Target

__all__ = ["probe"]


#: A connect that fails with one of these reached the target's host (its kernel answered).
_HOST_ANSWERED = frozenset({errno.ECONNREFUSED, errno.ECONNRESET})


def probe(targets: Mapping[str, Target], timeout_s: float = HANDSHAKE_S) -> set[str]:
    """The targets whose host this process reaches over the network, tried at once.

    A target is reached when its link answers the handshake, or when its host refuses
    the connection (the process is gone, but the network path works). Unreached: no
    answer within ``timeout_s``, or no route to the host. A partitioned node reaches none
    of its live peers.
    """
    reached: set[str] = set()
    sel = selectors.DefaultSelector()
    pending: dict[socket.socket, tuple[str, bytes, bytearray]] = {}
    try:
        for name, target in targets.items():
            try:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(
                    target.addr, target.port, type=socket.SOCK_STREAM
                )[0]
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue
            sock.setblocking(False)
            code = sock.connect_ex(sockaddr)
            if code in _HOST_ANSWERED:
                reached.add(name)
                sock.close()
                continue
            if code not in (0, errno.EINPROGRESS):
                sock.close()
                continue
            pending[sock] = (name, os.urandom(NONCE_BYTES), bytearray())
            sel.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(timeout=left):
                sock = key.fileobj  # type: ignore[assignment]
                name, nonce, got = pending[sock]
                done = _probe_step(sel, sock, nonce, got)
                if done is None:
                    continue
                if done:
                    reached.add(name)
                del pending[sock]
                sel.unregister(sock)
                sock.close()
    finally:
        for sock in pending:
            sock.close()
        sel.close()
    return reached


def _probe_step(
    sel: selectors.BaseSelector, sock: socket.socket, nonce: bytes, got: bytearray
) -> bool | None:
    """One event of a probe: True reached, False not, None not decided yet."""
    if sel.get_key(sock).events & selectors.EVENT_WRITE:
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code != 0:
            return code in _HOST_ANSWERED
        try:
            sock.sendall(nonce)
        except OSError:
            return False
        sel.modify(sock, selectors.EVENT_READ)
        return None
    try:
        chunk = sock.recv(ANSWER_BYTES)
    except BlockingIOError:
        return None
    except OSError as exc:
        return exc.errno in _HOST_ANSWERED
    if not chunk:
        return True  # the host's process answered by closing: the path works
    got += chunk
    if len(got) < ANSWER_BYTES:
        return None
    return True  # an answer (right or wrong) came back over the network
