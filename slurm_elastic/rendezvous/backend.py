"""``FileRendezvousBackend``: torch's rendezvous state on a shared directory, lock-free.

The state (torch's pickled ``_RendezvousState``) lives in *immutable generation files*
``state.<n>``. A compare-and-set from token ``t`` publishes ``state.<t+1>`` with an
exclusive ``link(2)``: exactly one writer wins a generation, the losers read the winner's
state. Nothing is locked, so a writer that dies at any instant blocks nobody (it leaves
at most an orphaned ``.tmp.*`` file). A ``head`` pointer (replaced by ``rename``) tells
readers the newest generation without listing the directory; readers verify it with one
probe of the next name, and fall back to a listing only when the pointer is missing or
points at a collected file. The writer of generation ``n`` deletes ``state.<n-KEEP>``,
so the directory stays small.

Per read: ``open(head)`` + ``stat(state.<h+1>)`` + ``open(state.<h>)`` (the last one is
skipped when the generation is unchanged). Per successful write: ``open`` + ``link`` +
``unlink`` (temp) + ``open``/``rename`` (head) + ``unlink`` (old generation). Neither
depends on the number of nodes.

File format: ``b"SLRDV1\\n"``, generation (u64), payload length (u64), CRC-32 (u32),
payload. A file that fails any check is a *malformed record*: it is logged as a warning
and skipped (its generation still counts, so writers move past it). Payloads are also
checked by a restricted unpickler that admits only the classes torch's state uses, as a
defence in depth on top of the directory permission checks.
"""

from __future__ import annotations

import errno
import io
import logging
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    _RendezvousState,
)

from slurm_elastic.rendezvous import filesystem as fs

__all__ = ["BACKEND_NAME", "FileRendezvousBackend", "decode_state", "encode_record"]

log = logging.getLogger(__name__)

#: The registry name; ``get_backend()`` must return it (torch checks).
BACKEND_NAME = "slurm"  # must equal registration.BACKEND_NAME

_MAGIC = b"SLRDV1\n"
_HEADER = struct.Struct(">QQI")
_KEEP = 16

_ALLOWED_GLOBALS = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a state")
        return super().find_class(module, name)


def decode_state(payload: bytes) -> _RendezvousState:
    """Unpickle a state payload, admitting only the classes torch's state uses.

    Raises:
        pickle.UnpicklingError: the payload is not a plain rendezvous state.
    """
    obj = _RestrictedUnpickler(io.BytesIO(payload)).load()
    if not isinstance(obj, _RendezvousState):
        raise pickle.UnpicklingError(f"payload holds a {type(obj).__name__}, not a state")
    return obj


def encode_record(generation: int, payload: bytes) -> bytes:
    """Return the bytes of generation file ``generation`` holding ``payload``."""
    return _MAGIC + _HEADER.pack(generation, len(payload), zlib.crc32(payload)) + payload


