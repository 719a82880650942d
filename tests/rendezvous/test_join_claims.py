"""Join intents at scale: one claimant merges, nobody else lists the intents (#9.7).

Listing the intents directory from every pending node made a formation O(N^2) in CPU
(1,024 nodes each listing ~1,024 names, several times); the merge is now claimed with
one exclusive ``mkdir`` per state generation, and only the winner lists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from slurm_elastic.rendezvous import create_handler
from slurm_elastic.rendezvous import filesystem as fs
from tests.rendezvous.harness import NodeProc, check_world, rdzv_all

CONF = {"join_timeout": "60", "heartbeat_interval": "0.25", "heartbeat_miss_limit": "4"}


def _form_in_threads(
    root: Path, n: int, before: Callable[[], None] | None = None
) -> tuple[list[Any], dict[str, int]]:
    handlers = [
        create_handler(
            RendezvousParameters("slurm", str(root), "run", n, n, local_addr="10.0.0.1", **CONF),
            environ={},
        )
        for _ in range(n)
    ]
    ranks: list[Any] = [None] * n
    start = threading.Event()

    def agent(i: int) -> None:
        start.wait()
        try:
            seat = handlers[i].join_round(time.monotonic() + 60)
            ranks[i] = None if seat is None else seat.rank
        except Exception as exc:
            ranks[i] = repr(exc)

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    if before is not None:
        before()
    fs.FS_OPS.reset()
    start.set()
    for t in threads:
        t.join(60)
    ops = fs.FS_OPS.snapshot()
    for h in handlers:
        h._era.dir.close()
    return ranks, ops


def test_pending_nodes_do_not_list_the_intents(tmp_path: Path) -> None:
    ranks, ops = _form_in_threads(tmp_path, 64)
    assert sorted(ranks) == list(range(64)), ranks
    # The claimant lists a few times (gather, merge, release); 64 listings or more
    # means every pending node lists (O(N) names each).
    assert ops.get("listdir", 0) <= 12, ops
    assert ops.get("link", 0) <= 3, ops  # one merge for a simultaneous start (+ slack)


def test_a_claimant_that_died_before_merging_is_taken_over(tmp_path: Path) -> None:
    made: list[NodeProc] = []
    try:
        for _ in range(2):
            node = NodeProc(tmp_path, "run", 2, 2)
            made.append(node)
            node.call("create")
        # What a node SIGKILLed right after winning the claim of generation 0 leaves.
        (next((tmp_path / "run").glob("era.*")) / "intents" / ".merge.0").mkdir(mode=0o700)
        started = time.monotonic()
        check_world(rdzv_all(made, timeout=30), 2)
        # Pending nodes merge themselves after the takeover time (window 4 x 0.25 s).
        assert time.monotonic() - started >= 0.9
    finally:
        for node in made:
            node.close()


def test_taking_over_a_dead_claimant_lists_nothing_per_node(tmp_path: Path) -> None:
    """64 nodes pending behind a claimant that died (its claim of generation 0 made, no
    merge): after the takeover time one node per slot merges; the others do not list
    the intents to find their turn (64 listings of 64 names after every merge, at 4,096
    nodes a formation that never ended on a loaded machine)."""

    def dead_claimant() -> None:
        (next((tmp_path / "run").glob("era.*")) / "intents" / ".merge.0").mkdir(mode=0o700)

    started = time.monotonic()
    ranks, ops = _form_in_threads(tmp_path, 64, before=dead_claimant)
    assert sorted(ranks) == list(range(64)), ranks
    assert time.monotonic() - started >= 0.9  # the takeover time (4 x 0.25 s) passed
    assert ops.get("listdir", 0) <= 16, ops


def test_merge_claims_stay_bounded_over_rounds(tmp_path: Path) -> None:
    made: list[NodeProc] = []
    try:
        for _ in range(3):
            node = NodeProc(tmp_path, "run", 2, 3)
            made.append(node)
            node.call("create")
        for _ in range(6):  # rounds: everyone leaves and joins again
            check_world(rdzv_all(made), 3)
            for node in made:
                node.call("leave")
        intents = next((tmp_path / "run").glob("era.*")) / "intents"
        names = [p.name for p in intents.iterdir()]
        assert len([n for n in names if n.startswith(".merge.")]) <= 3, names
        assert [n for n in names if not n.startswith(".")] == [], names
    finally:
        for node in made:
            node.close()
