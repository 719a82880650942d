"""Private all the way down: every directory the product creates is 0700, whatever the
umask or a setgid group directory above it (issue: hostile neighbours).

The common HPC layout: a project directory owned by the PI, group-writable and setgid,
and users with umask 002. Before, ``.slurm_elastic`` and its ``checkpoints``, ``events``
and ``logs`` came out 2775 there (created with the umask before the private leaf), so a
group member could swap the victim's run directories. Real agent processes, real files;
the other owner is the system user ``nobody`` (needs root to chown; skipped otherwise).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from slurm_elastic.errors import UnsafeDirectoryError
from slurm_elastic.privatefs import ensure_private_dir
from tests.agent.conftest import single_agent

WORKER = """
import torch
from slurm_elastic import events
from slurm_elastic.checkpoint import CheckpointManager
manager = CheckpointManager.from_env(keep_last=2)
manager.save({"w": torch.ones(2)}, step=1)
events.emit("custom", value=1)
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def group_project(tmp_path: Path) -> Path:
    """A directory owned by another user, group-writable, setgid (a PI's project dir)."""
    project = tmp_path / "project"
    project.mkdir()
    os.chown(project, 65534, 100)  # nobody:users
    os.chmod(project, 0o2775)
    return project


def modes(top: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, _ in os.walk(top):
        for name in [".", *dirnames]:
            p = Path(dirpath, name) if name != "." else Path(dirpath)
            out[str(p.relative_to(top.parent))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def run_agent(project: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    argv, env = single_agent("r1", script)
    return subprocess.run(
        argv,
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(0o002),
    )


@needs_root
def test_every_directory_of_a_run_is_0700_under_umask_002_in_a_setgid_group_dir(
    tmp_path: Path,
) -> None:
    project = group_project(tmp_path)
    done = run_agent(project, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    state = project / ".slurm_elastic"
    found = modes(state)
    for sub in ("rdzv", "checkpoints/r1/step_1", "events/r1", "logs/r1"):
        assert f".slurm_elastic/{sub}" in found, sorted(found)
    not_private = {p: f"{m:04o}" for p, m in found.items() if m != 0o700}
    assert not not_private, not_private  # torch's attempt_<n> log directories included


@needs_root
def test_a_group_writable_state_directory_is_refused_with_the_chmod_to_run(
    tmp_path: Path,
) -> None:
    project = group_project(tmp_path)
    state = project / ".slurm_elastic"
    state.mkdir()
    os.chmod(state, 0o2775)
    done = run_agent(project, tmp_path)
    assert done.returncode != 0
    assert f"run: chmod go-w {state}" in done.stdout + done.stderr
    assert not (state / "checkpoints").exists()


# ---------------------------------------------------------------- ensure_private_dir


def test_missing_parents_are_created_0700_without_the_setgid_bit(tmp_path: Path) -> None:
    top = tmp_path / "shared"
    top.mkdir()
    os.chmod(top, 0o2775)
    old = os.umask(0o002)
    try:
        ensure_private_dir(top / "a" / "b" / "c", root=top / "a")
    finally:
        os.umask(old)
    for p in (top / "a", top / "a" / "b", top / "a" / "b" / "c"):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700, p


def test_a_group_writable_component_below_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state" / "events").mkdir(parents=True)
    os.chmod(tmp_path / "state", 0o700)
    os.chmod(tmp_path / "state" / "events", 0o775)
    with pytest.raises(UnsafeDirectoryError) as info:
        ensure_private_dir(tmp_path / "state" / "events" / "r1", root=tmp_path / "state")
    assert f"run: chmod go-w {tmp_path / 'state' / 'events'}" in str(info.value)
    assert not (tmp_path / "state" / "events" / "r1").exists()


def test_a_symlink_in_the_tree_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "state").mkdir(mode=0o700)
    (tmp_path / "state" / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        ensure_private_dir(tmp_path / "state" / "checkpoints" / "r1", root=tmp_path / "state")
    assert list(elsewhere.iterdir()) == []


@needs_root
def test_a_component_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state" / "events").mkdir(parents=True, mode=0o700)
    os.chown(tmp_path / "state" / "events", 65534, 65534)
    with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
        ensure_private_dir(tmp_path / "state" / "events" / "r1", root=tmp_path / "state")
