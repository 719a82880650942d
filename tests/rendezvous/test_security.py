"""The state directory is private by construction (issue #9.3).

Every directory is created ``0700`` whatever the umask (also in a setgid,
group-writable parent); every component from a user-owned anchor down is checked;
operations go through directory descriptors without following links, so a swap after
the check cannot redirect a read or a write; a hostile tree is refused with an error
naming the path and the fix.

The hostile actor is a real second local user (``useradd`` here as root, removed
afterwards) in a group that may write the parent directory; its actions run in a
forked child that switched to that user.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from slurm_elastic.errors import RendezvousSetupError
from slurm_elastic.rendezvous import create_handler
from slurm_elastic.rendezvous.filesystem import RendezvousDir
from slurm_elastic.rendezvous.run_directory import Incarnation, RunDirectory
from tests.helpers import Other, second_user

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd to create a second local user",
)


@pytest.fixture
def other() -> Iterator[Other]:
    with second_user() as user:
        yield user


@pytest.fixture
def project(other: Other) -> Iterator[Path]:
    """A setgid project directory writable by the other user's group (like /proj/x)."""
    base = Path(tempfile.mkdtemp(prefix="se-sec-", dir="/tmp"))
    os.chmod(base, 0o711)  # traversable by the other user
    proj = base / "proj"
    proj.mkdir()
    os.chown(proj, 0, other.gid)
    os.chmod(proj, 0o2775)
    try:
        yield proj
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _params(endpoint: str = "", run_id: str = "r") -> RendezvousParameters:
    return RendezvousParameters("slurm", endpoint, run_id, 1, 1, local_addr="127.0.0.1")


def test_every_directory_is_0700_under_a_permissive_umask_in_a_setgid_parent(
    project: Path,
) -> None:
    old = os.umask(0o002)
    try:
        h = create_handler(_params(), environ={"SLURM_SUBMIT_DIR": str(project)})
    finally:
        os.umask(old)
    era = h.era.path
    dirs = [project / ".slurm_elastic", project / ".slurm_elastic" / "rdzv"]
    dirs += [era.parent, era, era / "hb", era / "keys", era / "seg.0"]
    for d in dirs:
        assert os.lstat(d).st_mode & 0o7777 == 0o700, (d, oct(os.lstat(d).st_mode))


def test_a_directory_planted_by_another_user_is_refused_naming_path_and_fix(
    project: Path, other: Other
) -> None:
    other.run(lambda: os.mkdir(project / ".slurm_elastic", 0o777))
    with pytest.raises(RendezvousSetupError, match=r"\.slurm_elastic is owned by uid.*Remove it"):
        create_handler(_params(), environ={"SLURM_SUBMIT_DIR": str(project)})


def test_a_planted_symlink_component_is_refused(project: Path, other: Other) -> None:
    mine = project / "mine"
    mine.mkdir(mode=0o700)
    other.run(lambda: os.symlink(mine, project / ".slurm_elastic"))
    with pytest.raises(RendezvousSetupError, match=r"\.slurm_elastic is a symbolic link"):
        create_handler(_params(), environ={"SLURM_SUBMIT_DIR": str(project)})


def test_a_group_writable_component_of_ours_is_refused_with_chmod_fix(project: Path) -> None:
    root = project / ".slurm_elastic"
    root.mkdir()
    os.chmod(root, 0o2770)  # what `mkdir -p` under umask 002 in a setgid dir gives
    with pytest.raises(RendezvousSetupError, match=r"chmod go-w \S*\.slurm_elastic\b"):
        create_handler(_params(), environ={"SLURM_SUBMIT_DIR": str(project)})


def test_a_swap_after_the_check_cannot_redirect_reads_or_writes(
    project: Path, other: Other
) -> None:
    """The other user renames our tree away and plants a look-alike with its own
    worker-store address: running agents keep using theirs; new ones refuse it."""
    root = project / ".slurm_elastic" / "rdzv"
    run = RunDirectory(root, "r", anchor=root.parent)
    era = run.select_era(Incarnation("g", "k"))
    era.publish_store(0, "node", "10.0.0.1", 1234)

    def swap() -> None:
        os.rename(project / ".slurm_elastic", project / ".moved")
        fake = project / ".slurm_elastic" / "rdzv" / "r" / f"era.{era.number}"
        fake.mkdir(parents=True)
        (fake / "store").write_text(
            json.dumps({"round": 0, "node": "node", "addr": "6.6.6.6", "port": 666})
        )

    # Our own tree is 0700, so the other user can only rename it from the group-
    # writable project directory; grant nothing else.
    other.run(swap)
    rec = era.read_store()
    assert rec is not None and rec["addr"] == "10.0.0.1"  # not the planted 6.6.6.6
    era.publish_store(1, "node", "10.0.0.2", 1235)  # writes land in our tree
    assert json.loads((project / ".moved" / "rdzv" / "r" / f"era.{era.number}" / "store")
                      .read_text())["addr"] == "10.0.0.2"  # fmt: skip
    with pytest.raises(RendezvousSetupError, match="owned by uid"):
        RunDirectory(root, "r", anchor=root.parent)


def test_explicit_endpoint_inside_another_users_directory_is_refused(
    project: Path, other: Other
) -> None:
    def plant() -> None:
        os.mkdir(project / "shared", 0o755)

    other.run(plant)
    # Nothing we own leads to the endpoint: the anchor is the other user's directory.
    with pytest.raises(RendezvousSetupError, match="owned by uid"):
        RendezvousDir.open_tree(project / "shared" / "rdzv", anchor=project / "shared")
