"""``--rdzv-backend etcd-v2``: torch's etcd backend under our agent, for sites that run etcd.

Uses a real etcd (Debian's ``etcd-server``, v2 API enabled) on 127.0.0.1 and torch's own
etcd-v2 handler (which needs the ``python-etcd`` client from the dev extras).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_elastic.agent import ExitCode
from tests.agent.conftest import AgentRun, agent_log, records
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _etcd_healthy(port: int) -> bool:
    try:
        import etcd  # python-etcd

        etcd.Client(host="127.0.0.1", port=port, protocol="http").read("/")
        return True
    except Exception:
        return False


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI") in ("true", "1"):
            pytest.fail("etcd is not installed: scripts/test.sh installs etcd-server as root")
        pytest.skip(reason="no etcd binary (Debian etcd-server; scripts/test.sh installs it)")
    pytest.importorskip("etcd", reason="python-etcd is in the dev extras")
    port, peer = _free_port(), _free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--enable-v2=true",
            "--data-dir",
            str(tmp_path / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "etcd.log", "wb"),  # noqa: SIM115
    )
    try:
        wait_for(lambda: _etcd_healthy(port), 30, "etcd to answer")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_two_agents_form_one_world_over_etcd_v2_and_finish(
    tmp_path: Path, agents: list[AgentRun], etcd_server: str
) -> None:
    for node in ("a", "b"):
        agents.append(
            AgentRun(
                tmp_path,
                tmp_path / "unused",
                "etcd1",
                "2",
                steps=30,
                node=node,
                backend="etcd-v2",
                endpoint=etcd_server,
            )
        )
    for run in agents:
        assert run.wait(150) == ExitCode.FINISHED, agent_log(run)
    starts = [r for r in records(tmp_path) if r["event"] == "start"]
    assert {r["world"] for r in starts} == {4}
    assert sorted(r["rank"] for r in starts) == [0, 1, 2, 3]
    assert len([r for r in records(tmp_path) if r["event"] == "done"]) == 4
