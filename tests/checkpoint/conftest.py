"""Fixtures for the checkpoint tests: a small real tmpfs (ENOSPC, read-only), a second
local user (the security cases). Both need root; tests skip with the reason otherwise."""

from __future__ import annotations

import gc
import os
import pwd
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount_tmpfs(path: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(reason="mounting a tmpfs needs root (ENOSPC / read-only tests)")
    path.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if res.returncode != 0:
        pytest.skip(reason=f"cannot mount a tmpfs here: {res.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "8m")
    try:
        yield mnt
    finally:
        gc.collect()  # loaded checkpoints are mmapped: drop them before unmounting
        res = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)
        if res.returncode != 0:  # still busy: detach now, freed when the last map goes
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """A second local user, created for the test (as root) and removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip(reason="creating a second local user needs root (security tests)")
    name = f"ckpt{uuid.uuid4().hex[:8]}"
    res = subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        pytest.skip(reason=f"useradd failed here: {res.stderr.strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
