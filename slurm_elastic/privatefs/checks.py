"""The one check of a private path, and the words of its refusals (torch-free)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["link_problem", "parts_of", "prefix", "refusal"]


def refusal(
    path: str | Path, st: os.stat_result, *, kind: str = "dir", level: str = "strict"
) -> str | None:
    """Why ``path`` (its ``stat`` is ``st``) must not be used, or ``None``: the one check.

    Args:
        kind: ``"dir"`` or ``"file"`` (a regular file).
        level: ``"strict"``: not writable by group/others; ``"sticky"``: writable only
            with the sticky bit; ``"anchor"``: only the owner and the kind are checked.
    """
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory ({stat.filemode(st.st_mode)}); remove it or choose another path"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return (
            f"{path} is not a regular file ({stat.filemode(st.st_mode)}); links and "
            "special files are never read"
        )
    uid = os.geteuid()
    if st.st_uid != uid:
        return (
            f"{path} is owned by uid {st.st_uid}, not by you (uid {uid}): someone else "
            "controls what is in it. Remove it (or ask its owner to) or choose another path"
        )
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky_ok = level == "sticky" and st.st_mode & stat.S_ISVTX
    if writable and level != "anchor" and not sticky_ok:
        return (
            f"{path} is writable by group/others (mode {stat.filemode(st.st_mode)}): they "
            f"could swap what is in it. If you trust it, run: chmod go-w {path}"
        )
    return None


def link_problem(path: str, is_link: bool) -> str:
    kind = "a symbolic link" if is_link else "not a directory"
    return (
        f"{path} is {kind}; refusing to follow it (it could point anywhere). Remove it or "
        "use the real path"
    )


def parts_of(path: str) -> tuple[str, ...]:
    """The components of absolute normalised ``path``, ``"/"`` first (as ``Path.parts``)."""
    return ("/", *(p for p in path.split("/") if p))


def prefix(parts: tuple[str, ...], i: int) -> str:
    """The path of the first ``i`` components of ``parts``."""
    return "/" + "/".join(parts[1:i])