def _decode_record(data: bytes, generation: int) -> bytes:
    if not data.startswith(_MAGIC):
        raise ValueError("bad magic")
    start = len(_MAGIC) + _HEADER.size
    if len(data) < start:
        raise ValueError("truncated header")
    gen, length, crc = _HEADER.unpack_from(data, len(_MAGIC))
    payload = data[start:]
    if gen != generation:
        raise ValueError(f"generation {gen} in file named {generation}")
    if len(payload) != length:
        raise ValueError(f"payload has {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise ValueError("checksum mismatch")
    decode_state(payload)
    return payload


class FileRendezvousBackend(RendezvousBackend):
    """A compare-and-set rendezvous state store on one (private) directory.

    Args:
        directory: the epoch directory holding ``state.<n>`` and ``head``; it must
            exist and have passed :func:`~slurm_elastic.rendezvous.filesystem.ensure_private_dir`.
        keep: how many generations to keep before deleting old ones.
    """

    def __init__(self, directory: Path, *, keep: int = _KEEP) -> None:
        self._dir = Path(directory)
        self._keep = max(2, keep)
        self._cached: tuple[int, bytes] | None = None
        self._last_seen = 0
        self._warned: set[int] = set()

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def directory(self) -> Path:
        """The directory holding the generation files."""
        return self._dir

    # -- reading ---------------------------------------------------------------------

    def _exists(self, generation: int) -> bool:
        fs.FS_OPS.add("stat")
        try:
            (self._dir / f"state.{generation}").lstat()
            return True
        except FileNotFoundError:
            return False

    def _scan(self) -> int:
        best = 0
        for entry in fs.listdir(self._dir):
            if entry.startswith("state."):
                try:
                    best = max(best, int(entry[6:]))
                except ValueError:
                    continue
        return best

    def latest_generation(self) -> int:
        """Return the newest published generation (0 when none); cheap, for polling.

        Raises:
            RendezvousConnectionError: the directory cannot be read.
        """
        try:
            raw = fs.read_small(self._dir / "head", limit=64)
            head = 0
            if raw is not None:
                try:
                    head = int(raw.decode("ascii").strip() or 0)
                except (UnicodeDecodeError, ValueError):
                    log.warning("ignoring malformed rendezvous head pointer in %s", self._dir)
            gen = max(head, self._last_seen)
            if gen == 0 and raw is None:
                gen = self._scan()
            while self._exists(gen + 1):
                gen += 1
            self._last_seen = gen
            return gen
        except OSError as exc:
            raise RendezvousConnectionError(
                f"cannot read the rendezvous state in {str(self._dir)!r}: {exc}"
            ) from exc

    def _read_generation(self, generation: int) -> bytes | None:
        """Return the payload of ``generation``; None if missing; raise ValueError if bad."""
        try:
            data = fs.read_small(self._dir / f"state.{generation}")
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a planted symlink: never follow it
                raise ValueError("is a symlink") from exc
            raise
        if data is None:
            return None
        return _decode_record(data, generation)

    def get_state(self) -> tuple[bytes, Any] | None:
        """See base class. The token is the generation number."""
        for _ in range(8):
            gen = self.latest_generation()
            if gen == 0:
                return None
            if self._cached is not None and self._cached[0] == gen:
                return self._cached[1], gen
            try:
                payload = self._newest_valid(gen)
            except OSError as exc:
                raise RendezvousConnectionError(
                    f"cannot read rendezvous state generation {gen} in {str(self._dir)!r}: {exc}"
                ) from exc
            if payload is _MISSING:
                # Collected under our feet (we lagged by KEEP generations): re-scan.
                self._last_seen = self._scan()
                continue
            if not isinstance(payload, bytes):  # pragma: no cover - narrowing for mypy
                continue
            self._cached = (gen, payload)
            return payload, gen
        raise RendezvousStateError(
            f"the rendezvous state in {str(self._dir)!r} kept changing or vanishing while "
            "being read; check that the directory is not being cleaned concurrently"
        )

    def _newest_valid(self, gen: int) -> bytes | object:
        """Payload of the newest well-formed generation <= gen (empty state if none)."""
        for candidate in range(gen, max(0, gen - self._keep), -1):
            try:
                payload = self._read_generation(candidate)
            except (ValueError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
                if candidate not in self._warned:
                    self._warned.add(candidate)
                    log.warning(
                        "ignoring malformed rendezvous record %s: %s",
                        self._dir / f"state.{candidate}",
                        exc,
                    )
                continue
            if payload is None:
                if candidate == gen:
                    return _MISSING
                break
            return payload
        return pickle.dumps(_RendezvousState())

    # -- writing ---------------------------------------------------------------------

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """See base class: publish generation ``token + 1`` unless someone else did."""
        if token is not None and not isinstance(token, int):
            raise RendezvousStateError(f"token {token!r} is not a generation number")
        new = (token or 0) + 1
        try:
            won = fs.link_exclusive(self._dir, f"state.{new}", encode_record(new, state))
        except OSError as exc:
            raise RendezvousConnectionError(
                f"cannot write rendezvous state generation {new} in {str(self._dir)!r}: {exc}"
            ) from exc
        if won:
            self._last_seen = max(self._last_seen, new)
            self._cached = (new, state)
            try:
                fs.replace_file(self._dir, "head", str(new).encode())
                if new > self._keep:
                    fs.remove(self._dir / f"state.{new - self._keep}")
            except OSError as exc:  # the pointer is only a hint; readers probe past it
                log.debug("could not update rendezvous head in %s: %s", self._dir, exc)
            return state, new, True
        current = self.get_state()
        if current is None:  # pragma: no cover - the name we lost on exists
            raise RendezvousStateError(
                f"rendezvous state generation {new} in {str(self._dir)!r} exists but "
                "cannot be found; is the directory being cleaned concurrently?"
            )
        return current[0], current[1], False


_MISSING = object()
