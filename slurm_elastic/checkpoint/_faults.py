"""Fault-injection seam for tests (private; production code never installs a hook).

The write, commit and retention paths call :func:`point` with a name at each place where a
crash matters (``"after_mkdir"``, ``"mid_data"``, ``"before_manifest"``, ``"before_commit"``,
``"between_renames"``, ``"after_commit"``, ``"mid_retention"``), and the read path before
each read of a data file (``"read_file"``: a hook may raise the ``OSError`` a failing disk
would, e.g. EIO, which cannot be produced for real here). Tests install a hook in a child
process that blocks at a chosen point, then SIGKILL the child there: a real crash at a
deterministic place. The hook is process-wide and deliberately not a constructor
argument of any public class.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["install", "point"]

_hook: Callable[[str], None] | None = None


def install(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Install ``hook`` (``None`` removes it); return the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def point(name: str) -> None:
    """Called by the checkpoint code at crash-relevant point ``name``."""
    hook = _hook
    if hook is not None:
        hook(name)
