"""The shared file primitives of ``slurm_elastic/privatefs.py`` on hostile ground.

One implementation reads and writes the small files of the rendezvous, the node channel,
the run index, the run keys and the checkpoint manifests, so these properties are tested
once, here, on the real filesystem: what someone plants at a name (a FIFO, a link, a
directory, a huge file, another user's file) is refused or replaced, never opened
through, and never blocks. The other owner is the system user ``nobody`` (chown needs
root; that case is skipped otherwise).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from slurm_elastic.privatefs import publish_exclusive, read_regular, replace_file, write_new


def _errno(exc: pytest.ExceptionInfo[OSError]) -> int | None:
    return exc.value.errno


def test_read_regular_returns_the_content_or_none(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    got = read_regular(tmp_path / "f", limit=3)
    assert got is not None and got[0] == b"abc" and stat.S_ISREG(got[1].st_mode)
    assert read_regular(tmp_path / "missing", limit=3) is None
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:  # relative to an open directory
        got = read_regular("f", limit=3, dir_fd=dfd)
        assert got is not None and got[0] == b"abc"
    finally:
        os.close(dfd)


def test_read_regular_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    """A FIFO planted at the name: refused without waiting for a writer (a blocking open
    would hang the reader forever)."""
    os.mkfifo(tmp_path / "f")
    result: list[int | None] = []

    def read() -> None:
        try:
            read_regular(tmp_path / "f", limit=10)
            result.append(None)
        except OSError as exc:
            result.append(exc.errno)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert result == [errno.EISDIR], "the read blocked on the FIFO, or accepted it"


def test_read_regular_refuses_links_directories_and_large_files(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 11)
    (tmp_path / "secret").write_bytes(b"not for you")
    os.symlink(tmp_path / "secret", tmp_path / "link")
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError) as exc:
        read_regular(tmp_path / "link", limit=100)
    assert _errno(exc) == errno.ELOOP
    with pytest.raises(OSError) as exc:
        read_regular(tmp_path / "dir", limit=100)
    assert _errno(exc) == errno.EISDIR
    with pytest.raises(OSError) as exc:
        read_regular(tmp_path / "big", limit=10)
    assert _errno(exc) == errno.EFBIG and "11 bytes" in str(exc.value)
    assert read_regular(tmp_path / "big", limit=11) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_read_regular_refuses_another_users_file_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"{}")
    os.chown(path, 65534, 65534)  # nobody
    assert read_regular(path, limit=10) is not None  # not asked
    with pytest.raises(OSError) as exc:
        read_regular(path, limit=10, owned=True)
    assert _errno(exc) == errno.EPERM and "65534" in str(exc.value)


def test_write_new_never_opens_what_exists(tmp_path: Path) -> None:
    os.symlink(tmp_path / "elsewhere", tmp_path / "dangling")
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "dangling", b"x")  # a dangling link is not followed
    assert not (tmp_path / "elsewhere").exists()
    old = os.umask(0)
    try:
        write_new(tmp_path / "new", b"data")
    finally:
        os.umask(old)
    assert (tmp_path / "new").read_bytes() == b"data"
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600  # not the umask's 0666
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "new", b"again")
    assert (tmp_path / "new").read_bytes() == b"data"


def test_replace_file_replaces_a_planted_link_instead_of_writing_through_it(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, tmp_path / "target")
    replace_file(tmp_path / "target", b"new")
    assert victim.read_bytes() == b"keep me"
    assert not (tmp_path / "target").is_symlink()
    assert (tmp_path / "target").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target", "victim"]  # no tmp left


def test_replace_file_removes_what_was_planted_at_its_fixed_temporary_name(
    tmp_path: Path,
) -> None:
    """A FIFO at the writer's fixed temporary name would block a plain open for writing
    until a reader came; it is removed, never opened."""
    os.mkfifo(tmp_path / ".f.tmp")
    done = threading.Event()

    def write() -> None:
        replace_file(tmp_path / "f", b"content", tmp=".f.tmp", clear_tmp=True)
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(10), "the writer blocked on the FIFO"
    assert (tmp_path / "f").read_bytes() == b"content"
    assert not (tmp_path / ".f.tmp").exists()


def test_replace_file_cleans_up_when_the_rename_fails(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "inside").write_bytes(b"")  # a non-empty directory: rename fails
    with pytest.raises(OSError):
        replace_file(tmp_path / "d", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_publish_exclusive_lets_the_first_writer_win(tmp_path: Path) -> None:
    assert publish_exclusive(tmp_path / "key", b"first", fsync=True)
    assert not publish_exclusive(tmp_path / "key", b"second")
    assert (tmp_path / "key").read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # the temporary files are gone
    os.symlink(tmp_path / "elsewhere", tmp_path / "planted")
    assert not publish_exclusive(tmp_path / "planted", b"x")  # a link counts as taken
    assert not (tmp_path / "elsewhere").exists()
