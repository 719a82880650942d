"""The rendezvous state: a small JSON document, readable one row at a time.

What the protocol needs and nothing else (no pickle, no wall-clock time):

* ``round``: the round number; ``complete``: its members are fixed (ranks assigned);
  ``closed``: the run is over, nobody joins again;
* three disjoint *sections* of nodes, each kept sorted: ``participants`` (the round's
  members), ``waiting`` (nodes waiting for the next round: a late joiner makes the
  members re-form), ``spares`` (nodes waiting while the round is complete and full);
* ``last_call``: an opaque id of the current *last call* (the round has ``min_nodes``
  and waits a short while for more) or ``None``; every node times it from its own first
  observation on its own monotonic clock, so no clock of another node is ever compared;
* ``world`` and ``formed``: when the round completed, its size and the generation of the
  state that completed it. A member's **rank is its row** in the sorted participants,
  valid while ``len(participants) == world`` (a member removed from a complete round
  breaks the round for everyone: they re-form).

**Encoding.** One header line of :data:`HEADER_BYTES` and one fixed-width line per node
(participants, then waiting, then spares), each ``<crc32 hex> <json>`` padded with
spaces: JSON Lines with fixed offsets. A node that only needs the round, its own row,
its rank and rank 0 reads the header and binary-searches its row (:class:`StateView`):
``O(log N)`` small reads, not the whole state. Writers read and check everything
(:func:`decode_state`). Every field is checked strictly: types, ranges, sort order, the
per-line checksums, the counts against the length; anything else is a
:class:`MalformedRecordError`.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from slurm_elastic.errors import SlurmElasticError
from slurm_elastic.privatefs.records import crc_line, parse_crc_line

__all__ = [
    "HEADER_BYTES",
    "PARTICIPANTS",
    "SECTIONS",
    "SPARES",
    "WAITING",
    "MalformedRecordError",
    "Node",
    "State",
    "StateView",
    "decode_state",
    "encode_state",
]

#: The fixed size of the header line.
HEADER_BYTES = 256
#: Section indices, in file order.
PARTICIPANTS, WAITING, SPARES = 0, 1, 2
SECTIONS = (PARTICIPANTS, WAITING, SPARES)

_VERSION = 1
_WINDOW = 2048  # bytes of rows a binary search reads at once at its end
_MIN_ROW = 64
_MAX_ROW = 512
_ADDR = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,255}")
_MAX_INT = (1 << 63) - 1


# Defined here, not in errors.py, because its second base is torch's: torch's agent and
# backend API know RendezvousStateError, and errors.py imports nothing (no torch).
class MalformedRecordError(SlurmElasticError, RendezvousStateError):
    """A state record failed a check (format, checksum, field types or order)."""


@dataclass(frozen=True, order=True)
class Node:
    """One agent: its address, process id and a per-process counter.

    Ordered by ``(addr, pid, local_id)``: ranks follow this order. Its :attr:`name`
    (``addr_pid_localid``) names its heartbeat and intent files.

    Raises:
        ValueError: an address that is not a host name or IP address, or ids out of range.
    """

    addr: str
    pid: int
    local_id: int

    def __post_init__(self) -> None:
        if not isinstance(self.addr, str) or not _ADDR.fullmatch(self.addr):
            raise ValueError(
                f"node address {self.addr!r} is not a host name or IP address "
                "(letters, digits and . _ : % [ ] -, at most 255); set local_addr"
            )
        for value in (self.pid, self.local_id):
            if type(value) is not int or not 0 <= value <= _MAX_INT:
                raise ValueError(f"node id {value!r} is not a non-negative integer")

    @property
    def name(self) -> str:
        """``addr_pid_localid``."""
        return f"{self.addr}_{self.pid}_{self.local_id}"

    def __repr__(self) -> str:
        return self.name


@dataclass
class State:
    """The whole state, in memory (writers hold one; see the module docstring)."""

    round: int = 0
    complete: bool = False
    closed: bool = False
    last_call: int | None = None
    calls: int = 0  # last-call ids issued so far
    world: int | None = None
    formed: int | None = None
    participants: set[Node] = field(default_factory=set)
    waiting: set[Node] = field(default_factory=set)
    spares: set[Node] = field(default_factory=set)

    # -- the read interface shared with StateView -----------------------------------------

    def count(self, section: int) -> int:
        """The number of nodes in ``section``."""
        return len(self._section(section))

    def where(self, node: Node) -> int | None:
        """The section holding ``node``, or None."""
        for section in SECTIONS:
            if node in self._section(section):
                return section
        return None

    def index(self, node: Node, section: int) -> int | None:
        """``node``'s row in ``section`` (sorted order), or None."""
        rows = self.sorted(section)
        i = bisect.bisect_left(rows, node)
        return i if i < len(rows) and rows[i] == node else None

    def node_at(self, section: int, index: int) -> Node:
        """The node at row ``index`` of ``section``."""
        return self.sorted(section)[index]

    # -- writers' helpers ------------------------------------------------------------------

    def _section(self, section: int) -> set[Node]:
        return (self.participants, self.waiting, self.spares)[section]

    def sorted(self, section: int) -> list[Node]:
        """The nodes of ``section`` in row order."""
        return sorted(self._section(section))

    def members(self) -> set[Node]:
        """Every node in any section."""
        return self.participants | self.waiting | self.spares

    def copy(self) -> State:
        """A copy that may be changed without changing this one."""
        return State(
            self.round, self.complete, self.closed, self.last_call, self.calls, self.world,
            self.formed, set(self.participants), set(self.waiting), set(self.spares),
        )  # fmt: skip


