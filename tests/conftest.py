"""Shared pytest fixtures, and the layout of the suite (one axis: by package).

Each folder tests one package or top-level module of ``slurm_elastic``, every kind of
test for it together (pure, real processes, real Slurm): ``agent/``, ``checkpoint/``,
``cli/``, ``config/`` (config, envvars), ``live/``, ``notice/``, ``rendezvous/``,
``slurm/`` (the Slurm seam and parsers; the local cluster), ``submit/`` (templates,
plans, submission). ``package/`` checks the package as a whole (layers, torch-free
imports, code shape) and the sample ledger. Three suites cut across packages:
``faults/`` (the fault matrix on the real Slurm), ``e2e/`` (whole jobs on the real Slurm)
and ``readme/`` + ``examples/`` (what the documentation and the examples promise).
Markers say the cost: ``slurm``, ``netns``, ``slow``.

``slurm_cluster`` (session): the real local Slurm cluster of scripts/slurm-cluster.
It uses an already-running cluster (``SLURM_CONF`` in the environment, or the env file
in ``$SLURM_ELASTIC_CLUSTER_DIR``, default /var/tmp/slurm-elastic-cluster), else starts
one with ``scripts/slurm-cluster up`` (root only; in the mode scripts/test.sh would
choose) and leaves it up for the next run
(scripts/test.sh stops it). When no cluster can be had, tests using it are skipped with
the reason, except under ``CI=true``, where that is an error. While the session runs,
``SLURM_CONF`` is set in ``os.environ`` (sbatch and scontrol read it from there).

``slurm_netns_cluster``: the same cluster, skipping unless it runs in netns mode (real
per-node hostnames, IPs and port spaces).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slurm_elastic.errors import SlurmError
from slurm_elastic.slurm.commands import SlurmClient
from slurm_elastic.slurm.jobstate import JobInfo, JobState
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parent.parent
CLUSTER_SCRIPT = REPO / "scripts" / "slurm-cluster"
DEFAULT_CLUSTER_DIR = Path("/var/tmp/slurm-elastic-cluster")


@dataclass
class SlurmCluster:
    """A reachable Slurm cluster and a client bound to it.

    Attributes:
        env: the environment to run Slurm commands and jobs with (has SLURM_CONF).
        mode: ``netns``, ``loopback`` or ``external`` (not started by our script).
        client: the project's own seam, bound to ``env``.
        nodes: the node names of the default partition.
    """

    env: dict[str, str]
    mode: str
    client: SlurmClient = field(init=False)
    nodes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = SlurmClient(env=self.env, timeout_s=60)

    def wait_job(
        self,
        ref: str,
        until: Callable[[JobInfo], bool],
        timeout: float,
        what: str,
    ) -> JobInfo:
        """Poll ``ref``'s record until ``until(info)``; return it (AssertionError on timeout)."""
        last: list[JobInfo] = []

        def check() -> JobInfo | None:
            info = self.client.job_info(ref)
            last[:] = [info]
            return info if until(info) else None

        try:
            return wait_for(check, timeout, f"job {ref}: {what}", interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last record: {last[-1] if last else None}") from None

    def set_link(self, node: str, *, up: bool) -> None:
        """Connect or cut ``node``'s network (netns mode: a partition, no reset)."""
        subprocess.run(
            [str(CLUSTER_SCRIPT), "link", node, "up" if up else "down"],
            check=True,
            capture_output=True,
            timeout=30,
            env={**os.environ, **self.env},
        )

    def wait_state(self, ref: str, states: set[JobState], timeout: float = 60) -> JobInfo:
        """Poll until ``ref`` is in one of ``states``."""
        names = sorted(s.value for s in states)
        return self.wait_job(ref, lambda i: i.state in states, timeout, f"state in {names}")


def _read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export ") :]
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            parts = shlex.split(value)
            values[key.strip()] = parts[0] if parts else ""
    return values


def _cluster_env() -> dict[str, str] | None:
    conf = os.environ.get("SLURM_CONF")
    if conf and Path(conf).is_file():
        # Our script's env file lies next to its slurm.conf; it tells the mode.
        env_file = Path(conf).parent / "env"
        values = _read_env_file(env_file) if env_file.is_file() else {}
        if values.get("SLURM_CONF") != conf:
            values = {}
        return {**values, "SLURM_CONF": conf}
    env_file = Path(os.environ.get("SLURM_ELASTIC_CLUSTER_DIR", DEFAULT_CLUSTER_DIR)) / "env"
    if env_file.is_file():
        return _read_env_file(env_file)
    return None


def _connect(extra: dict[str, str]) -> SlurmCluster | None:
    env = {**os.environ, **extra}
    mode = extra.get("SLURM_ELASTIC_CLUSTER_MODE") or "external"
    cluster = SlurmCluster(env=env, mode=mode)
    try:
        cluster.client.check()
        out = cluster.client.run(["sinfo", "--noheader", "--Node", "--format=%N"]).stdout
    except SlurmError:
        return None
    cluster.nodes = sorted(set(out.split()))
    return cluster


def _cluster_mode() -> str:
    """The mode scripts/test.sh starts a cluster in: ``SLURM_ELASTIC_CLUSTER_MODE``, else
    ``auto`` (scripts/slurm-cluster picks netns where ``ip netns`` works, else loopback).
    A cluster this session starts is left up for the next run, which then uses it
    whatever its mode: a loopback one would skip the netns tests of every later run."""
    return os.environ.get("SLURM_ELASTIC_CLUSTER_MODE") or "auto"


def _start_cluster() -> str:
    """Run scripts/slurm-cluster up; return '' on success, else why not."""
    if os.geteuid() != 0:
        return "not root, so scripts/slurm-cluster up cannot start a local cluster"
    try:
        proc = subprocess.run(
            [str(CLUSTER_SCRIPT), "up", "--mode", _cluster_mode()],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scripts/slurm-cluster up failed: {exc}"
    if proc.returncode != 0:
        return f"scripts/slurm-cluster up exited {proc.returncode}: {proc.stderr[-2000:]}"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The local Slurm cluster (see the module docstring)."""
    extra = _cluster_env()
    cluster = _connect(extra) if extra is not None else None
    why = ""
    if cluster is None:
        why = _start_cluster()
        extra = _cluster_env()
        if not why:
            cluster = _connect(extra or {})
            if cluster is None:
                why = "scripts/slurm-cluster up succeeded but scontrol ping/sinfo fail"
    if cluster is None:
        message = f"no Slurm cluster: {why}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} (CI=true: a cluster is required)", pytrace=False)
        pytest.skip(reason=message)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    try:
        yield cluster
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


@pytest.fixture
def slurm_netns_cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The local cluster, when it runs in netns mode (skips otherwise)."""
    if slurm_cluster.mode != "netns":
        why = f"needs the cluster in netns mode, it runs in {slurm_cluster.mode!r} mode"
        pytest.skip(reason=why)
    return slurm_cluster


@pytest.fixture(autouse=True, scope="session")
def _private_run_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Agents started by any test record their run index under a session temp directory.

    The index normally lives in ``$XDG_STATE_HOME`` (``~/.local/state``); the suite must not
    write into the real home directory. ``tests/cli`` gives each test its own index on top.
    """
    previous = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    yield
    if previous is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = previous
