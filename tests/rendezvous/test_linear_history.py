"""Compare-and-set never forks (issue #9.1) and damaged records are errors (#9.6).

A write with any token other than the current one loses and returns the current state,
however old the token (also after its generation was collected), ``None`` once a state
exists, a token never issued, or a token of the wrong type. Written against the public
backend API only, so the same file shows the defects of the earlier backend.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from slurm_elastic.rendezvous.backend import FileRendezvousBackend, encode_record
from slurm_elastic.rendezvous.state import HEADER_BYTES, State, decode_state, encode_state

_CTX = mp.get_context("fork")
_MANY = 200  # well past any collection horizon


def _backend(path: Path) -> FileRendezvousBackend:
    path.mkdir(mode=0o700, exist_ok=True)
    return FileRendezvousBackend(path)


def _state(round_: int) -> bytes:
    return encode_state(State(round=round_))


def _round(blob: bytes) -> int:
    return decode_state(blob).round


def _history(b: FileRendezvousBackend, n: int) -> list[Any]:
    tokens: list[Any] = [None]
    for i in range(n):
        _, token, ok = b.set_state(_state(i + 1), tokens[-1])
        assert ok
        tokens.append(token)
    return tokens


def _gen_file(path: Path, gen: int) -> Path:
    seg = path / f"seg.{gen // 64}"
    return seg / f"state.{gen}" if seg.is_dir() else path / f"state.{gen}"


def _head(path: Path) -> int:
    return int((path / "head").read_text())


@pytest.mark.parametrize("age", [1, 15, 17, 63, 64, 65, 130, _MANY - 1])
def test_an_old_token_loses_even_after_its_generation_was_collected(
    tmp_path: Path, age: int
) -> None:
    b = _backend(tmp_path)
    tokens = _history(b, _MANY)
    stale = tokens[-1 - age]
    head_before = _head(tmp_path)
    blob, token, ok = FileRendezvousBackend(tmp_path).set_state(_state(-1), stale)
    assert not ok, f"a token {age} generations old won"
    assert token == tokens[-1] and _round(blob) == _MANY
    assert _head(tmp_path) == head_before  # head did not move backwards
    blob, token = FileRendezvousBackend(tmp_path).get_state()
    assert token == tokens[-1] and _round(blob) == _MANY


def test_none_token_loses_once_a_state_exists_even_after_collection(tmp_path: Path) -> None:
    b = _backend(tmp_path)
    tokens = _history(b, _MANY)
    blob, token, ok = FileRendezvousBackend(tmp_path).set_state(_state(-1), None)
    assert not ok and token == tokens[-1] and _round(blob) == _MANY
    assert FileRendezvousBackend(tmp_path).get_state()[1] == tokens[-1]


@pytest.mark.parametrize("bogus", [10**6, 10**18, -5, "invalid", 3.0, True, b"1"])
def test_a_token_never_issued_loses(tmp_path: Path, bogus: Any) -> None:
    b = _backend(tmp_path)
    tokens = _history(b, 5)
    blob, token, ok = b.set_state(_state(-1), bogus)
    assert not ok and token == tokens[-1] and _round(blob) == 5
    assert FileRendezvousBackend(tmp_path).get_state()[1] == tokens[-1]


def test_a_bogus_token_on_an_empty_backend_writes_nothing(tmp_path: Path) -> None:
    b = _backend(tmp_path)
    assert b.set_state(_state(1), 7) is None
    assert b.get_state() is None


def _racer(conn: Connection, path: str, seed: int, writes: int) -> None:
    """Write with the current token mostly, and with a random older one sometimes."""
    rng = random.Random(seed)
    b = FileRendezvousBackend(Path(path))
    seen: list[Any] = [None]
    wins = []
    observed = []
    while len(wins) < writes:
        cur = b.get_state()
        if cur is not None:
            observed.append(cur[1])
            seen.append(cur[1])
        token = rng.choice(seen[:-1]) if rng.random() < 0.3 and len(seen) > 1 else seen[-1]
        value = 0 if cur is None else _round(cur[0])
        _, new, ok = b.set_state(_state(value + 1), token) or (None, None, False)
        if ok:
            wins.append((token, new, value + 1))
            seen.append(new)
    conn.send((wins, observed))
    conn.close()
    os._exit(0)


def test_racing_writers_with_stale_tokens_form_one_chain(tmp_path: Path) -> None:
    """Four processes race, 30 % of attempts with an old token: one linear history."""
    _backend(tmp_path)
    pipes, procs = [], []
    for seed in range(4):
        parent, child = _CTX.Pipe(duplex=False)
        p = _CTX.Process(target=_racer, args=(child, str(tmp_path), seed, 60))
        p.start()
        pipes.append(parent)
        procs.append(p)
    results = []
    for parent, p in zip(pipes, procs, strict=True):
        assert parent.poll(120), "a writer did not finish"
        results.append(parent.recv())
        p.join(10)
    wins = sorted((w for r in results for w in r[0]), key=lambda w: w[1])
    outs = [w[1] for w in wins]
    assert len(set(outs)) == len(outs), "a generation was won twice (fork)"
    previous = None
    for token_in, token_out, value in wins:  # each win extends the previous one
        assert token_in == previous, (token_in, previous)
        assert value == wins.index((token_in, token_out, value)) + 1  # no lost update
        previous = token_out
    for _, observed in results:  # what each reader saw never went backwards
        assert observed == sorted(observed)
    assert _round(FileRendezvousBackend(tmp_path).get_state()[0]) == len(wins)


def test_a_state_with_wrong_field_types_is_a_malformed_record(tmp_path: Path) -> None:
    b = _backend(tmp_path)
    _, token, _ = b.set_state(_state(1), None)
    good = encode_state(State(round=3)).decode()
    body = good[9:].rstrip().replace('"round":3', '"round":"3"')
    line = f"{zlib.crc32(body.encode()):08x} {body}".ljust(HEADER_BYTES - 1) + "\n"
    _gen_file(tmp_path, token + 1).write_bytes(encode_record(token + 1, line.encode()))
    with pytest.raises(RendezvousStateError, match="round is '3'"):
        FileRendezvousBackend(tmp_path).get_state()


def test_a_corrupt_newest_state_raises_naming_the_file_not_an_empty_state(
    tmp_path: Path,
) -> None:
    b = _backend(tmp_path)
    _, token, _ = b.set_state(_state(1), None)
    _gen_file(tmp_path, token + 1).write_bytes(b"\x00garbage")
    with pytest.raises(RendezvousStateError, match=rf"state\.{token + 1}"):
        FileRendezvousBackend(tmp_path).get_state()
