"""``FileRendezvousBackend``: torch's rendezvous state on a shared directory, lock-free.

**One linear history.** The state (JSON, :mod:`.state`) lives in
*immutable generation files* ``seg.<k>/state.<n>`` (segment ``k = n // 64``). The
token is the generation number ``n``. A compare-and-set from token ``t``:

1. loses at once unless ``state.<t>`` exists (a token that was never issued, or whose
   generation was collected, can never be current);
2. publishes ``state.<t+1>`` with an exclusive ``link(2)``: exactly one writer wins a
   generation, and it can only win if ``t`` was the newest one, because generation
   files are never removed from an existing segment;
3. collection removes whole *segments*, first renamed away atomically: a stale writer
   whose segment was collected gets ``ENOENT`` from ``link`` and loses. A segment is
   only ever created by the writer of its first generation, after it checked that its
   predecessor still exists (re-checked after the ``mkdir``, so a collected segment is
   never resurrected).

A fresh state directory holds ``seg.0/state.0``, an *empty* record meaning "no state":
``token=None`` is token 0, so "create only if none exists" is the same rule. Losers get
the current state and token; ``head`` (replaced by ``rename``) is only a *hint* of the
newest generation: readers take the larger of it and what they saw last, verify it
exists, and probe forward; a ``head`` that is corrupt, points past the newest
generation, is a symlink or a directory is ignored (with a warning) and repaired by the
next writer. The generation a backend object reports never decreases.

Per read: ``open(head)`` + ``stat(state.<h+1>)`` (+ ``open(state.<h>)`` when the
generation changed). Per successful write: ``stat`` + ``open`` + ``link`` + ``unlink``
(temp) + ``open``/``rename`` (head) + ``stat``; every 64 generations one ``mkdir``, one
``listdir`` and the removal of one old segment. None of it depends on the number of nodes.

File format: ``b"SLRDV1\\n"``, generation (u64), payload length (u64), CRC-32 (u32),
payload. A newest record that fails any check (magic, length, CRC, or the strict
parse of :func:`~.state.decode_state`) raises
:class:`RendezvousStateError` naming the file: a corrupt state never silently becomes
an empty one.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from slurm_elastic.errors import RendezvousSetupError
from slurm_elastic.privatefs.records import FRAME_HEADER, RecordError, frame, frame_header, unframe
from slurm_elastic.rendezvous.filesystem import FS_OPS, MissingDirectoryError, RendezvousDir
from slurm_elastic.rendezvous.state import (
    MalformedRecordError,
    RowCache,
    State,
    StateView,
    decode_state,
)

__all__ = [
    "BACKEND_NAME",
    "SEGMENT",
    "FileRendezvousBackend",
    "MalformedRecordError",
    "encode_record",
    "init_state_dir",
]

log = logging.getLogger(__name__)

#: The registry name; ``get_backend()`` must return it (torch checks).
BACKEND_NAME = "slurm"  # must equal registration.BACKEND_NAME

#: Generations per segment directory; the previous segment is kept.
SEGMENT = 64

_MAGIC = b"SLRDV1\n"
_EMPTY = b""  # payload of generation 0: "no state"
_MAX_PROBE = 4 * SEGMENT
_PREFIX = len(_MAGIC) + FRAME_HEADER.size  # bytes before the payload


def encode_record(generation: int, payload: bytes) -> bytes:
    """Return the bytes of generation file ``generation`` holding ``payload``."""
    return frame(_MAGIC, generation, payload)


def _decode_record(data: bytes, generation: int) -> bytes:
    try:
        payload = unframe(_MAGIC, data, generation)
    except RecordError as exc:
        raise MalformedRecordError(str(exc)) from exc
    if generation > 0:
        _validate(payload)
    elif payload != _EMPTY:
        raise MalformedRecordError("generation 0 must be empty")
    return payload


def _validate(payload: bytes) -> None:
    decode_state(payload)


def _seg(generation: int) -> str:
    return f"seg.{generation // SEGMENT}"


def _name(generation: int) -> str:
    return f"state.{generation}"


def init_state_dir(directory: RendezvousDir) -> None:
    """Create generation 0 ("no state") in a *fresh* directory (idempotent).

    Call it only while the directory is private to the caller (e.g. an era being
    built before it is renamed into place): on a directory in use it could resurrect
    a collected segment.
    """
    seg = directory.subdir(_seg(0), create=True)
    try:
        seg.link_exclusive(_name(0), encode_record(0, _EMPTY))
    finally:
        seg.close()


class FileRendezvousBackend(RendezvousBackend):
    """A compare-and-set rendezvous state store on one (private) directory.

    Args:
        directory: the state directory, already initialised by
            :func:`init_state_dir`: a checked :class:`RendezvousDir`, or a path (opened and
            checked with :meth:`RendezvousDir.open_tree`, and initialised when empty; for
            tests and tools).
        rows: checked rows shared with the agent's other backends (see
            :class:`~.state.RowCache`).

    Raises:
        RendezvousSetupError: a path that is unsafe (see :class:`RendezvousDir`).
    """

    def __init__(
        self, directory: RendezvousDir | Path | str, *, rows: RowCache | None = None
    ) -> None:
        self._rows = rows if rows is not None else RowCache()
        if isinstance(directory, RendezvousDir):
            self._root = directory
        else:
            self._root = RendezvousDir.open_tree(Path(directory))
            if not [n for n in self._root.listdir() if n.startswith("seg.")]:
                init_state_dir(self._root)
        self._segs: dict[int, RendezvousDir] = {}
        self._cached: tuple[int, bytes] | None = None
        self._last_seen = 0
        self._warned: set[str] = set()
        self._decoded: tuple[int, State] | None = None
        self._view: tuple[int, StateView, int] | None = None

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def directory(self) -> Path:
        """The directory holding the state (for messages)."""
        return self._root.path

    def _file(self, generation: int) -> str:
        return str(self._root.path / _seg(generation) / _name(generation))

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # -- segments ----------------------------------------------------------------------

    def _segment(
        self, generation: int, *, create: bool = False, fresh: bool = False
    ) -> RendezvousDir | None:
        """The segment directory of ``generation`` (None when missing).

        ``fresh`` looks the name up again instead of trusting a cached descriptor,
        which may belong to a segment that was collected (renamed away) since.
        """
        k = generation // SEGMENT
        seg = self._segs.get(k)
        if seg is not None and not fresh and not seg.deleted():
            return seg
        try:
            new = self._root.subdir(_seg(generation), create=create)
        except MissingDirectoryError:
            return None
        except RendezvousSetupError as exc:
            raise RendezvousStateError(str(exc)) from exc
        old = self._segs.pop(k, None)
        if old is not None:
            old.close()
        self._segs[k] = new
        for j in [j for j in self._segs if j < k - 2]:
            self._segs.pop(j).close()
        return new

    def _exists(self, generation: int, *, fresh: bool = False) -> bool:
        seg = self._segment(generation, fresh=fresh)
        return seg is not None and seg.exists(_name(generation))

    def _still_linked(self, seg: RendezvousDir, generation: int) -> bool:
        """Whether ``seg`` is still the directory named ``seg.<k>`` (not collected)."""
        try:
            named = os.stat(_seg(generation), dir_fd=self._root.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(seg.fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _check_not_deleted(self) -> None:
        if self._root.deleted():
            self._cached = None
            self._segs.clear()
            raise RendezvousStateError(
                f"the rendezvous directory {str(self._root.path)!r} was deleted while in use "
                "(e.g. by a cleanup script or `rm -rf`); this node's cached state is void. "
                "Restart the job; keep the rendezvous directory while it runs"
            )

    # -- reading ---------------------------------------------------------------------

    def _scan(self) -> int:
        best_seg = -1
        for entry in self._root.listdir():
            if entry.startswith("seg."):
                try:
                    best_seg = max(best_seg, int(entry[4:]))
                except ValueError:
                    continue
        if best_seg < 0:
            self._check_not_deleted()
            raise RendezvousStateError(
                f"the rendezvous state directory {str(self._root.path)!r} holds no "
                "generation at all (not even the initial one); remove the era directory "
                "so that a new one is created"
            )
        best = -1
        for k in range(best_seg, max(best_seg - 3, -1), -1):
            seg = self._segment(k * SEGMENT)
            if seg is None:
                continue
            for entry in seg.listdir():
                if entry.startswith("state."):
                    try:
                        best = max(best, int(entry[6:]))
                    except ValueError:
                        continue
            if best >= 0:
                return best
        return max(best, 0)

    def _read_head(self) -> int | None:
        try:
            raw = self._root.read("head", limit=64)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.EFBIG, errno.ENXIO):
                self._warn_once("head", "ignoring a planted or damaged rendezvous head in %s: %s",
                                self._root.path, exc)  # fmt: skip
                return None
            raise
        if raw is None:
            return None
        try:
            value = int(raw.decode("ascii").strip())
            if value < 0:
                raise ValueError(value)
            return value
        except (UnicodeDecodeError, ValueError):
            self._warn_once("head", "ignoring a malformed rendezvous head pointer in %s",
                            self._root.path)  # fmt: skip
            return None

    def latest_generation(self, *, probe: bool = True) -> int:
        """Return the newest published generation (0 when none); cheap, for polling.

        Args:
            probe: also look past ``head`` for newer generations (one ``stat``); a
                poller may skip it on most polls (``head`` lags only when a writer
                died between publishing and re-pointing it, or under NFS caching).

        Raises:
            RendezvousConnectionError: the directory cannot be read.
            RendezvousStateError: the directory was deleted or holds no generation.
        """
        try:
            head = self._read_head()
            if head is None and self._last_seen > 0:
                self._check_not_deleted()
            gen = self._last_seen
            if head is not None and head > gen:
                if self._exists(head):
                    gen = head
                else:  # points past the newest generation (or at a collected one)
                    if head > self._last_seen + 1 and not self._exists(self._last_seen + 1):
                        self._warn_once(f"head{head}", "ignoring rendezvous head %d in %s: no "
                                        "such generation", head, self._root.path)  # fmt: skip
            if gen == 0 and not self._exists(0):
                gen = self._scan()
            probes = 0
            while probe and self._exists(gen + 1):
                gen += 1
                probes += 1
                if probes > _MAX_PROBE:  # far behind: find the newest segment
                    gen = max(gen, self._scan())
                    probes = 0
            self._last_seen = gen
            return gen
        except OSError as exc:
            raise RendezvousConnectionError(
                f"cannot read the rendezvous state in {str(self._root.path)!r}: {exc}"
            ) from exc

    def _read_generation(self, generation: int) -> bytes | None:
        """Return the payload of ``generation``; None if missing.

        Raises:
            MalformedRecordError: the record is corrupt (the message names the file).
        """
        seg = self._segment(generation)
        if seg is None:
            return None
        try:
            data = seg.read(_name(generation))
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.EFBIG, errno.ENXIO):
                raise self._malformed(generation, str(exc)) from exc
            raise
        if data is None:
            return None
        try:
            return _decode_record(data, generation)
        except MalformedRecordError as exc:
            raise self._malformed(generation, str(exc)) from exc

    def _malformed(self, generation: int, why: str) -> MalformedRecordError:
        self._cached = None
        return MalformedRecordError(
            f"rendezvous state record {self._file(generation)!r} is malformed ({why}); it was "
            "damaged or planted. Stop the run's agents and remove its era directory "
            f"{str(self._root.path)!r} (a new era is created), or delete the file to fall "
            "back to the previous generation"
        )

    def get_state(self) -> tuple[bytes, Any] | None:
        """See base class. The token is the generation number.

        Raises:
            RendezvousStateError: the newest record is malformed (named), or the
                directory was deleted.
            RendezvousConnectionError: the directory cannot be read.
        """
        for _ in range(8):
            gen = self.latest_generation()
            if self._cached is not None and self._cached[0] == gen:
                payload = self._cached[1]
            else:
                try:
                    found = self._read_generation(gen)
                except OSError as exc:
                    raise RendezvousConnectionError(
                        f"cannot read rendezvous state {self._file(gen)!r}: {exc}"
                    ) from exc
                if found is None:
                    # Collected under our feet (we lagged a whole segment) or the
                    # directory is gone: look again from scratch.
                    self._check_not_deleted()
                    self._last_seen = 0
                    self._last_seen = self._scan()
                    continue
                payload = found
                self._cached = (gen, payload)
            return (payload, gen) if gen > 0 else None
        self._check_not_deleted()
        raise RendezvousStateError(
            f"the rendezvous state in {str(self._root.path)!r} kept changing or vanishing "
            "while being read; check that the directory is not being cleaned concurrently"
        )

    def read_full(self) -> tuple[int, State]:
        """The newest generation and its whole state, checked (a copy to change).

        For writers: a node that only decides reads a :meth:`view`.

        Raises:
            RendezvousStateError, RendezvousConnectionError: see :meth:`get_state`.
        """
        got = self.get_state()
        if got is None:
            return 0, State()
        gen = got[1]
        if self._decoded is None or self._decoded[0] != gen:
            self._decoded = (gen, decode_state(got[0]))
        return gen, self._decoded[1].copy()

    def read_state(self, generation: int) -> State | None:
        """The whole state of ``generation``, checked; None once it was collected.

        Raises:
            MalformedRecordError: the record is malformed (named).
        """
        payload = self._read_generation(generation)
        return None if payload is None else decode_state(payload) if generation else State()

    def view(self, *, probe: bool = True) -> tuple[int, StateView | State]:
        """The newest generation and a lazy view of its state (header + rows on demand).

        ``O(log N)`` bytes for a node that reads its own row: see
        :class:`~.state.StateView`. Generation 0 is the empty :class:`~.state.State`.

        Raises:
            MalformedRecordError: the record (or a row later read) is malformed.
            RendezvousConnectionError: the directory cannot be read.
        """
        for _ in range(8):
            gen = self.latest_generation(probe=probe)
            if gen == 0:
                return 0, State()
            if self._view is not None and self._view[0] == gen:
                return gen, self._view[1]
            seg = self._segment(gen)
            fd = None if seg is None else seg.open_read(_name(gen))
            if fd is None:  # collected under our feet: look again
                self._check_not_deleted()
                self._last_seen = 0
                self._last_seen = self._scan()
                continue
            self._close_view()
            try:
                view = self._open_view(fd, gen)
            except BaseException:
                os.close(fd)
                raise
            self._view = (gen, view, fd)
            return gen, view
        self._check_not_deleted()
        raise RendezvousStateError(
            f"the rendezvous state in {str(self._root.path)!r} kept vanishing while being "
            "read; check that the directory is not being cleaned concurrently"
        )

    def _open_view(self, fd: int, gen: int) -> StateView:
        size = os.fstat(fd).st_size

        def read_at(offset: int, n: int) -> bytes:
            FS_OPS.add("read")
            data = os.pread(fd, n, _PREFIX + offset)
            FS_OPS.add_bytes(len(data))
            if len(data) != n:
                raise MalformedRecordError(f"short read at {offset} of {n} bytes")
            return data

        try:
            FS_OPS.add("read")
            head = os.pread(fd, _PREFIX, 0)
            FS_OPS.add_bytes(len(head))
            try:
                number, length, _crc = frame_header(_MAGIC, head)
            except RecordError as exc:
                raise MalformedRecordError(str(exc)) from exc
            if number != gen or length != size - _PREFIX:
                raise MalformedRecordError(f"header says generation {number}, {length} bytes")
            return StateView(read_at, length, self._rows)
        except MalformedRecordError as exc:
            raise self._malformed(gen, str(exc)) from exc

    def _close_view(self) -> None:
        if self._view is not None:
            os.close(self._view[2])
            self._view = None

    def close(self) -> None:
        """Release the descriptors this backend holds."""
        self._close_view()
        for seg in self._segs.values():
            seg.close()
        self._segs.clear()

    # -- writing ---------------------------------------------------------------------

    def _current(self) -> tuple[bytes, Any, bool] | None:
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], False

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """See base class: publish generation ``token + 1`` only if ``token`` is current.

        Any other token (older, never issued, of another type) loses and returns the
        current state and token, or None when there is no state.
        """
        t = 0 if token is None else token
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return self._current()
        new = t + 1
        try:
            if not self._exists(t, fresh=True):  # collected or never issued: not current
                return self._current()
            seg = self._segment(new, fresh=new // SEGMENT != t // SEGMENT)
            if seg is None:
                if new % SEGMENT != 0:  # a mid-segment name whose segment is gone
                    return self._current()
                seg = self._segment(new, create=True)
                if seg is None or not self._exists(t, fresh=True):  # collected meanwhile
                    self._segs.pop(new // SEGMENT, None)
                    self._root.rmdir(_seg(new))
                    return self._current()
            try:
                won = seg.link_exclusive(_name(new), encode_record(new, state))
            except FileNotFoundError:  # the segment was collected: a stale token
                won = False
            # A link into a segment renamed away for collection (through a descriptor
            # opened before) does not count: the generation is only published if its
            # segment was still in place after the link.
            if won and not self._still_linked(seg, new):
                won = False
        except OSError as exc:
            self._check_not_deleted()
            raise RendezvousConnectionError(
                f"cannot write rendezvous state {self._file(new)!r}: {exc}"
            ) from exc
        if not won:
            return self._current()
        self._last_seen = max(self._last_seen, new)
        self._cached = (new, state)
        self._update_head(new)
        if new % SEGMENT == 0:
            self._collect(new // SEGMENT)
        return state, new, True

    def _update_head(self, new: int) -> None:
        """Point ``head`` at ``new`` unless a newer generation exists (best effort)."""
        try:
            if self._exists(new + 1):
                return
            try:
                self._root.replace("head", str(new).encode())
            except IsADirectoryError:  # a planted directory: move it out of the way
                self._root.rmtree("head")
                self._root.replace("head", str(new).encode())
            if self._exists(new + 1):  # overtaken while writing: re-point forward
                self._root.replace("head", str(self.latest_generation()).encode())
        except OSError as exc:  # the pointer is only a hint; readers probe past it
            log.debug("could not update rendezvous head in %s: %s", self._root.path, exc)

    def _collect(self, current_seg: int) -> None:
        """Remove segments older than the previous one (renamed away, then deleted)."""
        try:
            for entry in self._root.listdir():
                if entry.startswith("seg."):
                    try:
                        k = int(entry[4:])
                    except ValueError:
                        continue
                    if k < current_seg - 1:
                        old = self._segs.pop(k, None)
                        if old is not None:
                            old.close()
                        self._root.rmtree(entry)
        except OSError as exc:
            log.debug("could not collect old rendezvous generations: %s", exc)
