"""The CRC-framed records of ``slurm_elastic/privatefs/records.py`` (issue #19 item 3):
one CRC32 and two framings, used by the rendezvous (generation files, state rows) and
the checkpoints (data files, manifests). Each damage a shared filesystem can cause is
refused with what failed."""

from __future__ import annotations

import os
import zlib

import pytest

from slurm_elastic.privatefs.records import (
    RecordError,
    crc32,
    crc_line,
    frame,
    frame_header,
    parse_crc_line,
    unframe,
)

MAGIC = b"TESTREC1\n"


def test_crc32_gives_zlibs_values_in_pieces_and_whole() -> None:
    data = os.urandom(3 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
    assert crc32(memoryview(data)) == zlib.crc32(data)


def test_a_framed_record_round_trips_and_names_its_header() -> None:
    payload = b'{"round": 3}'
    data = frame(MAGIC, 7, payload)
    assert unframe(MAGIC, data, 7) == payload
    assert frame_header(MAGIC, data) == (7, len(payload), zlib.crc32(payload))
    assert unframe(MAGIC, frame(MAGIC, 0, b""), 0) == b""


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: b"X" + d[1:], "bad magic"),
        (lambda d: d[: len(MAGIC) + 5], "truncated header"),
        (lambda d: d[:-1], "header says"),
        (lambda d: d + b" ", "header says"),
        (lambda d: d[:-2] + bytes([d[-2] ^ 1]) + d[-1:], "checksum mismatch"),
    ],
    ids=["magic", "torn-header", "short", "long", "bit-flip"],
)
def test_a_damaged_framed_record_is_refused_saying_what(damage, expected) -> None:  # type: ignore[no-untyped-def]
    data = frame(MAGIC, 7, b'{"round": 3, "members": [1, 2]}')
    with pytest.raises(RecordError, match=expected):
        unframe(MAGIC, damage(data), 7)


def test_a_record_of_another_number_is_refused() -> None:
    with pytest.raises(RecordError, match="record 6 where record 7 belongs"):
        unframe(MAGIC, frame(MAGIC, 6, b"x"), 7)


def test_a_crc_line_has_its_width_and_round_trips() -> None:
    line = crc_line('{"v":1}', 64)
    assert len(line) == 64 and line.endswith(b"\n")
    assert parse_crc_line(line) == '{"v":1}'
    with pytest.raises(ValueError, match="does not fit 16"):
        crc_line("x" * 20, 16)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda b: b[:12] + bytes([b[12] ^ 1]) + b[13:], "checksum mismatch"),
        (lambda b: b[:-1] + b" ", "not a whole line"),
        (lambda b: b[:12] + b"\xff" + b[13:], "not ASCII"),
        (lambda b: b"zzzzzzzz" + b[8:], "checksum mismatch"),
    ],
    ids=["bit-flip", "torn", "binary", "no-crc"],
)
def test_a_damaged_crc_line_is_refused_saying_what(damage, expected) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecordError, match=expected):
        parse_crc_line(damage(crc_line('{"round":12,"n":[2,0,0]}', 64)))
