"""Issue #10.7: checkpoints are private, and nothing another user can write is ever read.

Real users: a second local user is created (as root) for the test and removed afterwards;
it writes files with its own uid through ``runuser``. The planted pickles would create a
marker file if they were ever unpickled.
"""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_elastic.checkpoint.manager import CheckpointManager
from slurm_elastic.checkpoint.manifest import Manifest, crc32_file
from slurm_elastic.errors import CheckpointError
from tests.checkpoint.test_sharded import run

UNTRUSTED = r"(owned by uid|writable by group/others|not a regular file|not a directory)"


class Payload:
    """Unpickling this runs ``touch <marker>``: code execution, observable."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the second user can traverse (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="ckpt-shared-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_as(user: pwd.struct_passwd, path: Path, data: bytes) -> None:
    """Write ``path`` as ``user`` (a real second uid), replacing what is there."""
    subprocess.run(
        ["runuser", "-u", user.pw_name, "--", "sh", "-c", 'rm -f "$1" && cat > "$1"', "-", path],
        input=data,
        check=True,
        timeout=60,
    )
    assert path.stat().st_uid == user.pw_uid


def test_checkpoint_directories_and_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        mgr = CheckpointManager(tmp_path / "ckpt")
        mgr.save({"w": torch.ones(4)}, 1)
    finally:
        os.umask(old)
    modes = {
        p.relative_to(tmp_path): stat.S_IMODE(p.stat().st_mode)
        for p in [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]
    }
    assert modes == {
        Path("ckpt"): 0o700,
        Path("ckpt/step_1"): 0o700,
        Path("ckpt/step_1/state.bin"): 0o600,
        Path("ckpt/step_1/manifest.json"): 0o600,
    }


def test_load_refuses_a_directory_owned_by_another_user(
    tmp_path: Path, other_user: pwd.struct_passwd
) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save({"w": torch.ones(4)}, 1)
    os.chown(tmp_path / "ckpt", other_user.pw_uid, -1)
    with pytest.raises(CheckpointError, match=rf"ckpt is owned by uid {other_user.pw_uid}"):
        CheckpointManager(tmp_path / "ckpt").load_latest()
    with pytest.raises(CheckpointError, match=UNTRUSTED):
        CheckpointManager(tmp_path / "ckpt").save({"w": torch.ones(4)}, 2)


@pytest.mark.parametrize("target", ["ckpt", "ckpt/step_1", "ckpt/step_1/state.bin"])
def test_load_refuses_paths_writable_by_others(tmp_path: Path, target: str) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save({"w": torch.ones(4)}, 1)
    os.chmod(tmp_path / target, (tmp_path / target).stat().st_mode | stat.S_IWGRP)
    with pytest.raises(CheckpointError, match=rf"{target} is writable by group/others.*chmod go-w"):
        mgr.load_latest()


def test_a_state_file_planted_by_another_user_is_refused(
    shared_dir: Path, other_user: pwd.struct_passwd
) -> None:
    """The old permissive directories let another user replace files (and fix the CRCs)."""
    directory = shared_dir / "ckpt"
    mgr = CheckpointManager(directory, weights_only=False)  # would unpickle anything
    mgr.save({"w": torch.ones(4)}, 1)
    for d in (directory, directory / "step_1"):
        os.chmod(d, 0o777)  # as the old code left them under a permissive umask
    marker = shared_dir / "pwned"
    state = directory / "step_1" / "state.pt"
    write_as(other_user, state, pickle.dumps(Payload(marker)))
    os.chmod(directory, 0o700)
    os.chmod(directory / "step_1", 0o700)  # only the file is foreign now
    old = Manifest.from_json((directory / "step_1" / "manifest.json").read_text(), source=state)
    size, crc = crc32_file(state)
    fixed = Manifest(1, "replicated", 1, (type(old.files[0])("state.pt", size, crc),))
    (directory / "step_1" / "manifest.json").write_text(fixed.to_json())
    with pytest.raises(CheckpointError, match=rf"state.pt is owned by uid {other_user.pw_uid}"):
        mgr.load_latest()
    assert not marker.exists(), "the planted pickle ran"


@pytest.mark.slow
def test_sharded_load_never_lets_dcp_unpickle_a_planted_metadata(
    shared_dir: Path, tmp_path: Path, other_user: pwd.struct_passwd
) -> None:
    """Reproduced before: a group member rewrote DCP's .metadata (and the manifest's CRC)
    and load_sharded ran their code in the training job."""
    ckpt = shared_dir / "ckpt"
    run("save", 1, tmp_path, ckpt)
    step = ckpt / "step_5"
    for d in (ckpt, step):
        os.chmod(d, 0o777)  # as the old code left them under a permissive umask
    marker = shared_dir / "pwned"
    write_as(other_user, step / ".metadata", pickle.dumps(Payload(marker)))
    text = (step / "manifest.json").read_text()
    old = Manifest.from_json(text, source=step)
    files = tuple(
        type(f)(f.name, *crc32_file(step / f.name)) if f.name == ".metadata" else f
        for f in old.files
    )
    forged = Manifest(5, "sharded", 1, files, created=old.created, metadata=old.metadata)
    write_as(other_user, step / "manifest.json", forged.to_json().encode())
    outs = run("refused", 1, tmp_path, ckpt, check=False)
    assert not marker.exists(), "DCP unpickled the planted .metadata: code ran"
    assert "REFUSED" in outs[0] and "writable by group/others" in outs[0], outs[0]


def test_symlink_loop_as_the_checkpoint_directory_gives_a_clear_message(tmp_path: Path) -> None:
    loop = tmp_path / "ckpt"
    loop.symlink_to(loop)
    mgr = CheckpointManager(loop)
    with pytest.raises(CheckpointError, match=r"ckpt .*symbolic link loop.*real directory"):
        mgr.save({"w": torch.ones(4)}, 1)
    with pytest.raises(CheckpointError, match="symbolic link loop"):
        mgr.load_latest()
