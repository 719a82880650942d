"""CRC-framed records: the one CRC32 and the two framings the package writes (torch-free).

* :func:`crc32`: ``zlib.crc32``'s values, computed by ISA-L (``isal``, PCLMULQDQ, ~12 GB/s
  here against zlib's 1.3-3 GB/s) and releasing the GIL on large buffers; the checkpoint
  data files, their manifests and the rendezvous records all use it;
* a *framed record* (:func:`frame` / :func:`unframe`): ``magic``, then a big-endian
  header (a number the reader expects, the payload's length, its CRC32), then the
  payload: a file that is torn, truncated, of another number or bit-flipped is refused
  (the rendezvous' generation files);
* a *CRC line* (:func:`crc_line` / :func:`parse_crc_line`): ``<crc32 hex> <text>``
  padded with spaces to a fixed width and ended by a newline, so a reader can seek to
  line ``i`` (the rendezvous state's rows).

A record that fails a check raises :class:`~slurm_elastic.errors.RecordError` (a
``ValueError``) saying which;
the domains turn it into theirs.
"""

from __future__ import annotations

import struct
import zlib

from slurm_elastic.errors import RecordError

__all__ = [
    "FRAME_HEADER",
    "RecordError",
    "crc32",
    "crc_line",
    "frame",
    "frame_header",
    "parse_crc_line",
    "unframe",
]

try:  # the same CRC32 as zlib's (same polynomial and values), computed with PCLMULQDQ
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _fast_crc32 = zlib.crc32

#: A framed record's header after its magic: number, payload length, payload CRC32.
FRAME_HEADER = struct.Struct(">QQI")


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32 of ``data`` continuing from ``value`` (``zlib.crc32``'s values; releases the
    GIL on large buffers)."""
    return _fast_crc32(data, value)


def frame(magic: bytes, number: int, payload: bytes) -> bytes:
    """The bytes of record ``number`` holding ``payload``."""
    return magic + FRAME_HEADER.pack(number, len(payload), crc32(payload)) + payload


def frame_header(magic: bytes, head: bytes) -> tuple[int, int, int]:
    """``(number, payload length, payload CRC32)`` from a record's first
    ``len(magic) + FRAME_HEADER.size`` bytes.

    Raises:
        RecordError: another magic, or too short.
    """
    if not head.startswith(magic):
        raise RecordError("bad magic")
    if len(head) < len(magic) + FRAME_HEADER.size:
        raise RecordError("truncated header")
    number, length, crc = FRAME_HEADER.unpack_from(head, len(magic))
    return number, length, crc


def unframe(magic: bytes, data: bytes, number: int) -> bytes:
    """The payload of record ``data``, which must be record ``number``, whole and intact.

    Raises:
        RecordError: bad magic, truncated, another number, a length or CRC32 mismatch.
    """
    got, length, crc = frame_header(magic, data)
    payload = data[len(magic) + FRAME_HEADER.size :]
    if got != number:
        raise RecordError(f"record {got} where record {number} belongs")
    if len(payload) != length:
        raise RecordError(f"payload has {len(payload)} bytes, header says {length}")
    if crc32(payload) != crc:
        raise RecordError("checksum mismatch")
    return payload


def crc_line(text: str, width: int) -> bytes:
    """``text`` (ASCII, no newline) as one CRC line of exactly ``width`` bytes.

    Raises:
        ValueError: it does not fit.
    """
    line = f"{crc32(text.encode('ascii')):08x} {text}"
    if len(line) >= width:
        raise ValueError(f"a line of {len(line)} bytes does not fit {width}")
    return (line.ljust(width - 1) + "\n").encode("ascii")


def parse_crc_line(raw: bytes) -> str:
    """The text of the CRC line ``raw`` (its padding removed).

    Raises:
        RecordError: not ASCII, not a whole line, or a checksum mismatch.
    """
    try:
        text = raw.decode("ascii").rstrip(" \n")
    except UnicodeDecodeError as exc:
        raise RecordError(f"not ASCII: {exc}") from None
    crc, _, body = text.partition(" ")
    try:
        ok = len(crc) == 8 and int(crc, 16) == crc32(body.encode("ascii"))
    except ValueError:
        ok = False
    if not ok:
        raise RecordError("checksum mismatch")
    if not raw.endswith(b"\n"):
        raise RecordError("not a whole line")
    return body
