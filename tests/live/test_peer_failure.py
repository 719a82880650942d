"""A failed peer is recognised by type, never by the exception's text (issue 19).

What torch (2.13 and 2.14.1) raises, on real processes:

* a gloo peer SIGKILLed while the survivor waits in a collective, or in DDP's all-reduce
  inside ``loss.backward()``: a plain ``RuntimeError`` ("Connection closed by peer"),
  and gloo closes that pair's connection before it raises;
* a gloo collective whose peer stays silent past the group's timeout: a plain
  ``RuntimeError`` ("Timed out waiting ... for recv"), the pair closed as well;
* a TCPStore whose server is gone: ``DistNetworkError``; a store wait that times out:
  ``DistStoreError``.

:func:`is_peer_failure` takes the ``DistError`` family by type and a plain
``RuntimeError`` only while a connection of the current gloo group is lost; a shape
mismatch (a plain ``RuntimeError`` too) or a ``ValueError`` on an intact group is a bug.
The workers join the way the loop joins in place (tests/live/peer_failure_worker.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from slurm_elastic.errors import PeerLostError, ReformTimeoutError
from slurm_elastic.live import is_peer_failure
from tests.helpers import wait_for
from tests.live.gloo_round import gloo_round

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("peer_failure_worker.py")


def _run(tmp_path: Path, scenario: str, *, timeout_s: float, kill: bool) -> dict[str, object]:
    with gloo_round(tmp_path, WORKER, 2, scenario, timeout_s, tmp_path) as workers:
        procs = workers.procs

        def both_ready() -> bool:
            assert all(p.poll() is None for p in procs), workers.logs()
            return (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists()

        wait_for(both_ready, 120, "both workers in the group")
        if kill:
            # rank 0 is entering its operation, which waits for the silent rank 1 (a kill
            # just before the call fails the same way: the pair's connection is gone)
            wait_for(lambda: (tmp_path / "entering0").exists(), 60, "rank 0's operation")
            procs[1].send_signal(signal.SIGKILL)
        assert procs[0].wait(120) == 0, workers.logs()
        return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("operation", ["all_reduce", "backward"])
def test_a_peer_killed_mid_collective_is_a_peer_failure(tmp_path: Path, operation: str) -> None:
    result = _run(tmp_path, operation, timeout_s=60, kill=True)
    # torch raises gloo's error as a plain RuntimeError: the lost connection decides
    assert result["type"] == "builtins.RuntimeError", result
    assert result["peer_failure"] is True, result


@pytest.mark.slow  # waits out the group's timeout
def test_a_collective_timed_out_on_a_silent_peer_is_a_peer_failure(tmp_path: Path) -> None:
    result = _run(tmp_path, "all_reduce", timeout_s=10, kill=False)
    assert result["type"] == "builtins.RuntimeError", result
    assert result["peer_failure"] is True, result


@pytest.mark.slow  # waits out gloo's connect timeout
def test_a_peer_gone_while_the_gloo_group_forms_is_a_peer_failure(tmp_path: Path) -> None:
    """Rank 0 publishes its gloo address and dies: gloo's connectFullMesh raises a plain
    RuntimeError ("Connect timeout"); LiveWorld._join raises it as PeerLostError. (Now
    and then gloo completes the connect its kernel accepted before the death: the first
    collective then fails, a peer failure as well.)"""
    with gloo_round(tmp_path, WORKER, 2, "formation", 8, tmp_path) as workers:
        survivor = workers.procs[1].wait(180)
        # rank 0 is SIGKILLed by its own store write (or aborted by gloo just before)
        assert workers.procs[0].wait(60) in (-signal.SIGKILL, -signal.SIGABRT), workers.logs()
        logs = workers.logs()
    if survivor == -signal.SIGABRT:
        # Now and then (2 of ~40 runs on a loaded 2-core machine; 0 of 26 unloaded) gloo
        # itself aborts the survivor while the group forms: std::terminate in torch's C++,
        # which no Python code can catch. The agent sees a failed worker and restarts it
        # (docs/live.md, Limits). What this test checks is the classification otherwise.
        assert "terminate called" in logs, logs
        pytest.skip(reason="gloo aborted the surviving process (std::terminate, not catchable)")
    assert survivor == 0, logs
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["peer_failure"] is True, result
    if result["stage"] == "join":  # usually: connectFullMesh's "Connect timeout"
        assert result["type"] == "slurm_elastic.errors.PeerLostError", result
        assert result["cause"] == "builtins.RuntimeError", result  # what torch raised
        assert "did not form" in str(result["message"])
    else:  # gloo finished connecting before the death reached it: the collective fails
        assert result["type"] == "builtins.RuntimeError", result


def test_a_bug_on_an_intact_group_is_not_a_peer_failure(tmp_path: Path) -> None:
    with gloo_round(tmp_path, WORKER, 2, "bug", 60, tmp_path) as workers:
        for p in workers.procs:
            assert p.wait(180) == 0, workers.logs()
    for rank in (0, 1):
        shape, value = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert shape["type"] == "builtins.RuntimeError", shape  # the type gloo's has too
        assert "shapes cannot be multiplied" in str(shape["message"])
        assert shape["peer_failure"] is False, shape
        assert value["type"] == "builtins.ValueError" and value["peer_failure"] is False


_STORE_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
store.set("k", "v")
print(store.port, flush=True)
time.sleep(600)
"""


def test_a_store_whose_server_died_is_a_peer_failure() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", _STORE_SERVER],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), use_libuv=True
        )
        assert client.get("k") == b"v"
        server.kill()
        server.wait()
        with pytest.raises(dist.DistNetworkError) as caught:
            client.get("k")
        assert is_peer_failure(caught.value)
        with pytest.raises(dist.DistNetworkError) as caught:  # and reconnecting
            dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1), use_libuv=True
            )
        assert is_peer_failure(caught.value)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def test_a_store_wait_that_times_out_is_a_peer_failure() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    master.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(dist.DistStoreError) as caught:
        master.get("a peer's key that never comes")
    assert is_peer_failure(caught.value)


def test_errors_are_classified_by_type_not_by_their_text() -> None:
    # no gloo group in this process: a plain RuntimeError is never a peer failure,
    # whatever its message says
    assert not is_peer_failure(RuntimeError("[gloo] Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("Timed out waiting 5000ms for recv operation"))
    assert not is_peer_failure(ValueError("Connection reset"))
    assert not is_peer_failure(ReformTimeoutError("no round"))  # ours: not a peer failure
    for exc in (
        dist.DistNetworkError("x"),
        dist.DistStoreError("x"),
        dist.DistBackendError("x"),
        PeerLostError("x"),
    ):
        assert is_peer_failure(exc), exc
