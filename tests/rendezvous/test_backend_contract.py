"""The ``RendezvousBackend`` contract, run against our backend and torch's c10d FileStore.

Torch's ``C10dRendezvousBackend`` over a ``FileStore`` is the reference: every test of
:class:`BackendContract` must hold for both. Tests specific to a shared directory
(torn and planted files, a writer killed mid-write) follow.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from slurm_elastic.rendezvous import filesystem as fs
from slurm_elastic.rendezvous.backend import SEGMENT, FileRendezvousBackend, encode_record
from slurm_elastic.rendezvous.state import State, decode_state, encode_state
from tests.helpers import wait_for

_CTX = mp.get_context("fork")

BackendFactory = Callable[[Path], Any]


def _ours(path: Path) -> FileRendezvousBackend:
    path.mkdir(mode=0o700, exist_ok=True)
    return FileRendezvousBackend(path)


def _torch_file_store(path: Path) -> C10dRendezvousBackend:
    store = dist.FileStore(str(path / "filestore"), -1)
    return C10dRendezvousBackend(store, "contract")


def _state(round_: int) -> bytes:
    return encode_state(State(round=round_))


def _round(blob: bytes) -> int:
    return decode_state(blob).round


def _increment_worker(factory: BackendFactory, path: Path, times: int) -> None:
    backend = factory(path)
    for _ in range(times):
        while True:
            current = backend.get_state()
            token = None if current is None else current[1]
            value = 0 if current is None else _round(current[0])
            _, _, ok = backend.set_state(_state(value + 1), token)
            if ok:
                break
    os._exit(0)


def _forever_writer(factory: BackendFactory, path: Path) -> None:
    backend = factory(path)
    while True:
        current = backend.get_state()
        token = None if current is None else current[1]
        value = 0 if current is None else _round(current[0])
        backend.set_state(_state(value + 1), token)


@pytest.mark.parametrize("factory", [_ours, _torch_file_store], ids=["slurm", "c10d_filestore"])
class TestBackendContract:
    def test_empty_backend_has_no_state(self, tmp_path: Path, factory: BackendFactory) -> None:
        assert factory(tmp_path).get_state() is None

    def test_set_without_token_creates_only_once(
        self, tmp_path: Path, factory: BackendFactory
    ) -> None:
        b = factory(tmp_path)
        blob, token, ok = b.set_state(_state(1), None)
        assert ok and _round(blob) == 1
        blob2, token2, ok2 = b.set_state(_state(2), None)
        assert not ok2 and _round(blob2) == 1 and token2 == token
        assert _round(b.get_state()[0]) == 1

    def test_compare_and_set_with_current_token_wins(
        self, tmp_path: Path, factory: BackendFactory
    ) -> None:
        b = factory(tmp_path)
        _, token, _ = b.set_state(_state(1), None)
        blob, token2, ok = b.set_state(_state(2), token)
        assert ok and _round(blob) == 2 and token2 != token
        assert b.get_state()[1] == token2

    def test_stale_token_loses_and_returns_current_state(
        self, tmp_path: Path, factory: BackendFactory
    ) -> None:
        a, b = factory(tmp_path), factory(tmp_path)
        _, t1, _ = a.set_state(_state(1), None)
        _, t2, ok = a.set_state(_state(2), t1)
        assert ok
        blob, token, ok = b.set_state(_state(99), t1)  # b still holds t1
        assert not ok and _round(blob) == 2 and token == t2
        blob, _, ok = b.set_state(_state(3), token)  # retry with the returned token
        assert ok and _round(blob) == 3

    def test_concurrent_writers_in_processes_lose_no_update(
        self, tmp_path: Path, factory: BackendFactory
    ) -> None:
        if factory is _torch_file_store:
            # Not a contract torch's FileStore keeps either: in a CI-path run on torch
            # 2.14.1 four processes of 15 compare-and-sets each ended at round 56, not 60
            # (4 updates lost; 2026-12-02). Whether writers interleave that way is luck,
            # so the case is ours only (ours: one linear history, test_linear_history.py).
            pytest.skip(reason="torch's FileStore lost compare-and-set updates (see comment)")
        procs = [
            _CTX.Process(target=_increment_worker, args=(factory, tmp_path, 15)) for _ in range(4)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert _round(factory(tmp_path).get_state()[0]) == 60

    def test_writer_killed_mid_flight_blocks_nobody(
        self, tmp_path: Path, factory: BackendFactory
    ) -> None:
        if factory is _torch_file_store:
            # Not a contract torch's FileStore keeps: it appends records to one file, and
            # a writer SIGKILLed mid-append leaves a torn record that every later reader
            # spins on forever (seen in a CI-path run: the reader in FileStore::get ->
            # refresh -> read() for over 8 minutes, native stack via py-spy). Whether a
            # kill lands mid-append is luck, so the case is ours only.
            pytest.skip(reason="torch's FileStore blocks readers after a torn append (see comment)")
        factory(tmp_path).set_state(_state(0), None)
        victims = [_CTX.Process(target=_forever_writer, args=(factory, tmp_path)) for _ in range(2)]
        for v in victims:
            v.start()
        b = factory(tmp_path)
        wait_for(lambda: _round(b.get_state()[0]) > 20, 30, "the writers to make progress")
        for v in victims:  # killed at an arbitrary point of a write
            os.kill(v.pid, signal.SIGKILL)
            v.join(10)
        deadline = time.monotonic() + 10
        while True:  # a survivor still completes a compare-and-set promptly
            blob, token = b.get_state()
            _, _, ok = b.set_state(_state(_round(blob) + 1), token)
            if ok:
                break
            assert time.monotonic() < deadline


def test_torn_and_garbage_newest_records_raise_naming_the_file(tmp_path: Path) -> None:
    b = _ours(tmp_path)
    _, token, _ = b.set_state(_state(7), None)
    good = encode_record(token + 1, _state(8))
    seg = tmp_path / "seg.0"
    (seg / f"state.{token + 1}").write_bytes(good[: len(good) // 2])  # torn
    with pytest.raises(RendezvousStateError, match=rf"seg.0/state.{token + 1}.*malformed"):
        FileRendezvousBackend(tmp_path).get_state()
    (seg / f"state.{token + 1}").write_bytes(b"garbage")
    with pytest.raises(RendezvousStateError, match="bad magic"):
        FileRendezvousBackend(tmp_path).get_state()
    os.unlink(seg / f"state.{token + 1}")  # the documented fix: back to the previous one
    blob, latest = FileRendezvousBackend(tmp_path).get_state()
    assert _round(blob) == 7 and latest == token


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_a_planted_pickle_is_refused_not_executed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    b = _ours(tmp_path / "s")
    _, token, _ = b.set_state(_state(1), None)
    (tmp_path / "s" / "seg.0" / f"state.{token + 1}").write_bytes(
        encode_record(token + 1, pickle.dumps(_Evil()))
    )
    with pytest.raises(RendezvousStateError, match="malformed"):
        FileRendezvousBackend(tmp_path / "s").get_state()
    with pytest.raises(RendezvousStateError, match="malformed"):
        FileRendezvousBackend(tmp_path / "s").view()  # the lazy reader refuses it too
    assert not (tmp_path / "pwned").exists()


def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    b = _ours(tmp_path / "s")
    _, token, _ = b.set_state(_state(1), None)
    outside = tmp_path / "outside"
    outside.write_bytes(encode_record(token + 1, _state(666)))
    os.symlink(outside, tmp_path / "s" / "seg.0" / f"state.{token + 1}")
    with pytest.raises(RendezvousStateError, match="malformed"):
        FileRendezvousBackend(tmp_path / "s").get_state()


def test_files_are_private_and_old_generations_are_collected(tmp_path: Path) -> None:
    b = _ours(tmp_path)
    _blob, token = None, None
    for i in range(4 * SEGMENT + 3):
        _blob, token, ok = b.set_state(_state(i), token)
        assert ok
    segs = sorted(n for n in os.listdir(tmp_path) if n.startswith("seg."))
    assert segs == ["seg.3", "seg.4"], segs
    names = [f"{s}/{n}" for s in segs for n in os.listdir(tmp_path / s)]
    assert len(names) == SEGMENT + 4, names
    for name in [*names, "head"]:
        assert (os.stat(tmp_path / name).st_mode & 0o777) == 0o600
    for name in segs:
        assert (os.stat(tmp_path / name).st_mode & 0o777) == 0o700
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_reads_cost_constant_metadata_operations(tmp_path: Path) -> None:
    b = _ours(tmp_path)
    token = None
    for i in range(5):
        _, token, _ = b.set_state(_state(i), token)
    reader = FileRendezvousBackend(tmp_path)
    reader.get_state()
    fs.FS_OPS.reset()
    for _ in range(10):
        reader.get_state()
    assert fs.FS_OPS.total() <= 10 * 2  # head + one probe; content cached