# -- encoding ------------------------------------------------------------------------------


def _line(obj: Any, width: int) -> bytes:
    return crc_line(json.dumps(obj, separators=(",", ":"), ensure_ascii=True), width)


def encode_state(state: State) -> bytes:
    """The bytes of ``state`` (see the module docstring)."""
    sections = [state.sorted(s) for s in SECTIONS]
    rows = [[n.addr, n.pid, n.local_id] for sec in sections for n in sec]
    longest = max((len(json.dumps(r, separators=(",", ":"))) for r in rows), default=0)
    width = max(_MIN_ROW, -(-(longest + 10) // 32) * 32)
    header = {
        "v": _VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "last_call": state.last_call,
        "calls": state.calls,
        "world": state.world,
        "formed": state.formed,
        "n": [len(s) for s in sections],
        "row": width,
    }
    return _line(header, HEADER_BYTES) + b"".join(_line(r, width) for r in rows)


def _parse_line(raw: bytes, what: str) -> Any:
    try:
        return json.loads(parse_crc_line(raw))
    except ValueError as exc:  # RecordError, and JSON's
        raise MalformedRecordError(f"{what}: {exc}") from exc


def _int(value: Any, what: str, *, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise MalformedRecordError(f"{what} is {value!r}, not a non-negative integer")
    return value


@dataclass(frozen=True)
class _Header:
    round: int
    complete: bool
    closed: bool
    last_call: int | None
    calls: int
    world: int | None
    formed: int | None
    counts: tuple[int, int, int]
    row: int

    @staticmethod
    def parse(raw: bytes) -> _Header:
        if len(raw) != HEADER_BYTES:
            raise MalformedRecordError(f"header of {len(raw)} bytes, expected {HEADER_BYTES}")
        obj = _parse_line(raw, "header")
        keys = {"v", "round", "complete", "closed", "last_call", "calls", "world", "formed",
                "n", "row"}  # fmt: skip
        if not isinstance(obj, dict) or set(obj) != keys:
            raise MalformedRecordError(
                f"header fields {sorted(obj) if isinstance(obj, dict) else obj!r}"
            )
        if obj["v"] != _VERSION:
            raise MalformedRecordError(f"state format version {obj['v']!r}, expected {_VERSION}")
        for name in ("complete", "closed"):
            if type(obj[name]) is not bool:
                raise MalformedRecordError(f"{name} is {obj[name]!r}, not a boolean")
        counts = obj["n"]
        if not isinstance(counts, list) or len(counts) != 3:
            raise MalformedRecordError(f"counts {counts!r}")
        row = _int(obj["row"], "row width")
        if not _MIN_ROW <= row <= _MAX_ROW:
            raise MalformedRecordError(f"row width {row} outside {_MIN_ROW}..{_MAX_ROW}")
        header = _Header(
            _int(obj["round"], "round"), obj["complete"], obj["closed"],
            _int(obj["last_call"], "last_call", allow_none=True), _int(obj["calls"], "calls"),
            _int(obj["world"], "world", allow_none=True),
            _int(obj["formed"], "formed", allow_none=True),
            (_int(counts[0], "count"), _int(counts[1], "count"), _int(counts[2], "count")), row,
        )  # fmt: skip
        if header.complete and (header.world is None or header.formed is None):
            raise MalformedRecordError("a complete round without world size or generation")
        if header.complete and header.counts[0] > (header.world or 0):
            raise MalformedRecordError("more participants than the round's world size")
        return header

    def size(self) -> int:
        return HEADER_BYTES + sum(self.counts) * self.row

    def offset(self, section: int, index: int) -> int:
        return HEADER_BYTES + (sum(self.counts[:section]) + index) * self.row


def _node(raw: bytes, what: str) -> Node:
    obj = _parse_line(raw, what)
    if not isinstance(obj, list) or len(obj) != 3:
        raise MalformedRecordError(f"{what}: {obj!r} is not [addr, pid, local_id]")
    try:
        return Node(obj[0], obj[1], obj[2])
    except ValueError as exc:
        raise MalformedRecordError(f"{what}: {exc}") from exc


def decode_state(payload: bytes) -> State:
    """Parse and check a whole state (writers; see the module docstring).

    Raises:
        MalformedRecordError: any check failed.
    """
    header = _Header.parse(payload[:HEADER_BYTES])
    if len(payload) != header.size():
        raise MalformedRecordError(
            f"state of {len(payload)} bytes, its header says {header.size()}"
        )
    sections: list[set[Node]] = []
    for section in SECTIONS:
        nodes: list[Node] = []
        for i in range(header.counts[section]):
            at = header.offset(section, i)
            node = _node(payload[at : at + header.row], f"row {i} of section {section}")
            if nodes and not nodes[-1] < node:
                raise MalformedRecordError(f"section {section} is not sorted at row {i}")
            nodes.append(node)
        sections.append(set(nodes))
    if sum(len(s) for s in sections) != len(sections[0] | sections[1] | sections[2]):
        raise MalformedRecordError("a node appears in two sections")
    return State(
        header.round, header.complete, header.closed, header.last_call, header.calls,
        header.world, header.formed, *sections,
    )  # fmt: skip


class RowCache:
    """Rows already checked, by their bytes: shared by the views of one agent.

    A row's bytes (its CRC line) determine its node, so a row met again (in the next
    generation, or by the agent's other thread in the same one) is not parsed and
    checked again. Most of a view's cost is those checks: a lookup on a fresh view of
    4,096 rows checks 12-36 rows. Safe across threads (single dictionary operations);
    bounded: emptied when it holds ``limit`` rows.
    """

    def __init__(self, limit: int = 8192) -> None:
        self._nodes: dict[bytes, Node] = {}
        self._limit = limit

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, raw: bytes, section: int, index: int) -> Node:
        """The node of row ``raw`` (checked on first sight)."""
        node = self._nodes.get(raw)
        if node is None:
            node = _node(raw, f"row {index} of section {section}")
            if len(self._nodes) >= self._limit:
                self._nodes.clear()
            self._nodes[raw] = node
        return node


class StateView:
    """One published state, read lazily: the header, then single rows on demand.

    The same read interface as :class:`State` (``round``, ``complete``, ``closed``,
    ``last_call``, ``world``, ``formed``, :meth:`count`, :meth:`where`, :meth:`index`,
    :meth:`node_at`). Rows are found by binary search (each row checked on its own).

    Args:
        read_at: ``read_at(offset, size)`` returns those bytes of the payload.
        size: the payload's length.
        rows: rows checked before (by this agent's other views), reused.

    Raises:
        MalformedRecordError: the header or a row read is malformed.
    """

    def __init__(
        self, read_at: Callable[[int, int], bytes], size: int, rows: RowCache | None = None
    ) -> None:
        self._read_at = read_at
        self._cache = rows if rows is not None else RowCache()
        self._h = _Header.parse(read_at(0, HEADER_BYTES))
        if size != self._h.size():
            raise MalformedRecordError(f"state of {size} bytes, its header says {self._h.size()}")
        self._rows: dict[tuple[int, int], Node] = {}
        self._chunks: list[tuple[int, int, bytes]] = []  # (section, first row, raw rows)
        self._where: dict[Node, int | None] = {}
        self.round = self._h.round
        self.complete = self._h.complete
        self.closed = self._h.closed
        self.last_call = self._h.last_call
        self.calls = self._h.calls
        self.world = self._h.world
        self.formed = self._h.formed

    def count(self, section: int) -> int:
        """The number of nodes in ``section``."""
        return self._h.counts[section]

    def node_at(self, section: int, index: int) -> Node:
        """The node at row ``index`` of ``section`` (one read, then cached)."""
        key = (section, index)
        node = self._rows.get(key)
        if node is None:
            if not 0 <= index < self._h.counts[section]:
                raise IndexError(f"row {index} of section {section}")
            row = self._h.row
            raw = next(
                (
                    chunk[(index - first) * row : (index - first + 1) * row]
                    for sec, first, chunk in self._chunks
                    if sec == section and first <= index < first + len(chunk) // row
                ),
                None,
            )
            if raw is None:
                raw = self._read_at(self._h.offset(section, index), row)
            node = self._rows[key] = self._cache.node(raw, section, index)
        return node

    def index(self, node: Node, section: int) -> int | None:
        """``node``'s row in ``section`` by binary search, or None.

        Single rows are read until the candidates fit :data:`_WINDOW` bytes, which are
        then read at once: ``O(log N)`` reads of one row, plus one of the window.
        """
        lo, hi = 0, self._h.counts[section]
        window = max(1, _WINDOW // self._h.row)
        while lo < hi:
            if hi - lo <= window and not any(
                sec == section and first <= lo and hi <= first + len(c) // self._h.row
                for sec, first, c in self._chunks
            ):
                raw = self._read_at(self._h.offset(section, lo), (hi - lo) * self._h.row)
                self._chunks.append((section, lo, raw))
            mid = (lo + hi) // 2
            if self.node_at(section, mid) < node:
                lo = mid + 1
            else:
                hi = mid
        if lo < self._h.counts[section] and self.node_at(section, lo) == node:
            return lo
        return None

    def where(self, node: Node) -> int | None:
        """The section holding ``node``, or None (remembered per view)."""
        if node not in self._where:
            self._where[node] = next((s for s in SECTIONS if self.index(node, s) is not None), None)
        return self._where[node]


def ring_after(view: State | StateView, node: Node) -> Iterator[Node]:
    """The nodes after ``node`` in ring order (all sections in file order, wrapping).

    Lazy: a watcher that needs its next two successors reads two rows. ``node`` itself
    need not be in the state (then the ring starts where it would be).
    """
    counts = [view.count(s) for s in SECTIONS]
    total = sum(counts)
    start = 0
    for section in SECTIONS:
        i = view.index(node, section)
        if i is not None:
            start = sum(counts[:section]) + i + 1
            break
    for k in range(total):
        g = (start + k) % total
        for section in SECTIONS:
            if g < counts[section]:
                found = view.node_at(section, g)
                if found != node:
                    yield found
                break
            g -= counts[section]
