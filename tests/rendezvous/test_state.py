"""The rendezvous state's encoding (``slurm_elastic.rendezvous.state``): strict and lazy.

A whole state round-trips; a lazy :class:`StateView` answers exactly what the decoded
state answers while reading ``O(log N)`` rows; every kind of damage is a
:class:`MalformedRecordError` (never a wrong answer, never a pickle).
"""

from __future__ import annotations

import json
import random
import zlib

import pytest

from slurm_elastic.rendezvous.state import (
    HEADER_BYTES,
    PARTICIPANTS,
    SECTIONS,
    MalformedRecordError,
    Node,
    RowCache,
    State,
    StateView,
    decode_state,
    encode_state,
    ring_after,
)


def _state(n: int, seed: int = 0) -> State:
    rng = random.Random(seed)
    nodes = {Node(f"10.{rng.randrange(256)}.{rng.randrange(256)}.{i % 250}", rng.randrange(1, 1 << 22), i % 3) for i in range(n)}  # fmt: skip
    ordered = sorted(nodes)
    rng.shuffle(ordered)
    k = len(ordered)
    return State(
        round=7, complete=True, closed=False, last_call=None, calls=3, world=k // 2, formed=41,
        participants=set(ordered[: k // 2]), waiting=set(ordered[k // 2 : 3 * k // 4]),
        spares=set(ordered[3 * k // 4 :]),
    )  # fmt: skip


def _view(payload: bytes) -> tuple[StateView, list[tuple[int, int]]]:
    reads: list[tuple[int, int]] = []

    def read_at(at: int, n: int) -> bytes:
        reads.append((at, n))
        return payload[at : at + n]

    return StateView(read_at, len(payload)), reads


def test_a_state_round_trips_and_its_text_is_json_lines() -> None:
    s = _state(50)
    payload = encode_state(s)
    assert decode_state(payload) == s
    for line in payload.decode("ascii").splitlines():
        crc, _, body = line.rstrip().partition(" ")
        assert int(crc, 16) == zlib.crc32(body.encode())
        json.loads(body)
    assert len(payload.splitlines()[0]) + 1 == HEADER_BYTES


@pytest.mark.parametrize("n", [0, 1, 7, 300, 4096])
def test_a_lazy_view_answers_as_the_whole_state_does(n: int) -> None:
    s = _state(n, seed=n)
    view, _ = _view(encode_state(s))
    assert (view.round, view.complete, view.world, view.formed) == (7, True, n // 2, 41)
    for section in SECTIONS:
        assert view.count(section) == s.count(section)
    probes = [*sorted(s.members())[:: max(1, n // 40)], Node("10.0.0.1", 1, 9), Node("zz", 1, 0)]
    for node in probes:
        assert view.where(node) == s.where(node), node
        for section in SECTIONS:
            assert view.index(node, section) == s.index(node, section)
    for section in SECTIONS:
        for i in range(0, s.count(section), max(1, s.count(section) // 10)):
            assert view.node_at(section, i) == s.node_at(section, i)


def test_a_node_finds_its_row_in_few_small_reads() -> None:
    s = _state(4096, seed=1)
    payload = encode_state(s)
    me = s.sorted(PARTICIPANTS)[1234]
    view, reads = _view(payload)
    assert view.index(me, PARTICIPANTS) == 1234
    # The header, ~log2(N) single rows, one small window: not the 4,096 rows.
    assert len(reads) <= 16, len(reads)
    assert sum(n for _, n in reads) <= HEADER_BYTES + 16 * 128 + 2048
    assert sum(n for _, n in reads) < len(payload) / 50


def test_the_ring_walks_every_other_member_once_in_file_order() -> None:
    s = _state(20, seed=3)
    order = [n for sec in SECTIONS for n in s.sorted(sec)]
    me = order[5]
    view, _ = _view(encode_state(s))
    assert list(ring_after(view, me)) == order[6:] + order[:5]
    assert list(ring_after(s, me)) == order[6:] + order[:5]


def _line(obj: object, width: int) -> bytes:
    text = json.dumps(obj, separators=(",", ":"))
    return (f"{zlib.crc32(text.encode()):08x} {text}".ljust(width - 1) + "\n").encode()


def _tamper(payload: bytes, line: int, edit: object) -> bytes:
    lines = payload.splitlines(keepends=True)
    width = len(lines[line])
    body = json.loads(lines[line].decode()[9:])
    new = edit(body) if callable(edit) else edit
    lines[line] = _line(new, width)
    return b"".join(lines)


@pytest.mark.parametrize(
    ("what", "damage", "message"),
    [
        ("a flipped byte", lambda p: p[:300] + bytes([p[300] ^ 1]) + p[301:], "checksum"),
        ("a truncated state", lambda p: p[:-10], "bytes"),
        ("a pickle", lambda p: b"\x80\x04\x95" + p[3:], "checksum|header"),
        ("another version", lambda p: _tamper(p, 0, lambda h: {**h, "v": 2}), "version"),
        ("a round that is text", lambda p: _tamper(p, 0, lambda h: {**h, "round": "7"}), "round"),
        ("a negative count", lambda p: _tamper(p, 0, lambda h: {**h, "n": [-1, 1, 1]}), "count"),
        ("an unknown field", lambda p: _tamper(p, 0, lambda h: {**h, "x": 1}), "fields"),
        ("unsorted rows", lambda p: _tamper(p, 1, ["zz", 1, 0]), "sorted"),
        ("a bad address", lambda p: _tamper(p, 1, ["a b", 1, 0]), "address"),
        ("a row of the wrong shape", lambda p: _tamper(p, 1, {"addr": "x"}), "addr, pid"),
        (
            "a complete round without size",
            lambda p: _tamper(p, 0, lambda h: {**h, "world": None}),
            "world",
        ),
    ],
)
def test_damage_is_a_malformed_record(what: str, damage: object, message: str) -> None:
    payload = encode_state(_state(6, seed=2))
    bad = damage(payload)  # type: ignore[operator]
    with pytest.raises(MalformedRecordError, match=message):
        decode_state(bad)


def test_a_node_in_two_sections_is_refused() -> None:
    s = _state(6, seed=4)
    twice = next(iter(s.participants))
    s.spares.add(twice)
    with pytest.raises(MalformedRecordError, match="two sections"):
        decode_state(encode_state(s))


def test_an_agents_views_check_each_row_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The join thread and the watcher open every generation, and each lookup on a fresh
    # view checks ~12 rows per section: rows already checked (same bytes) are reused.
    import slurm_elastic.rendezvous.state as state_module

    parsed: list[bytes] = []
    real = state_module._node

    def counting(raw: bytes, what: str) -> Node:
        parsed.append(raw)
        return real(raw, what)

    monkeypatch.setattr(state_module, "_node", counting)
    s = _state(4096, seed=2)
    me = s.sorted(PARTICIPANTS)[777]
    rows = RowCache()
    payload = encode_state(s)
    first = StateView(lambda at, n: payload[at : at + n], len(payload), rows)
    assert first.where(me) == PARTICIPANTS
    once = len(parsed)
    assert 8 <= once <= 16
    again = StateView(lambda at, n: payload[at : at + n], len(payload), rows)  # other thread
    assert again.where(me) == PARTICIPANTS and len(parsed) == once
    assert again.node_at(PARTICIPANTS, 777) is first.node_at(PARTICIPANTS, 777)
    # The next generation (one more member): the same lookup checks only rows it has not met.
    s.participants.add(Node("10.0.0.0", 1, 0))
    s.world = s.count(PARTICIPANTS)
    payload2 = encode_state(s)
    later = StateView(lambda at, n: payload2[at : at + n], len(payload2), rows)
    assert later.where(me) == PARTICIPANTS
    assert len(parsed) - once < once
    # Damage is still found: a damaged row's bytes are not the cached row's.
    damaged = bytearray(payload)
    width = (len(payload) - HEADER_BYTES) // 4096
    damaged[HEADER_BYTES + 777 * width + 12] ^= 1  # participants come first
    hurt = StateView(lambda a, n: bytes(damaged[a : a + n]), len(damaged), rows)
    with pytest.raises(MalformedRecordError, match="checksum"):
        hurt.where(me)


def test_a_row_cache_is_bounded() -> None:
    s = _state(300, seed=3)
    payload = encode_state(s)
    rows = RowCache(limit=20)
    view = StateView(lambda at, n: payload[at : at + n], len(payload), rows)
    for i in range(s.count(PARTICIPANTS)):
        assert view.node_at(PARTICIPANTS, i) == s.node_at(PARTICIPANTS, i)
        assert len(rows) <= 20


def test_a_lazy_reader_refuses_a_damaged_row_it_reads() -> None:
    s = _state(64, seed=5)
    payload = bytearray(encode_state(s))
    row = (len(payload) - HEADER_BYTES) // 64
    at = HEADER_BYTES + 10 * row + 12
    payload[at] ^= 1
    view, _ = _view(bytes(payload))
    with pytest.raises(MalformedRecordError, match="checksum"):
        for i in range(s.count(PARTICIPANTS)):
            view.node_at(PARTICIPANTS, i)


def test_node_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="not a host name"):
        Node("a/b", 1, 0)
    with pytest.raises(ValueError, match="non-negative"):
        Node("a", -1, 0)
    with pytest.raises(ValueError, match="non-negative"):
        Node("a", True, 0)  # type: ignore[arg-type]
    assert Node("a", 1, 2).name == "a_1_2" and repr(Node("a", 1, 2)) == "a_1_2"
