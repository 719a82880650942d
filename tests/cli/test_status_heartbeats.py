"""The status's last heartbeat of each node: the mtime of its rendezvous heartbeat file.

A job file without ``rdzv_endpoint`` (the usual case: ``elastic_array`` from the README)
records ``None`` in ``agent.start``; the agent then uses ``<state_dir>/rdzv``. The status
read no heartbeat there and showed each node's last event instead ("28s ago" for a node
beating every second: seen on the local Slurm, 2026-12-05).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from slurm_elastic import events as ev
from slurm_elastic.cli.runs import RunLocation
from slurm_elastic.cli.status import collect


@pytest.mark.parametrize("endpoint", [None, "elsewhere"])
def test_status_reads_the_heartbeat_where_the_agent_beats(
    tmp_path: Path, endpoint: str | None
) -> None:
    state, run, node = tmp_path / "state", "41", "node1_123_0"
    rdzv = state / "rdzv" if endpoint is None else tmp_path / endpoint
    started = time.time() - 60
    config = {"state_dir": str(state), "rdzv_backend": "slurm",
              "rdzv_endpoint": None if endpoint is None else str(rdzv)}  # fmt: skip
    records = [
        ev.AgentStart(time=started, host="node1", pid=123, run_id=run, config=config),
        ev.RendezvousComplete(time=started + 1, host="node1", pid=123, run_id=run, node=node),
    ]
    events_dir = state / "events" / run
    events_dir.mkdir(parents=True)
    lines = "".join(json.dumps(r.to_record()) + "\n" for r in records)
    (events_dir / "node1.123.jsonl").write_text(lines)
    beat = rdzv / run / "era.1" / "hb" / node
    beat.parent.mkdir(parents=True)
    beat.write_bytes(b"\0" * 8)
    now = time.time() - 1
    os.utime(beat, (now, now))

    summary = collect(RunLocation(run, events_dir, state), slurm=False)
    (n,) = summary.nodes.values()
    assert n.last_heartbeat == pytest.approx(now, abs=0.01)  # not the event's `started + 1`
