"""Slurm hostlist expressions: ``node[1-3,5]`` -> ``node1 node2 node3 node5``.

Why our own ~50 lines rather than a library or ``scontrol show hostnames``:
``SlurmEnv.from_environ`` must stay a pure function usable where no Slurm client is
installed (containers: a missing ``scontrol`` made every node form a world of one in one
reported case), and the one maintained Python library (python-hostlist) is GPL, which a
BSD-licensed library cannot depend on. The tests compare this parser with ``scontrol show
hostnames`` on the real local cluster, so agreement with Slurm itself is checked.

Grammar handled (everything Slurm prints): comma-separated items at bracket depth 0; each
item is text with any number of ``[...]`` groups (``r[1-2]n[3-4]`` is a cross product, left
group outermost, like Slurm); a group is a comma list of ``N`` or ``A-B`` ranges; the width
of zero-padded bounds is kept (``n[001-010]``); an optional ``-STEP``-less form only.
"""

from __future__ import annotations

import itertools
import re

from slurm_elastic.errors import SlurmEnvError

__all__ = ["expand_hostlist"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_MAX_HOSTS = 1_000_000


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmEnvError(f"nested '[' in hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"unbalanced ']' in hostlist {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmEnvError(f"unbalanced '[' in hostlist {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_group(group: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise SlurmEnvError(
                f"bad range {part!r} in hostlist {whole!r}: expected N or A-B with digits"
            )
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise SlurmEnvError(f"descending range {part!r} in hostlist {whole!r}")
        if hi - lo >= _MAX_HOSTS:
            raise SlurmEnvError(f"range {part!r} in hostlist {whole!r} is too large")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_item(item: str, whole: str) -> list[str]:
    pieces: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", item):
        pieces.append([item[pos : m.start()]])
        pieces.append(_expand_group(m.group(1), whole))
        pos = m.end()
    pieces.append([item[pos:]])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    Args:
        hostlist: e.g. ``"n[1-3,5],gpu[01-02],login"`` or ``"r[1-2]n[3-4]"``.

    Returns:
        The host names; duplicates are kept in order of appearance, as Slurm does.

    Raises:
        SlurmEnvError: the expression is malformed (names the expression and the part).
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_item(item, hostlist))
    return hosts
