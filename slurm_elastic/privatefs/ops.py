"""Counting the metadata operations of the private-filesystem layer (the rendezvous
benchmark reads :data:`FS_OPS`)."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["FS_OPS", "FsOps"]


class FsOps:
    """A thread-safe counter of metadata operations, by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._bytes = 0

    def add(self, kind: str, n: int = 1) -> None:
        """Count ``n`` operations of ``kind``."""
        with self._lock:
            self._counts[kind] += n

    def add_bytes(self, n: int) -> None:
        """Count ``n`` bytes read from files."""
        with self._lock:
            self._bytes += n

    def bytes_read(self) -> int:
        """Return the bytes read so far."""
        with self._lock:
            return self._bytes

    def snapshot(self) -> dict[str, int]:
        """Return a copy of the counts (kind -> number)."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """Return the number of operations counted so far."""
        with self._lock:
            return sum(self._counts.values())

    def reset(self) -> None:
        """Forget all counts."""
        with self._lock:
            self._counts.clear()
            self._bytes = 0


#: Metadata operations (``open``, ``stat``, ``link``, ``rename``, ``unlink``, ``mkdir``,
#: ``listdir``) done through :class:`SafeDir` in this process.
FS_OPS = FsOps()
