"""The round's store is sealed with the run key: an outsider cannot take a seat.

The reproduced attack: another user found the pending round in the (unauthenticated)
TCPStore, took the empty rank-0 seat before the real rank 0 and became the newcomers'
rank 0. Here that user is a real second local uid (``useradd``, removed afterwards) in a
forked child; the workers are real processes joining the way ElasticLoop joins in place
(tests/live/seat_worker.py), over a real TCPStore and gloo.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.live import auth
from slurm_elastic.privatefs import ensure_private_dir
from tests.helpers import Other, second_user, wait_for

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("seat_worker.py")
OUTSIDER = Path(__file__).with_name("outsider.py")
ROUND = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def other() -> Iterator[Other]:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip(reason="needs root and useradd to create a second local user")
    with second_user() as user:
        yield user


def test_an_outsider_who_reaches_the_store_cannot_take_a_seat(tmp_path: Path, other: Other) -> None:
    keys = ensure_private_dir(tmp_path / "rdzv" / ".keys", root=tmp_path / "rdzv")
    key_file = auth.load_or_create_key(keys, "run.key")
    drop = Path("/tmp") / f"se-outsider-{os.getpid()}"  # the outsider's own report
    drop.mkdir(mode=0o777, exist_ok=True)
    os.chmod(drop, 0o777)
    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True
    )  # the round's store, as the agent hosts it

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(auth.KEY_FILE_ENV, None)
    argv = [sys.executable, str(OUTSIDER), str(other.uid), str(other.gid), str(port)]
    argv += [str(ROUND), str(key_file), str(drop)]
    outsider_log = open(tmp_path / "outsider.log", "wb")  # noqa: SIM115 - closed with the test
    attacker = subprocess.Popen(argv, env=env, stdout=outsider_log, stderr=subprocess.STDOUT)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # The outsider is first: its rank-0 address is in the store before anyone's.
        def outsider_in_store() -> bool:
            log = (tmp_path / "outsider.log").read_text(errors="replace")
            assert attacker.poll() is None or any(
                k.startswith(f"slurm_elastic.live.{ROUND}/pg/") for k in master.list_keys()
            ), f"the outsider ended before writing its address:\n{log}"
            return any(k.startswith(f"slurm_elastic.live.{ROUND}/pg/") for k in master.list_keys())

        wait_for(outsider_in_store, 60, "the outsider's address in the round's store")
        env[auth.KEY_FILE_ENV] = str(key_file)

        def worker(rank: int) -> subprocess.Popen[bytes]:
            out = tmp_path / f"sum{rank}"
            argv = [sys.executable, str(WORKER), str(rank), "3", str(port), str(ROUND), str(out)]
            log = open(tmp_path / f"worker{rank}.log", "wb")  # noqa: SIM115 - closed with the test
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

        procs += [worker(1), worker(2)]
        # The newcomers see the outsider's value for rank 0 and wait for a sealed one.
        wait_for(
            lambda: "ignored" in (tmp_path / "worker1.log").read_text(errors="replace"),
            60,
            "a newcomer to ignore the outsider's rank-0 address",
        )
        procs.append(worker(0))  # the real rank 0 arrives late
        for p in procs:
            assert p.wait(180) == 0, "\n".join(
                (tmp_path / f"worker{r}.log").read_text(errors="replace") for r in range(3)
            )
        sums = [float((tmp_path / f"sum{r}").read_text()) for r in range(3)]
        assert sums == [6.0, 6.0, 6.0]  # 1 + 2 + 3: the outsider's 100 is in no sum
        assert (drop / "key").read_text() == "PermissionError"
        assert not (drop / "seated").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if attacker.poll() is None:
            attacker.kill()
        attacker.wait()
        shutil.rmtree(drop, ignore_errors=True)


# ------------------------------------------------------------------ sealing, one process


def test_sealed_values_open_only_with_their_key_name_and_round() -> None:
    run_key = os.urandom(32)
    k7, k8 = auth.round_key(run_key, 7), auth.round_key(run_key, 8)
    sealed = auth.seal(k7, "pg/0", b"10.0.0.1:4242")
    assert auth.unseal(k7, "pg/0", sealed) == b"10.0.0.1:4242"
    assert auth.unseal(k8, "pg/0", sealed) is None  # another round
    assert auth.unseal(k7, "pg/1", sealed) is None  # moved to another key
    flipped = bytearray(sealed)
    flipped[20] ^= 1
    assert auth.unseal(k7, "pg/0", bytes(flipped)) is None
    assert auth.unseal(k7, "pg/0", sealed[:-1]) is None
    assert b"10.0.0.1" not in sealed  # the address is not readable in the store
    assert auth.unseal(k7, "", auth.seal(k7, "", b"")) == b""


def test_a_value_that_does_not_open_is_waited_past_then_a_clear_timeout() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    store = auth.SealedStore(master, auth.round_key(os.urandom(32), 1), timedelta(seconds=0.5))
    master.set("x", b"not sealed")
    with pytest.raises(dist.DistStoreError, match="no value at 'x' sealed with this run's key"):
        store.get("x")
    assert store.opened("x") is None
    store.set("x", b"real")
    assert store.get("x") == b"real" and store.opened("x") == b"real"
    assert master.get("x") != b"real"


def test_the_run_key_is_created_once_private_and_refused_when_not(tmp_path: Path) -> None:
    keys = ensure_private_dir(tmp_path / "keys")
    path = auth.load_or_create_key(keys, "r.key")
    assert (path.stat().st_mode & 0o777) == 0o600
    first = auth.load_key(path)
    assert auth.load_key(auth.load_or_create_key(keys, "r.key")) == first  # not replaced
    os.chmod(path, 0o644)
    with pytest.raises(UnsafeDirectoryError, match=f"rm {path}"):
        auth.load_key(path)
    os.chmod(path, 0o600)
    link = keys / "link.key"
    link.symlink_to(path)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        auth.load_key(link)
